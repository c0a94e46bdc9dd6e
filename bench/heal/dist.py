"""Heal on more than one GPU: the same heal on 1 and on 2 GPUs, then one
fully sharded step of an 8B geometry, in one call.

    python -m bench.heal.dist [--out DIR]            # 2 GPUs (about 6 minutes on 2×H200)
    python -m bench.heal.dist --cpu --tiny           # the code paths: 2 gloo ranks on the CPU, no figures

1. A random-init model of Qwen3-1.7B geometry (bench/run.py's GEOMS; its MLPs
   perturbed to make the student) is healed on the pydoc text by the library's
   own stages under torchrun: the teacher top-k pass (each rank its share of
   the windows, Arrow shards) and training of every layer (each rank its share
   of every global batch; `shard` auto: FSDP2 at this size), first on 1 GPU,
   then on 2, same data, same steps, same global batch. `--runs` names other
   wrappings (ddp, fsdp keep/reshard, units of N layers), and on one GPU wraps
   one rank all the same (the wrapper's CPU cost without communication). Printed: the held-out loss at each evaluation
   both ways and the training tokens/s (median step after the compile
   warm-up), with the 2-GPU speed-up (target ≥ 1.8×).
2. A Qwen3-8B geometry (hidden 4096, 36 layers, MLP 12288, untied head) built
   in place on each rank (`--big`, `--big-gpus`, `--big-memory` choose another
   size, GPU count or memory plan) and trained for two steps with FSDP2 (f32 master
   weights split across the GPUs, bf16 compute, f32 gradient reduction) on
   random targets: the step time and the peak memory of each GPU.

Random weights measure time, not quality: the held-out losses are printed to
compare one GPU with two. A table is printed last; the rows go to
$OUT/dist.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import env as child_env
from bench.common import finish, log, parser, pydoc_tdata, write_json
from bench.run import GEOMS
from bench.heal.stages import arch_of

BIG = {
    # Qwen3-8B: hidden 4096, 36 layers, MLP 12288, 32 heads / 8 KV heads of 128, untied head
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv=8, head_dim=128, inter=12288, vocab=151936, tie=False),
    # the smoke-test size of the sharded step
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=96, vocab=259, tie=False),
}


# ── the parent: files, then one torchrun per configuration ────────────────


def make_models(g: dict, d: Path, device: str) -> tuple[Path, Path]:
    """A random-init source (bf16, std 0.02, norms 1) and a student with its MLPs perturbed (f32)."""
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    src, stu = d / "source.cmf", d / "student.cmf"
    if src.exists() and stu.exists():
        return src, stu
    arch = arch_of(g)
    arch.mtp_layers = 0
    torch.manual_seed(0)
    with torch.device(device):
        m = CausalLM(arch)
    doc = new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [256]))
    with torch.no_grad():
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        write_cmf(src, doc, specs_from_tensors([(n, p.detach().to(torch.bfloat16).cpu()) for n, p in m.named_parameters()], "bf16"))
        for n, p in m.named_parameters():
            if ".mlp." in n:
                p.add_(torch.randn_like(p), alpha=0.01)
        write_cmf(stu, doc, specs_from_tensors([(n, p.detach().float().cpu()) for n, p in m.named_parameters()], "f32"))
    del m
    return src, stu


def torchrun(n: int, args: list[str], env: dict, timeout: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m", "bench.heal.dist", *args]
    log("$ " + " ".join(cmd))
    try:
        return subprocess.run(cmd, env=env, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return 124


def parse_args():
    ap = parser(__doc__, cpu_help="gloo ranks on the CPU (no figures)", tiny_help="tiny geometries and data (a smoke test)")
    ap.add_argument("--geom", default="qwen3-1.7b", help="the healed geometry (bench/run.py GEOMS)")
    ap.add_argument("--big", default="qwen3-8b", help="the fully sharded step's geometry")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=480_000, help="tokens of text (train 90 %%)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32, help="windows a step (the global batch)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--big-window", type=int, default=2048)
    ap.add_argument("--big-batch", type=int, default=2, help="windows per step of the 8B step (over all GPUs)")
    ap.add_argument("--work", default="/tmp/cortiq-dist")
    ap.add_argument("--worker", choices=["heal", "big"], help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--compile", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--runs", default="1:auto,2:auto",
                    help="the heal runs, comma-separated GPUS:SHARD[:keep|:reshard][:uN] (shard auto|ddp|fsdp; "
                         "keep/reshard: FSDP2 keeps each layer's gathered weights for its backward, or gathers them "
                         "again; uN: N decoder layers an FSDP2 unit when kept)")
    ap.add_argument("--big-runs", default="1,0", help="the 8B step: compiled layers (1) then, if that fails, eager (0)")
    ap.add_argument("--big-gpus", type=int, default=0, help="GPUs of the sharded step (0: --gpus); on 1 it is "
                    "still sharded by FSDP2 (a one-rank mesh: its hooks, its code paths)")
    ap.add_argument("--big-memory", default="auto", help="the sharded step's heal memory setting (e.g. checkpoint)")
    ap.add_argument("--profile", action="store_true",
                    help="rank 0 profiles three steps of each heal run: per step, GPU busy, NCCL exposed, idle, top kernels")
    ap.add_argument("--shard", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--keep", default="", help=argparse.SUPPRESS)
    ap.add_argument("--units", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.geom, a.big, a.tokens, a.window, a.batch, a.steps, a.eval_every = "tiny", "tiny", 12_000, 32, 4, 6, 2
        a.big_window, a.big_batch = 32, 2
    return a


def heal_runs(a, out: Path, env: dict, common: list[str]) -> list[dict]:
    """One torchrun of the heal worker per --runs entry: each row its result (or its exit status)."""
    rows = []
    for i, spec in enumerate(r for r in a.runs.split(",") if r):
        n, shard, *opts = spec.split(":") + ["auto"] * (":" not in spec)
        n = int(n)
        keep = next((o for o in opts if o in ("keep", "reshard")), "")
        units = next((int(o[1:]) for o in opts if o.startswith("u")), 0)
        res = out / f"heal-{i}.json"
        res.unlink(missing_ok=True)
        t1 = time.time()
        rc = torchrun(n, ["--worker", "heal", "--result", str(res), "--compile", str(int(not a.cpu)), "--shard", shard,
                          "--keep", keep, "--units", str(units), *common] + (["--cpu"] if a.cpu else [])
                      + (["--profile"] if a.profile else []), env, 300)
        row = json.loads(res.read_text()) if res.exists() else {"error": f"exit {rc}"}
        row.update({"part": f"heal {a.geom}" + (f" {shard}" if shard != "auto" else "") + (f" {keep}" if keep else "")
                    + (f" u{units}" if units else ""),
                    "gpus": n, "wall_s": time.time() - t1})
        rows.append(row)
        log(json.dumps({k: v for k, v in row.items() if k != "profile"})[:400])
    return rows


def big_runs(a, out: Path, env: dict, common: list[str]) -> list[dict]:
    """The sharded step of the big geometry: compiled first, then (where that fails) eager, per --big-runs."""
    rows = []
    for compile_ in (int(c) for c in a.big_runs.split(",") if c and (not a.cpu or c == "0")):
        res = out / "big.json"
        res.unlink(missing_ok=True)
        t1 = time.time()
        big_gpus = a.big_gpus or a.gpus
        rc = torchrun(big_gpus, ["--worker", "big", "--result", str(res), "--compile", str(compile_),
                                 "--big-memory", a.big_memory, *common] + (["--cpu"] if a.cpu else []), env, 300)
        row = json.loads(res.read_text()) if res.exists() else {"error": f"exit {rc}"}
        row.update({"part": f"fsdp step {a.big}" + ("" if compile_ else " (eager)")
                    + (f" {a.big_memory}" if a.big_memory != "auto" else ""), "gpus": big_gpus,
                    "wall_s": time.time() - t1})
        rows.append(row)
        log(json.dumps(row)[:400])
        if "error" not in row:
            break
    return rows


def main():
    a = parse_args()
    if a.worker == "heal":
        return worker_heal(a)
    if a.worker == "big":
        return worker_big(a)

    cuda = not a.cpu
    if cuda:
        assert torch.cuda.device_count() >= a.gpus, f"needs {a.gpus} CUDA devices"
    work = Path(a.work) / a.geom
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = child_env()
    if a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    t0 = time.time()
    src, stu = make_models(GEOMS[a.geom], work, "cuda" if cuda else "cpu")
    td = pydoc_tdata(src, work / "td", a.tokens)
    log(f"models and data: {time.time() - t0:.0f} s")
    common = ["--geom", a.geom, "--tokens", str(a.tokens), "--window", str(a.window), "--batch", str(a.batch),
              "--steps", str(a.steps), "--eval-every", str(a.eval_every), "--work", str(work), "--data", str(td),
              "--big", a.big, "--big-window", str(a.big_window), "--big-batch", str(a.big_batch)]
    rows = heal_runs(a, out, env, common) + big_runs(a, out, env, common)
    dev = "CPU (gloo)" if a.cpu else f"{a.gpus}× {torch.cuda.get_device_name()}"
    write_json(out, "dist.json", {"device": dev, "torch": torch.__version__, "rows": rows})
    table(rows, dev, a)


def table(rows, dev, a):
    print(f"\n{dev}, torch {torch.__version__}; heal: window {a.window}, global batch {a.batch}, {a.steps} steps")
    heal = [r for r in rows if r["part"].startswith("heal")]
    if len(heal) == 2 and all("evals" in r for r in heal):
        one, two = heal
        print("\n| step | held-out loss, 1 GPU | held-out loss, 2 GPUs | difference |")
        print("| --- | --- | --- | --- |")
        for e1, e2 in zip(one["evals"], two["evals"]):
            print(f"| {e1['step']} | {e1['heldout']:.5f} | {e2['heldout']:.5f} | {e2['heldout'] - e1['heldout']:+.2e} |")
    print("\n| part | GPUs | train tok/s | speed-up | teacher stage s (load + pass) | step s | peak GiB per GPU | wall s | note |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = next((r.get("tok_s") for r in heal if r["gpus"] == 1), None)
    for r in rows:
        tok = r.get("tok_s")
        up = f"{tok / base:.2f}×" if tok and base and r["part"].startswith("heal") else ""
        peak = " / ".join(f"{x:.1f}" for x in r.get("peak_gib", []))
        print(f"| {r['part']} | {r['gpus']} | {'' if tok is None else f'{tok / 1e3:.1f}k'} | {up} | "
              f"{r.get('teacher_s') or 0:.1f} | {r.get('step_s') or 0:.3f} | {peak} | {r['wall_s']:.0f} | "
              f"{r.get('error', '')[:40] or r.get('shard', '')} |")
    for r in rows:
        if r.get("profile"):
            print_profile(r["part"] + f", {r['gpus']} GPU(s)", r["profile"])
    for r in rows:
        if r.get("traceback"):
            print(f"\n{r['part']}: rank 0's traceback (last lines)\n" + "\n".join(r["traceback"].splitlines()[-25:]))


# ── the profile of three steps (rank 0's GPU) ──────────────────────────────


def _merged(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a_, b_ in sorted(iv):
        if out and a_ <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b_)
        else:
            out.append([a_, b_])
    return [(x, y) for x, y in out]


def _length(iv) -> float:
    return sum(b_ - a_ for a_, b_ in iv)


def analyse_trace(path: Path, steps: int) -> dict:
    """Per step, in ms: the span of the GPU's work, the time some kernel ran,
    NCCL kernels' time and the part of it no compute kernel overlapped, idle time
    and the fused Adam's kernels; and the top kernels by time."""
    ev = json.loads(Path(path).read_text())["traceEvents"]
    ks = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in ev
          if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ks:
        return {}
    comm = _merged([(x, y) for x, y, n in ks if "nccl" in n.lower()])
    comp = _merged([(x, y) for x, y, n in ks if "nccl" not in n.lower()])
    busy = _merged(comm + comp)
    span = max(y for _, y, _ in ks) - min(x for x, _, _ in ks)
    both = _length(comm) + _length(comp) - _length(busy)
    top: dict[str, float] = {}
    for x, y, n in ks:
        top[n[:70]] = top.get(n[:70], 0.0) + (y - x)
    per = 1e3 * steps  # µs over `steps` steps -> ms a step
    return {"span_ms": span / per, "busy_ms": _length(busy) / per, "compute_ms": _length(comp) / per,
            "nccl_ms": _length(comm) / per, "nccl_exposed_ms": (_length(comm) - both) / per,
            "idle_ms": (span - _length(busy)) / per,
            "adam_ms": sum(y - x for x, y, n in ks if "adam" in n.lower()) / per,
            "top": sorted(((v / per, k) for k, v in top.items()), reverse=True)[:10]}


def print_profile(title: str, p: dict) -> None:
    print(f"\n{title}: per step (ms) span {p['span_ms']:.1f}, GPU busy {p['busy_ms']:.1f} (compute {p['compute_ms']:.1f}, "
          f"NCCL {p['nccl_ms']:.1f} of which exposed {p['nccl_exposed_ms']:.1f}), idle {p['idle_ms']:.1f}, "
          f"Adam kernels {p['adam_ms']:.1f}")
    for ms, name in p["top"]:
        print(f"    {ms:8.2f} ms  {name}")


# ── the workers (one per rank, under torchrun) ─────────────────────────────


def _peaks(dist) -> list[float]:
    p = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    return [float(x) for x in dist.gather(p)]


def _traceback_kept(worker):
    """Run `worker(a)`; on a failure the traceback goes into the result file (rank 0's) and the exit is 1."""
    def run(a) -> int:
        try:
            return worker(a)
        except Exception:
            import traceback

            from cortiq import dist

            if dist.rank() == 0:
                Path(a.result).write_text(json.dumps({"error": "failed", "traceback": traceback.format_exc()}))
            raise
    return run


class _Profiled:
    """A logger that steps a profiler at every training step (rank 0 only)."""

    def __init__(self, inner, prof):
        self.inner, self.prof = inner, prof

    def __getattr__(self, k):
        return getattr(self.inner, k)

    def log_metrics(self, metrics, step=None):
        self.inner.log_metrics(metrics, step=step)
        if "tokens_per_s" in metrics:
            self.prof.step()


@_traceback_kept
def worker_heal(a) -> int:
    from cortiq import dist
    from cortiq.heal import parallel
    from cortiq.heal import stages as heal_stages
    from cortiq.heal.settings import HealSettings
    from cortiq.heal.stages import train
    from cortiq.tracking import MemoryLogger

    dist.init()
    n = dist.world()
    if a.keep:
        parallel.KEEP_GATHERED_SHARE = 1.0 if a.keep == "keep" else 0.0
    if a.units:
        parallel.UNIT_LAYERS = a.units
    if n == 1 and a.shard in ("ddp", "fsdp"):
        # one rank wrapped all the same (a one-rank mesh): the wrapper's own cost, no communication
        parallel.choose_sharding = lambda kind, tail, device, genesis=False: a.shard
    work = Path(a.work)
    td = Path(a.data)
    from cortiq.data import Tdata, windows

    n_train = len(windows(Tdata.open(td), "train", a.window, loss_on="all"))
    epochs = a.steps / max(n_train // a.batch, 1)
    s = HealSettings(window=a.window, batch=a.batch, epochs=epochs, train_from=0, topk=32, loss_on="all",
                     eval_every=a.eval_every, checkpoint_every=0, compile=bool(a.compile), lr=3e-4,
                     device="cpu" if a.cpu else "auto", gpus=n, shard=a.shard)
    tdir = work / f"targets-{n}gpu-{heal_stages.targets_digest(work / 'source.cmf', td, s)}"
    t0 = time.perf_counter()
    if not dist.agree((tdir / "meta.json").exists()):
        heal_stages.teacher_targets(work / "source.cmf", td, s, tdir, progress=False)
    teacher_s = time.perf_counter() - t0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    log_ = MemoryLogger()
    trace = Path(a.result).with_suffix(".trace.json")
    work_dir = work / f"train-{n}gpu-{a.shard}-{a.keep}-u{a.units}"
    if a.profile and dist.is_main() and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        # steps 7-9: past the compile warm-up, clear of the held-out evaluations every 5 steps
        with profile(activities=acts, schedule=schedule(wait=5, warmup=1, active=3),
                     on_trace_ready=lambda p: p.export_chrome_trace(str(trace))) as prof:
            rep = train(work / "student.cmf", tdir, None, td, s, work_dir, _Profiled(log_, prof), progress=True)
    else:
        rep = train(work / "student.cmf", tdir, None, td, s, work_dir, log_, progress=dist.is_main())
    peaks = _peaks(dist)
    if dist.is_main():
        rates = [v for k, v, step in log_.metrics if k in ("tokens_per_s", "train.tokens_per_s") and step > 3]
        rates.sort()
        tok_s = rates[len(rates) // 2] if rates else None
        Path(a.result).write_text(json.dumps({
            "tok_s": tok_s, "teacher_s": teacher_s, "steps": rep["metrics"]["steps"], "evals": rep["evals"],
            "step_s": (a.batch * a.window / tok_s) if tok_s else None, "peak_gib": peaks, "shard": rep["shard"],
            "losses": [h["loss"] for h in rep["history"]],
            "profile": analyse_trace(trace, 3) if trace.exists() else None}))
    dist.finish()
    return 0


@_traceback_kept
def worker_big(a) -> int:
    import numpy as np
    import pyarrow as pa

    from cortiq import dist
    from cortiq.heal.parallel import Fsdp, prepare
    from cortiq.heal.rows import WindowRows
    from cortiq.heal.settings import HealSettings
    from cortiq.data.windowing import batch_indices
    from cortiq.heal.train import SplitData, StudentTail, fit, train_index
    from cortiq.model import CausalLM
    from cortiq.tracking import MemoryLogger

    dist.init()
    dev = torch.device("cpu") if a.cpu else dist.device("cuda")
    g = BIG.get(a.big) or GEOMS[a.big]
    arch = arch_of(g)
    arch.mtp_layers = 0
    torch.manual_seed(0)  # every rank builds the same weights
    with torch.device(dev):
        model = CausalLM(arch)
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    cdt = torch.float32 if a.cpu else torch.bfloat16
    s = HealSettings(window=a.big_window, batch=a.big_batch, epochs=2.0, eval_every=10**6, checkpoint_every=0, lr=1e-5,
                     topk=32, shard="fsdp", compile=bool(a.compile), device=str(dev), gpus=dist.world(),
                     memory=a.big_memory)
    tail = StudentTail(model, 0, False, drop_prefix=False)
    compiled = bool(a.compile) and dev.type == "cuda"
    if dist.world() > 1:
        sharding = prepare(tail, s, dev, cdt, compile=compiled)
    else:  # one rank sharded all the same: FSDP2's hooks around the (compiled, checkpointed) layers
        if compiled:
            tail.model.compile_layers()
        sharding = Fsdp(tail, dev, cdt).wrap()

    T, B, k, V = a.big_window, a.big_batch, 32, g["vocab"]
    rng = np.random.default_rng(0)

    def rows(arr):
        flat = np.ascontiguousarray(arr).reshape(-1)
        t = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(flat), flat.size // arr.shape[0])})
        return WindowRows(t, "x", arr.shape[1:])

    def split(n, train):
        p = rng.random((n, T, k), dtype=np.float32)
        return SplitData(rng.integers(0, V, (n, T)), rows(rng.integers(0, V, (n, T, k)).astype(np.uint32)),
                         rows(p / p.sum(-1, keepdims=True)), np.full(n, float(T)),
                         train_index(n, B) if train else batch_indices(n, B))

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    log_ = MemoryLogger()
    rep = fit(tail, split(B, True), split(B, False), s, Path(a.work) / "big", dev, cdt, logger=log_,
              progress=False, sharding=sharding)
    peaks = _peaks(dist)
    if dist.is_main():
        rates = [v for k_, v, _ in log_.metrics if k_ == "tokens_per_s"]
        tok_s = rates[-1]
        Path(a.result).write_text(json.dumps({
            "tok_s": tok_s, "step_s": B * T / tok_s, "first_step_s": B * T / rates[0], "peak_gib": peaks,
            "shard": sharding.kind, "trained_weights": rep["metrics"]["trained_weights"],
            "losses": [h["loss"] for h in rep["history"]]}))
    dist.finish()
    return 0


if __name__ == "__main__":
    finish(main())
