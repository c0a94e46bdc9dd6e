"""A heal stage with gpus: N run from a plain process, as a flow's Prefect task
runs it: `cortiq.runner.run` relaunches the stage under torchrun.

    python -m bench.heal.relaunch [--out DIR]     # 2 GPUs (about 4 minutes on 2×H200)
    python -m bench.heal.relaunch --cpu --tiny    # the code paths: 2 gloo ranks on the CPU, no figures

A random-init model of Qwen3-0.6B geometry (bench/run.py's GEOMS; its MLPs
perturbed to make the student, as bench/heal/dist.py makes them) and pydoc text:
the teacher top-k stage and the training stage run through the stage runner
with gpus 1, then gpus N, each into a fresh stage cache, the caller in this
plain process. Checked and printed: the digests are the same both ways; the
ranks' result is what one process returns; the held-out losses at each
evaluation both ways; the training curve rank 0 logged came back into this
process's logger (points per metric); each stage's wall time including the
relaunch (process start, model load); then a run with rank 1 made to fail
($CORTIQ_FAIL_STAGE=train@1): the error line and whether the output was left
incomplete. A table is printed last; the rows go to $OUT/relaunch.json.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

from bench.common import env, finish, log, parser, pydoc_tdata, write_json


def parse_args():
    """The command line; the environment the relaunched ranks inherit is set here, before torch looks."""
    ap = parser(__doc__, cpu_help="gloo ranks on the CPU (no figures)", tiny_help="tiny geometry and data (a smoke test)")
    ap.add_argument("--geom", default="qwen3-0.6b", help="the healed geometry (bench/run.py GEOMS)")
    ap.add_argument("--gpus", type=int, default=2, help="processes of the relaunched runs")
    ap.add_argument("--tokens", type=int, default=240_000, help="tokens of text (train 90 %%)")
    ap.add_argument("--window", type=int, default=512, help="tokens per window")
    ap.add_argument("--batch", type=int, default=16, help="windows a step (the global batch)")
    ap.add_argument("--steps", type=int, default=20, help="training steps")
    ap.add_argument("--eval-every", type=int, default=5, help="steps between held-out evaluations")
    ap.add_argument("--work", default="/tmp/cortiq-relaunch", help="models, data and the stage caches")
    a = ap.parse_args()
    if a.tiny:
        a.geom, a.tokens, a.window, a.batch, a.steps, a.eval_every = "tiny", 12_000, 32, 4, 6, 2
    if a.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch looks: the ranks inherit it (gloo)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    os.environ["PYTHONPATH"] = env()["PYTHONPATH"]  # the relaunched ranks import this tree's cortiq
    return a


def settings(c, n: int):
    """The heal settings of both stages at `n` GPUs, as the runner takes them."""
    from cortiq.heal.settings import HealSettings

    a = c.a
    return HealSettings(window=a.window, batch=a.batch, epochs=c.epochs, train_from=0, topk=32, loss_on="all",
                        eval_every=a.eval_every, checkpoint_every=a.eval_every, lr=3e-4, compile=c.cuda,
                        device="cuda" if c.cuda else "cpu", gpus=n)


def stages(c, n: int, root: Path) -> dict:
    """The teacher top-k stage and the training stage at `n` GPUs into a fresh stage cache `root`: digests,
    wall times, the step rate, the evaluations and what came back into this process's loggers."""
    from cortiq import runner
    from cortiq.heal.stages import TRAIN
    from cortiq.heal.stages import TARGETS
    from cortiq.tracking import MemoryLogger

    shutil.rmtree(root, ignore_errors=True)
    lt, lr = MemoryLogger(), MemoryLogger()
    t1 = time.time()
    tg = runner.run(TARGETS, root, lt, progress=False, teacher=c.src, tdata=c.td, settings=settings(c, n))
    t2 = time.time()
    tr = runner.run(TRAIN, root, lr, progress=False, student=c.stu, targets=tg["path"], prefix=None, tdata=c.td,
                      settings=settings(c, n))
    t3 = time.time()
    m = tr["report"]["metrics"]
    return {"gpus": n, "ranks": tr["report"]["ranks"], "shard": tr["report"]["shard"],
            "targets_digest": tg["digest"], "train_digest": tr["digest"], "keys": sorted(tr),
            "targets_s": t2 - t1, "train_s": t3 - t2, "steps": m["steps"], "sec_per_step": m["sec_per_step"],
            "tok_s": c.a.batch * c.a.window / m["sec_per_step"] if m["sec_per_step"] else None,
            "evals": tr["report"]["evals"], "logged_loss_points": len(lr.series("loss")),
            "logged_heldout_points": len(lr.series("heldout")), "logged_targets": len(lt.metrics)}


def failed_rank(c, work: Path) -> dict:
    """A rank that fails ($CORTIQ_FAIL_STAGE=train@1): one error line, the output not complete."""
    from cortiq import runner
    from cortiq.errors import CortiqError
    from cortiq.heal.stages import TRAIN
    from cortiq.heal.stages import TARGETS

    root = work / "cache-fail"
    shutil.rmtree(root, ignore_errors=True)
    tg = runner.run(TARGETS, root, progress=False, teacher=c.src, tdata=c.td, settings=settings(c, 1))
    params = dict(student=c.stu, targets=tg["path"], prefix=None, tdata=c.td, settings=settings(c, c.a.gpus))
    os.environ[runner.FAIL_ENV] = "train@1"
    t1 = time.time()
    try:
        runner.run(TRAIN, root, progress=False, **params)
        fail = {"error": None}
    except CortiqError as e:
        fail = {"error": str(e)}
    finally:
        del os.environ[runner.FAIL_ENV]
    fail.update({"wall_s": time.time() - t1, "incomplete": not runner.cache_entry(TRAIN, root, **params).ready()})
    return fail


def main() -> int:
    a = parse_args()
    import torch

    from bench.heal.dist import make_models
    from bench.run import GEOMS
    from cortiq.data import Tdata, windows

    cuda = not a.cpu
    if cuda and torch.cuda.device_count() < a.gpus:
        log(f"needs {a.gpus} CUDA devices, this machine has {torch.cuda.device_count()}")
        return 1
    work = Path(a.work) / a.geom
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    src, stu = make_models(GEOMS[a.geom], work, "cuda" if cuda else "cpu")
    td = pydoc_tdata(src, work / "td", a.tokens)
    log(f"models and data: {time.time() - t0:.0f} s")
    n_train = len(windows(Tdata.open(td), "train", a.window, loss_on="all"))
    c = SimpleNamespace(a=a, cuda=cuda, src=src, stu=stu, td=td, epochs=a.steps / max(n_train // a.batch, 1))
    rows = [stages(c, 1, work / "cache-1"), stages(c, a.gpus, work / f"cache-{a.gpus}")]
    for r in rows:
        log(json.dumps({k: v for k, v in r.items() if k != "evals"}))
    fail = failed_rank(c, work)
    dev = "CPU (gloo)" if a.cpu else f"{a.gpus}× {torch.cuda.get_device_name()}"
    write_json(a.out, "relaunch.json", {"device": dev, "torch": torch.__version__, "geom": a.geom,
                                        "rows": rows, "failure": fail})
    return table(rows, fail, dev, a)


def table(rows, fail, dev, a) -> int:
    import torch

    one, many = rows
    same = one["targets_digest"] == many["targets_digest"] and one["train_digest"] == many["train_digest"]
    print(f"\n{dev}, torch {torch.__version__}; {a.geom}: window {a.window}, global batch {a.batch}, "
          f"{one['steps']} steps; the stages run by cortiq.runner.run from a plain process")
    print("\n| step | held-out loss, gpus 1 | held-out loss, gpus %d | difference |" % a.gpus)
    print("| --- | --- | --- | --- |")
    for e1, e2 in zip(one["evals"], many["evals"]):
        print(f"| {e1['step']} | {e1['heldout']:.5f} | {e2['heldout']:.5f} | {e2['heldout'] - e1['heldout']:+.2e} |")
    print("\n| gpus | ranks | shard | targets s | train s | s/step | train tok/s | loss points logged | held-out points |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        tok = f"{r['tok_s'] / 1e3:.1f}k" if r["tok_s"] else ""
        print(f"| {r['gpus']} | {r['ranks']} | {r['shard']} | {r['targets_s']:.1f} | {r['train_s']:.1f} | "
              f"{r['sec_per_step']:.3f} | {tok} | {r['logged_loss_points']} | {r['logged_heldout_points']} |")
    print(f"\nsame digests and result keys: {same and one['keys'] == many['keys']}")
    print(f"a failed rank ({fail['wall_s']:.0f} s): incomplete output {fail['incomplete']}; error: {fail['error']}")
    ok = same and fail["error"] and fail["incomplete"] and many["ranks"] == a.gpus
    return 0 if ok else 1


if __name__ == "__main__":
    finish(main())
