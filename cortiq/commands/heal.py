"""`cortiq heal STUDENT.cmf --teacher SOURCE.cmf --data TDATA --out HEALED.cmf`."""

from __future__ import annotations

HELP = "heal a student by distillation from its source (sparse-target KL / CE mix), export it and score NLL"
DESCRIPTION = (
    "A sparse picture of the teacher's next-token distribution on the data's train and val windows becomes "
    "the target (--target: top-k, top-k plus a rest bucket, k tokens sampled from the teacher, or the whole "
    "distribution online; --ce mixes in the data's own next token; --ce 1 runs no teacher); layers below "
    "--train-from run once and are cached; the layers from --train-from up (or their MLPs, --ffn-only) train "
    "with Adam; the best held-out checkpoint is exported in the student's codecs. The last line gives the "
    "NLL of source, student and healed and the share of the pruning gap recovered, on --eval-data (text of "
    "another source, which the heal never saw) when given, else on the heal data's own test split (where "
    "adapting to that text counts too). A killed run started again resumes from its last checkpoint (under --work)."
)
ORDER = 40

#: option help per HealSettings field (the defaults come from the dataclass)
_HELP = {
    "train_from": "lowest trained layer (the ones below are frozen and cached)",
    "ffn_only": "train only the MLPs of the trained layers",
    "genesis": "Genesis schedule: the trained window widens from the top layers down epoch by epoch",
    "target": "the teacher's side of the target: topk (renormalised top-k), topk+rest (the k entries and a "
              "bucket for the rest of the vocabulary), sampled (k draws from the teacher, unbiased), "
              "full (the whole distribution, teacher run online; small models)",
    "topk": "teacher entries stored per row (the top k, or the draws per row for --target sampled)",
    "ce": "weight of the data's own next token (0: KL to the teacher only, 1: plain cross-entropy)",
    "loss_on": "tokens scored: 'answer' (from each record's first scored position) or 'all'",
    "epochs": "passes over the train windows",
    "lr": "peak learning rate (Adam)",
    "warm": "share of the steps the rate ramps up over (then cosine to 0.1 of the peak)",
    "clip": "gradient-norm clip",
    "window": "tokens per window",
    "batch": "windows per step",
    "eval_every": "steps between held-out evaluations",
    "checkpoint_every": "steps between resumable checkpoints (0: none)",
    "seed": "data order seed (also seeds --target sampled's draws)",
    "device": "auto (cuda when available), cpu, cuda, cuda:N",
    "compute_dtype": "auto (bf16 on CUDA, f32 on CPU), f32, bf16, f16",
    "mem_budget_gb": "host memory the prefix cache plans with, GB (0: half of this machine's)",
    "head_chunk": "rows per chunk of the fused head + loss",
    "compile": "torch.compile each decoder layer on CUDA (--no-compile: eager)",
    "gpus": "GPUs to run on: more than 1 re-runs this command under torchrun, one process per GPU (passes split "
            "the windows, training splits each batch: the same steps as one GPU)",
    "shard": "training across GPUs: ddp (each GPU holds the trained layers), fsdp (weights, gradients and Adam "
             "state split across GPUs), auto (ddp when the tail fits half a GPU)",
}


def add_arguments(p):
    import argparse
    import dataclasses

    from ..heal.settings import COMPUTE, SHARDS, TARGETS, HealSettings

    p.add_argument("student", help="the student model (.cmf), e.g. a compress output")
    p.add_argument("--teacher", default=None, help="the source model (.cmf); not needed with --ce 1")
    p.add_argument("--data", required=True, help="a tdata directory (cortiq data build)")
    p.add_argument("--out", required=True, help="the healed model to write (.cmf)")
    p.add_argument("--work", default=None, help="stage outputs and checkpoints (default: OUT.work beside --out)")
    p.add_argument("--eval-data", default=None, metavar="TDATA",
                   help="a tdata directory of held-out text of another source (every record scored); the gap "
                        "recovered is reported on it")
    p.add_argument("--no-score", action="store_true", help="skip scoring source, student and healed (test split and --eval-data)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    g = p.add_argument_group("heal settings")
    for f in dataclasses.fields(HealSettings):
        opt = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            g.add_argument(opt, action=argparse.BooleanOptionalAction, default=f.default, help=_HELP[f.name])
            continue
        typ = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
        choices = {"compute_dtype": COMPUTE, "loss_on": ("answer", "all"), "target": TARGETS, "shard": SHARDS}.get(f.name)
        g.add_argument(opt, type=typ, default=f.default, choices=choices, help=_HELP[f.name])


def run(args) -> int:
    import dataclasses
    import json

    from .. import dist
    from ..heal import heal
    from ..heal.settings import HealSettings

    s = HealSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(HealSettings)})
    if args.teacher is None and s.ce < 1.0:
        from ..errors import CortiqError

        raise CortiqError("heal: --teacher is needed unless --ce 1")
    if s.gpus > 1 and not dist.under_torchrun():
        from ..heal import check_inputs

        check_inputs(args.student, args.teacher, args.data, s)  # bad input: one line here, not one per rank
        return dist.launch(args._argv, s.gpus)  # this command again, one process per GPU
    dist.init()
    try:
        rep = heal(args.student, args.teacher, args.data, s, args.out, work_dir=args.work, progress=not args.quiet,
                   score_split=None if args.no_score else "test", eval_data=None if args.no_score else args.eval_data)
    finally:
        dist.finish()
    if rep is None:  # another rank than 0: rank 0 reports
        return 0
    m = rep["metrics"]
    print(f"healed: {rep['out']}  held-out {m['heldout_start']:.5f} -> {m['heldout_best']:.5f} "
          f"(best step {m['best_step']} of {m['steps']}, {m['sec_per_step']:.2f} s/step)")
    if "nll" in rep and "eval_nll" in rep:
        print("test NLL (heal data): " + "  ".join(f"{k} {v:.4f}" for k, v in rep["nll"].items()))
    gap = rep.get("gap")
    if gap:
        names = {"source": "source", "student": "pruned", "healed": "healed"}
        line = "NLL on " + gap["text"] + ": " + "  ".join(f"{names[k]} {v:.4f}" for k, v in gap["nll"].items())
        if "gap_recovered" in gap:
            line += f"  (gap recovered {gap['gap_recovered']:.1%})"
        print(line)
    with open(str(args.out) + ".report.json", "w") as f:
        json.dump({"metrics": m, "nll": rep.get("nll"), "eval_nll": rep.get("eval_nll"), "gap": gap,
                   "evals": rep["evals"]}, f, indent=2)
    return 0
