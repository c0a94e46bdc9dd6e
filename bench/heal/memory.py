"""Heal's student step under each memory plan against the plain transformers KD
loop, and the DTG-MA mask step eager against CUDA-graphed (called by
bench/pipeline/pipeline.py; runnable alone).

    python -m bench.heal.memory [--geom qwen3-1.7b] [--batch 4] [--seq 2048] [--steps 5] [--out DIR]
    python -m bench.heal.memory --parts baseline,plain,partial,auto   # the partial-checkpoint rows alone
    python -m bench.heal.memory --cpu --tiny   # the code paths on a CPU, measures nothing

The step is the trainer's own: `StudentTail` (all layers trained, as the
baseline trains them), `step_backward` (micro-batches when the plan says so;
the fused head + top-k KL), gradient clipping, then the optimizer of
`cortiq.heal.memory.make_optimizer` (fused Adam, or torchao's AdamW8bit);
f32 master weights, bf16 autocast, compiled layers. Each plan reports tokens/s
(median of CUDA-event-timed steps after warm-up), peak allocated memory, and
the estimate `memory: auto` decides by (weights + `step_bytes`), so the
estimate is checked against the measurement in the same call. The baseline is
bench/run.py's (transformers Qwen3, teacher online, full-vocabulary KL, AdamW).

Partial checkpointing: the step with the lowest quarter, half and three
quarters of the trained layers recomputed in the backward (`--partial`), and
`memory: auto` under a device budget of a share of the baseline's measured
peak (`--budget`, 0.5 by default: "half the baseline's memory"): heal's own
`memory_plan` picks the plan (the same call `fit` makes, with `device_mem_gb`
set to the budget), once at head chunks of 8192 rows and once at heal's
default 1024, and the row times what it picked. Without a measured baseline
peak (the CPU smoke test) the budget is that share of the plain plan's estimate.

The mask step: `learn_model_masks` on a random-init SmolLM2-135M geometry
(Llama, 30 layers, hidden 576, MLP 1536, vocab 49152) over random windows of
256 tokens, batch 4 (the stage defaults), bf16 autocast, once eager and once
with `graph=True`; the median step between evaluations.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
import torch

from bench import run as R
from bench.heal import stages as S
from bench.common import finish, log, parser, write_json

#: the plans timed: (label, memory parts, head chunk rows, gradient made in the head's
#: forward). "plain" is bench/run.py's cortiq step (chunks of 8192 rows); the row
#: before it is that step as it was (the head's logits recomputed in the backward);
#: the one after it, heal's default chunk.
PLANS = [
    ("plain, head recomputed in backward", (), 8192, False),
    ("plain", (), 8192, True),
    ("plain, head chunk 1024", (), 1024, True),
    ("checkpoint", ("checkpoint",), 8192, True),
    ("micro", ("micro",), 8192, True),
    ("adam8", ("adam8",), 8192, True),
    ("micro+adam8", ("micro", "adam8"), 8192, True),
    ("checkpoint+adam8", ("checkpoint", "adam8"), 8192, True),
    ("lean", ("checkpoint", "micro", "adam8"), 8192, True),
]
#: the rows `--parts plain` runs: the plain step at both head chunks (the references of the partial and auto rows)
PLAIN = ("plain", "plain, head chunk 1024")
K = 64  # teacher entries per row, as bench/run.py's


def _plan_step(arch, B, T, batch, parts, chunk, micro, device, layers=None, budget_gib=None):
    """(step function, auto's estimate in bytes, the plan) of one plan; the model, optimizer and
    gradients live in the step's closure, so they go when the caller drops it. `layers`: how
    many trained layers are checkpointed (None: all). `budget_gib`: `parts` is ignored and
    heal's `memory: auto` picks the plan under that device budget, as `fit` does."""
    from cortiq.heal import memory as mem
    from cortiq.heal.settings import HealSettings
    from cortiq.heal.train import StudentTail, memory_plan, step_backward

    dev = torch.device(device)
    cdt = torch.bfloat16 if device == "cuda" else torch.float32
    student = S.build(arch, torch.float32, device)
    tail = StudentTail(student, 0, ffn_only=False, drop_prefix=False)
    if device == "cuda":
        student.compile_layers()
    L = len(tail.params)
    if budget_gib is not None:
        s = HealSettings(batch=B, window=T, head_chunk=chunk, micro_batch=micro, memory="auto", device_mem_gb=budget_gib)
        plan = memory_plan(tail, s, dev)
    else:
        plan = mem.MemoryPlan(parts, (L if layers is None else min(layers, L)) if "checkpoint" in parts else 0, L)
    parts = plan.parts
    tail.checkpointed = plan.layers
    groups = [{"params": [p for _, p in tail.params[l]], "lr": 1e-5, "layer": l} for l in sorted(tail.params)]
    opt = mem.make_optimizer(groups, 1e-5, dev, adam8="adam8" in parts)
    params = [p for _, p in tail.named()]
    resident = sum(p.numel() * p.element_size() for p in student.parameters())
    est = resident + mem.step_bytes(mem.shape_of(tail, B, T, chunk), parts, micro, plan.layers)

    def step():
        step_backward(tail, batch, micro if "micro" in parts else 0, chunk, dev, cdt, None)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, est, plan


def heal_plans(geom: str, B: int, T: int, steps: int, micro: int, plans=PLANS, device: str = "cuda") -> list[dict]:
    """One row per plan: tokens/s, peak GiB, the auto estimate GiB. A plan is (label, parts,
    head chunk rows, gradient made ahead[, checkpointed layers[, auto's budget GiB]])."""
    import functools
    import gc

    import cortiq.heal.loss as L_
    from cortiq.heal.loss import topk_kl

    g = R.GEOMS[geom]
    arch = S.arch_of(g)
    timed, peak_reset, peak_gib = R.timers(device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, g["vocab"], (B, T), device=device, generator=gen)
    tids = torch.randint(0, g["vocab"], (B * T, K), device=device, generator=gen)
    tps = torch.softmax(torch.randn(B * T, K, device=device, generator=gen), -1)
    batch = (ids, None, tids, tps, float(B * T))
    rows = []
    for label, parts, chunk, ahead, *more in plans:
        layers, budget = (more + [None, None])[:2]
        row = {"geom": geom, "plan": label, "memory": "+".join(parts) or "plain", "head_chunk": chunk,
               "micro_windows": micro if "micro" in parts else B, "grad_ahead": ahead}
        if budget is not None:
            row["budget_gib"] = budget
        t0 = time.time()
        # the trainer's loss with the head's gradient made ahead (its default) or recomputed: the
        # target kinds read topk_kl from cortiq.heal.loss when they score a batch
        L_.topk_kl = functools.partial(topk_kl, grad_ahead=ahead)
        step = None
        try:
            gc.collect()
            peak_reset()
            step, est, plan = _plan_step(arch, B, T, batch, parts, chunk, micro, device, layers, budget)
            row.update({"memory": str(plan), "checkpointed": plan.layers, "layers": plan.of})
            if budget is not None:
                row["plan"] = f"{label}: {plan}"
                row["micro_windows"] = micro if "micro" in plan else B
            s = timed(step, warm=3, reps=steps)
            row.update({"tok_s": B * T / s, "step_ms": 1e3 * s, "peak_gib": peak_gib(), "estimate_gib": est / 2**30})
        except torch.cuda.OutOfMemoryError as e:
            row["error"] = f"OOM: {str(e)[:120]}"
        except Exception as e:  # keep the other plans' rows
            import traceback

            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del step  # the plan's model, optimizer and gradients
        row["secs"] = time.time() - t0
        log(json.dumps(row))
        rows.append(row)
        if device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    L_.topk_kl = topk_kl
    return rows


def partial_plans(geom: str, shares: list[float]) -> list[tuple]:
    """Checkpoint of the lowest share of the trained layers (all of them trained), head chunks of 8192."""
    L = R.GEOMS[geom]["layers"]
    ks = sorted({max(1, min(L, round(f * L))) for f in shares})
    return [(f"checkpoint {k}/{L}", ("checkpoint",), 8192, True, k) for k in ks]


def auto_plans(budget_gib: float, share: float, source: str) -> list[tuple]:
    """`memory: auto` under a device budget of `budget_gib`, at head chunks of 8192 and of 1024 rows."""
    return [(f"auto ≤ {share:.2f}× {source} ({budget_gib:.1f} GiB), head chunk {c}", (), c, True, None, budget_gib)
            for c in (8192, 1024)]


def budget_of(rows: list[dict], share: float) -> tuple[float, str] | None:
    """(`share` × the baseline's measured peak, what it is) or, without one (a CPU), that share of
    the plain plan's estimate; None when neither is in `rows`."""
    base = next((r for r in rows if r.get("who") == "baseline" and r.get("kd_peak_gib")), None)
    if base is not None:
        return share * base["kd_peak_gib"], "the baseline's peak"
    plain = next((r for r in rows if r.get("plan") == "plain" and "estimate_gib" in r), None)
    if plain is not None:
        return share * plain["estimate_gib"], "the plain plan's estimate"
    return None


def memory_rows(geom: str, B: int, T: int, steps: int, micro: int, parts: set[str], partial: list[float],
                budget: float, device: str = "cuda") -> list[dict]:
    """The heal rows of `parts` (baseline, plans or plain, partial, auto) in that order: the
    auto rows take their budget from the rows before them."""
    plans = PLANS if "plans" in parts else [p for p in PLANS if p[0] in PLAIN] if "plain" in parts else []
    if "partial" in parts:
        plans = plans + partial_plans(geom, partial)
    rows = ([baseline(geom, B, T, steps, device)] if "baseline" in parts else []) + \
        heal_plans(geom, B, T, steps, micro, plans, device=device)
    if "auto" in parts:
        got = budget_of(rows, budget)
        if got is None:
            log("auto rows: no baseline peak and no plain row to take a budget from (add baseline or plain to --parts)")
        else:
            rows += heal_plans(geom, B, T, steps, micro, auto_plans(got[0], budget, got[1]), device=device)
    return rows


def baseline(geom: str, B: int, T: int, steps: int, device: str = "cuda") -> dict:
    """bench/run.py's transformers KD step at the same geometry and batch."""
    rate = R.matmul_rate() if device == "cuda" else 1e12
    t0 = time.time()
    try:
        row = R.bench_baseline(geom, R.GEOMS[geom], B, T, steps, rate, device=device)
        row["plan"] = "baseline (transformers KD)"
    except torch.cuda.OutOfMemoryError as e:
        row = {"geom": geom, "who": "baseline", "plan": "baseline (transformers KD)", "error": f"OOM: {str(e)[:120]}"}
    row["secs"] = time.time() - t0
    log(json.dumps(row))
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def smollm2_arch(tiny: bool):
    from cortiq.arch import Arch

    if tiny:
        return Arch(arch_name="llama", vocab_size=259, hidden_size=64, num_layers=2, intermediate_sizes=[96] * 2,
                    num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=2048)
    return Arch(arch_name="llama", vocab_size=49152, hidden_size=576, num_layers=30, intermediate_sizes=[1536] * 30,
                num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
                max_position_embeddings=8192)


def mask_steps(steps: int, tiny: bool, device: str = "cuda") -> list[dict]:
    """DTG-MA mask step, eager and CUDA-graphed (CPU: eager only), on random windows."""
    from cortiq.compress.masks import learn_model_masks
    from cortiq.compress.settings import MaskSettings
    from cortiq.data import Windows

    arch = smollm2_arch(tiny)
    s = MaskSettings(max_steps=steps)
    rng = np.random.default_rng(0)
    n = s.batch * (steps + 2)

    def wins(count):
        ids = rng.integers(0, arch.vocab_size, (count, s.window + 1))
        return Windows(ids[:, :-1].copy(), ids[:, 1:].copy(), np.ones((count, s.window), np.float32), 0)

    train, val = wins(n), wins(s.val_windows or 4 * s.batch)
    dev = torch.device(device)
    rows = []
    for graph in ([False, True] if device == "cuda" else [False]):
        torch.manual_seed(0)
        with torch.device(device):
            from cortiq.model import CausalLM

            model = CausalLM(arch)
        with torch.no_grad():
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
        marks = []
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = learn_model_masks(model, train, val, s, progress=lambda step, row: marks.append(time.perf_counter()),
                              compute=torch.bfloat16 if device == "cuda" else torch.float32, graph=graph)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        plain = [t for i, t in enumerate(gaps, start=2) if (i - 1) % s.eval_every] or gaps or [wall]
        row = {"part": "mask step", "geom": "tiny" if tiny else "SmolLM2-135M (random)", "graph": graph,
               "steps": r.steps, "step_ms": 1e3 * statistics.median(plain), "wall_s": wall, "pruned": r.pruned}
        log(json.dumps(row))
        rows.append(row)
        del model
    return rows


def print_tables(heal_rows: list[dict], mask_rows: list[dict]) -> None:
    if heal_rows:
        base = next((r for r in heal_rows if r.get("who") == "baseline" and "error" not in r), None)
        plain = next((r for r in heal_rows if r.get("plan") == "plain" and "error" not in r), None)
        print("(×plain: against the plain step with the head's gradient made ahead, heal's default)")
        print("\n| geometry | plan | tokens/s | ×plain | ×baseline KD | peak GiB | ÷baseline peak | auto's estimate GiB |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in heal_rows:
            if "error" in r:
                print(f"| {r['geom']} | {r['plan']} | {r['error'][:80]} | | | | | |")
                continue
            tok = r.get("tok_s", r.get("kd_tok_s"))
            peak = r.get("peak_gib", r.get("kd_peak_gib"))
            xp = f"{tok / plain['tok_s']:.2f}" if plain else ""
            xb = f"{tok / base['kd_tok_s']:.2f}" if base else ""
            pb = f"{peak / base['kd_peak_gib']:.2f}" if base and base["kd_peak_gib"] else ""
            est = f"{r['estimate_gib']:.1f}" if "estimate_gib" in r else ""
            print(f"| {r['geom']} | {r['plan']} | {tok / 1e3:.1f}k | {xp} | {xb} | {peak:.1f} | {pb} | {est} |")
    if mask_rows:
        print("\n| mask step | geometry | steps | ms per step | whole run s | pruned |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in mask_rows:
            print(f"| {'CUDA graph' if r['graph'] else 'eager'} | {r['geom']} | {r['steps']} | {r['step_ms']:.1f} | "
                  f"{r['wall_s']:.1f} | {r['pruned']:.3f} |")


def main():
    ap = parser(__doc__, cpu_help="run on the CPU (a smoke test of the code paths)", tiny_help="tiny geometries, short runs")
    ap.add_argument("--geom", default="qwen3-1.7b", help="bench/run.py's geometry name")
    ap.add_argument("--batch", type=int, default=4, help="windows per step")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per window")
    ap.add_argument("--micro", type=int, default=1, help="windows per micro-batch in the micro plans")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per plan (after 3 warm-up steps)")
    ap.add_argument("--mask-steps", type=int, default=60, help="most DTG-MA steps of each mask run")
    ap.add_argument("--parts", default="baseline,plans,partial,auto,masks",
                    help="what to run: baseline (transformers KD), plans (every plan of PLANS), plain (the two plain "
                         "rows alone), partial (checkpoint of some of the layers), auto (memory auto under --budget), "
                         "masks (the DTG-MA mask step)")
    ap.add_argument("--partial", default="0.25,0.5,0.75",
                    help="shares of the trained layers the partial rows checkpoint (the lowest ones)")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="the auto rows' device budget as a share of the baseline's measured peak")
    a = ap.parse_args()
    device = "cpu" if a.cpu else "cuda"
    if not a.cpu:
        assert torch.cuda.is_available(), "the benchmark needs a CUDA device (--cpu for a smoke test)"
        torch.backends.cuda.matmul.allow_tf32 = True
    if a.tiny:
        a.geom, a.batch, a.seq, a.steps, a.mask_steps = "tiny", 4, 64, 1, 6
    parts = set(a.parts.split(","))
    heal_rows = memory_rows(a.geom, a.batch, a.seq, a.steps, a.micro, parts, [float(x) for x in a.partial.split(",")
                                                                             if x], a.budget, device)
    mask_rows = mask_steps(a.mask_steps, a.tiny, device) if "masks" in parts else []
    dev = "CPU" if a.cpu else torch.cuda.get_device_name()
    write_json(a.out, "memory.json", {"device": dev, "torch": torch.__version__, "batch": a.batch,
                                      "seq": a.seq, "heal": heal_rows, "masks": mask_rows})
    print(f"\n{dev}, torch {torch.__version__}; {a.geom}, {a.batch} windows of {a.seq}")
    print_tables(heal_rows, mask_rows)


if __name__ == "__main__":
    finish(main())
