"""The whole pipeline on one GPU, stage by stage: wall time and throughput; heal's
memory plans against the transformers KD baseline; the mask step eager and graphed.

    python -m bench.pipeline.pipeline [--parts masks,memory,pipeline] [--geoms qwen3-0.6b,qwen3-1.7b] [--out DIR]
    python -m bench.pipeline.pipeline --cpu --tiny   # every part's code on a CPU at tiny sizes, no numbers

On the GPU machine (python3.12, torch 2.11, no prefect/mlflow) the 8-bit Adam
plans need torchao: its wheel travels with the working tree and goes in with

    python3 -m pip install --no-deps --target /tmp/site .dev/whl_mem/torchao-*.whl && PYTHONPATH=/tmp/site python3 -m bench.pipeline.pipeline

(without it those plans' rows say so and the others run). Parts, in the order
given: `masks` (bench/heal/memory.py: the DTG-MA step eager vs `graph=True`, random
SmolLM2-135M geometry), `memory` (bench/heal/memory.py: heal's student step at
`--memory-geom` under each memory plan, and the transformers KD baseline: tokens/s,
peak memory, auto's estimate), `pipeline` (below, per geometry of `--geoms`).
Each part's rows go to pipeline.json as soon as it ends; a part not started
within `--budget` seconds is skipped (so one call's limit keeps what finished).

The pipeline part runs compress (DTG-MA masks → Grams → fold with repair) → heal (teacher top-k,
frozen prefix, one epoch, export) → score (test NLL of source, student and
healed) → MTP heal (trunk pass, draft training) → re-encode (q8 and q4, each
re-scored), on a random-init model of the named geometry (bench/run.py's) and
a byte-tokenized text. Each stage is the library's own stage function, the one
`cortiq compress` / `cortiq heal` / `cortiq mtp heal` and the Prefect tasks
call (the orchestrator itself is not on the GPU machine); the re-encode is
the re-encode task's body (copy_specs into a codec, then score). Random
weights measure time, not quality: the NLLs are printed only as a check that
every stage ran.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.common import finish, log, parser, print_table, write_json
from bench.run import GEOMS
from bench.heal.stages import arch_of


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Clock:
    """Wall seconds of each stage, the device drained at both ends."""

    def __init__(self):
        self.rows = []

    def __call__(self, stage, fn, tokens=None, **notes):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        s = time.perf_counter() - t0
        row = {"stage": stage, "secs": s, **notes}
        if tokens:
            row["tokens"], row["tok_s"] = tokens, tokens / s
        self.rows.append(row)
        log(json.dumps(row))
        return out


def source_model(g: dict, path: Path) -> Path:
    """A random-init CMF of geometry `g` (bf16, std 0.02, norms 1) with the byte tokenizer."""
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    arch = arch_of(g)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        m = CausalLM(arch)
    with torch.no_grad():
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    tensors = [(n, p.detach().to(torch.bfloat16).cpu()) for n, p in m.named_parameters()]
    del m
    return write_cmf(path, new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [256])), specs_from_tensors(tensors, "bf16"))


def text_data(model: Path, out: Path, tokens: int) -> Path:
    from cortiq.data import BuildSettings, build

    if not (out / "meta.json").exists():
        build(["corpus:pydoc"], model, out, BuildSettings(record_tokens=512, max_total_tokens=tokens,
                                                          fractions=(0.9, 0.05, 0.05)))
    return out


def run_geom(name: str, g: dict, a, work: Path, clock: "Clock") -> list[dict]:
    from cortiq.compress import compress
    from cortiq.compress.settings import CompressSettings, FoldSettings, GramSettings, MaskSettings
    from cortiq.data import Tdata
    from cortiq.heal.settings import HealSettings
    from cortiq.heal.stages import heal
    from cortiq.measure import recode, score
    from cortiq.mtp import MtpSettings, mtp_heal

    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    W, B = a.window, a.batch
    src = clock("source (random init, write)", lambda: source_model(g, d / "source.cmf"))
    td = clock("data (tokenize)", lambda: text_data(src, d / "td", a.tokens))
    n_train = sum(len(r.ids) for r in Tdata.open(td).records("train"))

    # ── compress ──
    ms = MaskSettings(max_steps=a.mask_steps, window=W, batch=B, loss_on="all")
    cs = CompressSettings(masks=ms, fold=FoldSettings(keep_frac=0.75, repair=True),
                          grams=GramSettings(window=W, batch=B, max_windows=a.gram_windows))
    rep = clock("compress (masks, Grams, fold + repair)",
                lambda: compress(src, td, cs, d / "student.cmf", work=d / "stages", log=log))
    st = rep["stages"]
    masks_tok = st["masks"]["metrics"]["mask_steps"] * W * B
    clock.rows[-1].update({"mask_steps": st["masks"]["metrics"]["mask_steps"],
                           "mask_s_per_step": st["masks"]["metrics"]["mask_sec_per_step"],
                           "mask_tok_s": masks_tok / (st["masks"]["metrics"]["mask_sec_per_step"] * st["masks"]["metrics"]["mask_steps"]),
                           "gram_sec": st["grams"]["metrics"]["gram_sec"]})

    # ── heal (targets, prefix, one epoch, export) and score ──
    hs = HealSettings(window=W, batch=B, epochs=1.0, train_from=g["layers"] // 2, topk=32, eval_every=10**6,
                      checkpoint_every=0, compile=not a.cpu)
    hrep = clock("heal (teacher top-k, prefix, 1 epoch, export)",
                 lambda: heal(d / "student.cmf", src, td, hs, d / "healed.cmf", work_dir=d / "heal", progress=False,
                              score_split=None), tokens=n_train)
    clock.rows[-1].update({"steps": hrep["metrics"].get("steps"), "memory": hrep.get("memory"),
                           "s_per_step": hrep["metrics"].get("sec_per_step")})
    n_test = sum(len(r.ids) for r in Tdata.open(td).records("test"))
    nll = clock("score (test NLL: source, student, healed)",
                lambda: score({"source": src, "student": d / "student.cmf", "healed": d / "healed.cmf"}, td,
                              progress=False), tokens=3 * n_test)
    clock.rows[-1]["nll"] = nll

    # ── MTP heal ──
    # windows of 512: the draft's own training length, and enough of them (every tenth is held out)
    mt = MtpSettings(window=min(W, 512), tokens=a.mtp_tokens, batch=B, epochs=1.0, eval_every=10**6, patience=0,
                     topk=32)
    mrep = clock("MTP heal (trunk pass, draft, 3 chain steps)",
                 lambda: mtp_heal(d / "healed.cmf", str(td), mt, d / "final.cmf"), tokens=a.mtp_tokens)
    clock.rows[-1]["drafts_per_round"] = mrep["metrics"]["drafts_per_round_after"]

    # ── re-encode into each codec, re-scored ──
    for codec in ("q8", "q4"):
        def reencode(codec=codec):
            return score({codec: recode(d / "final.cmf", d / f"final.{codec}.cmf", codec)}, td, progress=False)

        r = clock(f"re-encode {codec} + score", reencode, tokens=n_test)
        clock.rows[-1]["nll"] = r
    return clock.rows


def pipeline_rows(name: str, a, work: Path) -> list[dict]:
    """One geometry's stage rows (those that finished, and the error that stopped it)."""
    t0 = time.time()
    clock = Clock()
    try:
        run_geom(name, GEOMS[name], a, work, clock)
    except Exception as e:  # keep this geometry's finished stages and the other geometry's rows
        import traceback

        traceback.print_exc()
        clock.rows.append({"stage": "error", "error": f"{type(e).__name__}: {str(e)[:200]}"})
    for row in clock.rows:
        row["geom"] = name
    log(f"{name}: {time.time() - t0:.0f} s")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return clock.rows


def print_pipeline(rows, a, dev):
    print(f"\n{dev}, torch {torch.__version__}; window {a.window}, batch {a.batch}")
    cells = []
    for r in rows:
        notes = {k: v for k, v in r.items() if k not in ("geom", "stage", "secs", "tokens", "tok_s")}
        tok = f"{r['tok_s'] / 1e3:.1f}k" if "tok_s" in r else ""
        cells.append([r["geom"], r["stage"], f"{r.get('secs', 0):.1f}", tok, json.dumps(notes, default=str)[:160]])
    print_table(["geometry", "stage", "wall s", "tokens/s", "notes"], cells)


def main():
    from bench.heal import memory as M

    ap = parser(__doc__, cpu_help="smoke-test the code paths on the CPU",
                tiny_help="tiny geometries and short runs (with --cpu: the smoke test)")
    ap.add_argument("--parts", default="masks,memory,pipeline", help="what runs, in this order: masks, memory, pipeline")
    ap.add_argument("--geoms", default="qwen3-0.6b,qwen3-1.7b", help="pipeline geometries (bench/run.py's names)")
    ap.add_argument("--tokens", type=int, default=200_000, help="tokens of text (train 90 %%)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mask-steps", type=int, default=200, help="most DTG-MA steps of the pipeline's compress")
    ap.add_argument("--gram-windows", type=int, default=64)
    ap.add_argument("--mtp-tokens", type=int, default=131072, help="tokens of the MTP trunk pass and draft training")
    ap.add_argument("--memory-geom", default="qwen3-1.7b", help="the memory part's geometry")
    ap.add_argument("--memory-batch", type=int, default=4, help="the memory part's windows per step (bench/run.py's)")
    ap.add_argument("--memory-seq", type=int, default=2048, help="the memory part's tokens per window")
    ap.add_argument("--memory-steps", type=int, default=5, help="timed steps per memory plan (after 3 warm-up steps)")
    ap.add_argument("--bench-mask-steps", type=int, default=60, help="most steps of each masks-part run")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds after which no further part starts")
    ap.add_argument("--work", default="/tmp/cortiq-pipeline")
    a = ap.parse_args()
    if a.tiny:
        a.geoms, a.tokens, a.window, a.batch, a.mask_steps, a.gram_windows, a.mtp_tokens = "tiny", 12000, 64, 4, 5, 4, 4000
        a.memory_geom, a.memory_batch, a.memory_seq, a.memory_steps, a.bench_mask_steps = "tiny", 4, 64, 1, 6
    if not a.cpu:
        assert torch.cuda.is_available(), "the benchmark needs a CUDA device"
        torch.backends.cuda.matmul.allow_tf32 = True
    device = "cpu" if a.cpu else "cuda"
    dev = "CPU" if a.cpu else torch.cuda.get_device_name()
    res = {"device": dev, "torch": torch.__version__, "args": vars(a), "pipeline": [], "memory": [], "masks": [],
           "skipped": []}
    t_start = time.time()
    # the pipeline part is one item per geometry, so the budget can stop between them
    items = [("pipeline", g) if p == "pipeline" else (p, None) for p in a.parts.split(",")
             for g in (a.geoms.split(",") if p == "pipeline" else [None])]
    for part, geom in items:
        label = part if geom is None else f"{part} {geom}"
        if time.time() - t_start > a.budget:
            res["skipped"].append(label)
            log(f"{label}: not started, past the {a.budget:.0f} s budget")
            continue
        t0 = time.time()
        if part == "masks":
            res["masks"] = M.mask_steps(a.bench_mask_steps, a.tiny, device)
        elif part == "memory":
            res["memory"] = M.memory_rows(a.memory_geom, a.memory_batch, a.memory_seq, a.memory_steps, 1,
                                          {"baseline", "plans", "partial", "auto"}, [0.25, 0.5, 0.75], 0.5, device)
        elif part == "pipeline":
            res["pipeline"] += pipeline_rows(geom, a, Path(a.work))
        else:
            raise SystemExit(f"bench.pipeline.pipeline: unknown part {part!r} (masks, memory, pipeline)")
        log(f"{label}: {time.time() - t0:.0f} s")
        res["secs"] = time.time() - t_start
        write_json(a.out, "pipeline.json", res)
    if res["pipeline"]:
        print_pipeline(res["pipeline"], a, dev)
    if res["memory"] or res["masks"]:
        print(f"\nmemory plans: {a.memory_geom}, {a.memory_batch} windows of {a.memory_seq}, micro-batches of 1 window")
        M.print_tables(res["memory"], res["masks"])
    if res["skipped"]:
        print(f"\nnot started (past the {a.budget:.0f} s budget): {', '.join(res['skipped'])}")
    print(f"\ntotal {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    finish(main())
