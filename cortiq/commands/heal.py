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

def add_arguments(p):
    from ..heal.settings import HealSettings
    from ..settings_meta import add_arguments as add_settings
    from ._output import add_stage_io

    p.add_argument("student", help="the student model (.cmf), e.g. a compress output")
    p.add_argument("--teacher", default=None, help="the source model (.cmf); not needed with --ce 1")
    add_stage_io(p, "the healed model to write (.cmf)",
                 "stage outputs and checkpoints (default: the cortiq home's work/, shared with the flows)")
    p.add_argument("--eval-data", default=None, metavar="TDATA",
                   help="a tdata directory of held-out text of another source (every record scored); the gap "
                        "recovered is reported on it")
    p.add_argument("--no-score", action="store_true", help="skip scoring source, student and healed (test split and --eval-data)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_settings(p, HealSettings, title="heal settings")
    add_retain(p)


def add_retain(p):
    """The retain data's options (--retain-sources, --retain-share, ...): the parameter files' retain group."""
    from ..data.settings import RetainSettings
    from ..settings_meta import add_arguments as add_settings

    add_settings(p, RetainSettings, prefix="retain.", title="retain data (mixed into every batch; its test splits "
                                                           "make the general panel)")


def retain_args(args):
    from ..data.settings import RetainSettings
    from ..settings_meta import from_args

    return from_args(RetainSettings, args, prefix="retain.")


def check_io(args, inputs: list, also=()):
    """The output rule (store.check_output) over `inputs` and the retain sources that are folders,
    a --work that cannot be a folder, and a retain source that is --data itself refused, before
    any work. -> the retain settings"""
    from ..data.retain import check_not_data, folders
    from ..store import check_output, work_root

    retain = retain_args(args)
    check_output(args.out, [*inputs, *folders(retain.sources)], kind="cmf", force=args.force, also=also)
    work_root(args.work)
    check_not_data(args.data, retain.sources)
    return retain


def run(args) -> int:
    import json

    from .. import dist
    from ..heal import heal
    from ..heal.settings import HealSettings
    from ..settings_meta import from_args

    from ..store import write_text

    report = str(args.out) + ".report.json"
    retain = check_io(args, [args.student, args.teacher, args.data, args.eval_data], also=[report])
    s = from_args(HealSettings, args)
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
                   score_split=None if args.no_score else "test", eval_data=None if args.no_score else args.eval_data,
                   retain=retain)
    finally:
        dist.finish()
    if rep is None:  # another rank than 0: rank 0 reports
        return 0
    m = rep["metrics"]
    print(f"healed: {rep['out']}  held-out {m['heldout_start']:.5f} -> {m['heldout_best']:.5f} "
          f"(best step {m['best_step']} of {m['steps']}, {m['sec_per_step']:.2f} s/step)")
    if "nll" in rep and "eval_nll" in rep:
        print("test NLL (heal data): " + "  ".join(f"{k} {v:.4f}" for k, v in rep["nll"].items()))
    from ..measure import gap_line

    gap = rep.get("gap")
    texts = rep.get("texts") or {}
    if gap:
        names = {"source": "source", "student": "pruned", "healed": "healed"}
        line = "NLL on " + gap["text"] + ": " + "  ".join(f"{names[k]} {v:.4f}" for k, v in gap["nll"].items())
        if "gap_recovered" in gap:
            line += f"  (gap recovered {gap['gap_recovered']:.1%})"
        print(line)
    for name, label in (("data", "your data"), ("panel", "general panel")):
        if name in texts:
            print(gap_line(label, texts[name]))
    if rep.get("facts"):
        from ..facts.stages import facts_line

        print(facts_line(rep["facts"]))
    if "data" in texts and "panel" not in texts:
        # said, not left out: measured on SmolLM2-135M (25 % pruned, healed on one book), text of other
        # sources lost several times more without retain data than with pydoc mixed in (bench/QUALITY.md,
        # "Which retain source")
        print("general panel: none (no retain source apart from your data's own corpus, no --eval-data): text of "
              "other sources went unscored, and it can lose far more than your data; --retain-sources (corpus:pydoc, "
              "corpus:shakespeare, self or a tdata directory) mixes some in and scores its held-out part")
    # whole or not at all, and a full disk named (a half-written report would read as finished)
    write_text(report, json.dumps({"metrics": m, "nll": rep.get("nll"), "eval_nll": rep.get("eval_nll"), "gap": gap,
                                   "texts": texts, "facts": rep.get("facts"), "evals": rep["evals"]}, indent=2))
    return 0
