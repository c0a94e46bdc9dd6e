"""cortiq on the GPU against the plain transformers baseline: one call, one table.

    python -m bench.run [--geoms qwen3-0.6b,qwen3-1.7b,qwen3.5-hybrid] [--parts baseline,cortiq]
                        [--batch 4] [--seq 2048] [--steps 8] [--out DIR]
    python -m bench.run --cpu --tiny      # the same rows at tiny geometries on a CPU (measures nothing)

The baseline is what a user would write instead: transformers' Qwen3ForCausalLM
for teacher and student (random init, bf16), the teacher online every step,
full-vocabulary `kl_div`, AdamW. cortiq's stages run at the same geometry and
batch: the teacher top-k pass (chunked head, no [rows, vocab] float logits),
the frozen-prefix pass, the student step (fused head + top-k KL, f32 master
weights, bf16 autocast), one-epoch heal throughput (teacher pass + steps),
the MTP trunk pass and draft step. Every figure is tokens per second from CUDA
events (median of the timed repeats after warm-up), MFU against the measured
bf16 matrix rate, and peak memory.
"""

from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F

from bench.common import finish, log, parser, print_table, write_json

GEOMS = {
    # Qwen3-0.6B / 1.7B geometry (tied embeddings, vocab 151936)
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072, vocab=151936, tie=True),
    "qwen3-1.7b": dict(hidden=2048, layers=28, heads=16, kv=8, head_dim=128, inter=6144, vocab=151936, tie=True),
    # a Qwen3.5-0.8B-like hybrid: 3 Gated DeltaNet layers to 1 gated full-attention layer
    # a smoke-test size for `--cpu` (checks the code paths, measures nothing)
    "tiny": dict(hidden=64, layers=2, heads=4, kv=2, head_dim=16, inter=96, vocab=259, tie=True),
    "tiny-hybrid": dict(hidden=64, layers=4, heads=4, kv=2, head_dim=16, inter=96, vocab=259, tie=True,
                        hybrid=True, lk=2, lv=4, dk=16, dv=16),
    "qwen3.5-hybrid": dict(hidden=1024, layers=24, heads=8, kv=2, head_dim=256, inter=3584, vocab=248320, tie=True,
                           hybrid=True, lk=16, lv=16, dk=128, dv=128),
}


def timed(fn, warm=2, reps=5):
    """Median seconds of fn() over reps, CUDA events, after warm-up."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def peak_reset():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def peak_gib():
    return torch.cuda.max_memory_allocated() / 2**30


def matmul_rate():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = timed(lambda: a @ b, warm=3, reps=10)
    return 2 * 8192**3 / s


def flops_per_token(g, seq, train: bool, layers: int | None = None, head=True):
    """Matmul FLOPs per token (2 per multiply-add); ×3 for a training step."""
    h, L = g["hidden"], layers if layers is not None else g["layers"]
    attn_proj = h * g["heads"] * g["head_dim"] * 2 + h * g["kv"] * g["head_dim"] * 2
    mlp = 3 * h * g["inter"]
    per_layer = 2 * (attn_proj + mlp) + 2 * 2 * g["heads"] * g["head_dim"] * seq / 2  # causal attention ≈ T/2 keys
    f = L * per_layer + (2 * h * g["vocab"] if head else 0)
    return f * (3 if train else 1)


# ── the baseline: transformers, teacher online, full-vocab KL ──────────────


def hf_model(g, device="cuda"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=g["vocab"], hidden_size=g["hidden"], intermediate_size=g["inter"],
                      num_hidden_layers=g["layers"], num_attention_heads=g["heads"], num_key_value_heads=g["kv"],
                      head_dim=g["head_dim"], tie_word_embeddings=g["tie"], max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        m = Qwen3ForCausalLM(cfg)
    return m.to(torch.bfloat16)


def bench_baseline(name, g, B, T, steps, rate, device="cuda"):
    row = {"geom": name, "who": "baseline"}
    tm, reset, peak = timers(device)
    ids = torch.randint(0, g["vocab"], (B, T), device=device)
    teacher = hf_model(g, device).eval()

    @torch.no_grad()
    def teacher_pass():
        logits = teacher(ids).logits
        return torch.topk(logits.float(), 64, dim=-1)

    reset()
    s = tm(teacher_pass)
    row["teacher_tok_s"] = B * T / s
    row["teacher_mfu"] = flops_per_token(g, T, False) * B * T / s / rate
    row["teacher_peak_gib"] = peak()
    student = hf_model(g, device).train()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)

    def kd_step():
        with torch.no_grad():
            t = teacher(ids).logits
        s_ = student(ids).logits
        loss = F.kl_div(F.log_softmax(s_.float(), -1), F.log_softmax(t.float(), -1), log_target=True,
                        reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset()
    s = tm(kd_step, warm=2, reps=steps)
    row["kd_tok_s"] = B * T / s
    row["kd_mfu"] = (flops_per_token(g, T, True) + flops_per_token(g, T, False)) * B * T / s / rate
    row["kd_peak_gib"] = peak()
    del teacher, student, opt
    torch.cuda.empty_cache() if device == "cuda" else None
    return row


# ── cortiq's stages ───────────────────────────────────────────────────────


def bench_cortiq(name, g, B, T, steps, rate, device="cuda"):
    from bench.heal import stages

    t, r, p = timers(device)
    return stages.run(name, g, B, T, steps, rate, timed=t, peak_reset=r, peak_gib=p,
                      flops_per_token=flops_per_token, device=device)


def cpu_timed(fn, warm=1, reps=1):
    for _ in range(warm):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def timers(device: str):
    """(timed, peak_reset, peak_gib) on `device`: CUDA events and the allocator's peak counter, or on the
    CPU (the smoke tests, which measure nothing) one wall-timed call and a peak of 0."""
    if device == "cuda":
        return timed, peak_reset, peak_gib
    return (lambda fn, warm=0, reps=1: cpu_timed(fn, 0, 1)), (lambda: None), (lambda: 0.0)


def main():
    ap = parser(__doc__)
    ap.add_argument("--geoms", default=None, help="geometries (default qwen3-0.6b,qwen3-1.7b,qwen3.5-hybrid; "
                                                   "tiny: tiny,tiny-hybrid)")
    ap.add_argument("--parts", default="baseline,cortiq")
    ap.add_argument("--batch", type=int, default=None, help="windows per step (default 4; tiny 2)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per window (default 2048; tiny 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; tiny 1)")
    a = ap.parse_args()
    geoms = (a.geoms or ("tiny,tiny-hybrid" if a.tiny else "qwen3-0.6b,qwen3-1.7b,qwen3.5-hybrid")).split(",")
    B, T, steps = a.batch or (2 if a.tiny else 4), a.seq or (64 if a.tiny else 2048), a.steps or (1 if a.tiny else 5)
    device = "cpu" if a.cpu else "cuda"
    if a.cpu:
        dev, rate = "cpu (smoke test)", 1e12  # no matrix rate measured: the MFU columns mean nothing
    else:
        assert torch.cuda.is_available(), "the benchmark needs a CUDA device (--cpu --tiny smoke-tests it)"
        torch.backends.cuda.matmul.allow_tf32 = True
        dev = torch.cuda.get_device_name()
        rate = matmul_rate()
    log(f"{dev}: bf16 8192³ matmul {rate / 1e12:.0f} TFLOP/s; torch {torch.__version__}")
    rows = []
    for name in geoms:
        g = GEOMS[name]
        for part in a.parts.split(","):
            if part == "baseline" and g.get("hybrid"):
                continue  # transformers' hybrid is not the baseline the targets name
            t0 = time.time()
            try:
                r = bench_baseline(name, g, B, T, steps, rate, device) if part == "baseline" else \
                    bench_cortiq(name, g, B, T, steps, rate, device)
            except torch.cuda.OutOfMemoryError as e:
                r = {"geom": name, "who": part, "error": f"OOM: {str(e)[:120]}"}
            except Exception as e:  # keep the other rows: the table is the point of the call
                import traceback

                traceback.print_exc()
                r = {"geom": name, "who": part, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            r["secs"] = time.time() - t0
            rows.append(r)
            log(json.dumps(r))
            if device == "cuda":
                torch.cuda.empty_cache()
    write_json(a.out, "bench.json", {"device": dev, "torch": torch.__version__, "matmul_tflops": rate / 1e12,
                                     "batch": B, "seq": T, "rows": rows})
    speed_table(rows, rate)
    return 1 if any("error" in r for r in rows) else 0


def speed_table(rows, rate):
    keys = ["teacher_tok_s", "teacher_mfu", "prefix_tok_s", "step_tok_s", "step_mfu", "kd_tok_s", "kd_mfu",
            "epoch_tok_s", "mtp_trunk_tok_s", "mtp_step_tok_s", "teacher_peak_gib", "kd_peak_gib", "step_peak_gib"]
    print(f"\nbf16 matmul rate {rate / 1e12:.0f} TFLOP/s")
    cells = [[r["geom"], r["who"]] + ["" if r.get(k) is None else (f"{r[k]:.2f}" if abs(r[k]) < 100 else f"{r[k] / 1e3:.1f}k")
                                      for k in keys] + [r.get("error", "")] for r in rows]
    print_table(["geom", "who", *keys, "error"], cells)
    base = {r["geom"]: r for r in rows if r["who"] == "baseline" and "error" not in r}
    for r in rows:
        b = base.get(r["geom"])
        if r["who"] == "cortiq" and b and "error" not in r:
            peak = f", peak memory {r['step_peak_gib'] / b['kd_peak_gib']:.2f} of the baseline's" if b["kd_peak_gib"] else ""
            print(f"{r['geom']}: teacher pass ×{r['teacher_tok_s'] / b['teacher_tok_s']:.2f}, "
                  f"one-epoch heal ×{r['epoch_tok_s'] / b['kd_tok_s']:.2f} of the baseline KD step{peak}")


if __name__ == "__main__":
    finish(main())
