"""Which fast paths pay, measured in one device call (notes for bench/RESULTS.md).

    python -m bench.heal.variants [--geom qwen3-1.7b] [--out DIR]
    python -m bench.heal.variants --cpu --tiny   # every variant's code at a tiny geometry on a CPU (no figures)

Each variant changes one thing against cortiq's plain path at the benchmark
geometry and batch: the teacher's top-k in bf16 instead of f32 logits, SDPA's
GQA against repeated KV heads, torch.compile of each decoder layer, the
student step in micro-batches (activation memory), activation checkpointing.
On the CPU the compiled variants are left out: inductor's CPU build of every
layer costs more than the smoke test's whole budget and says nothing of the
GPU's kernels (the heal tests compile on the CPU already).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from bench import run as R
from bench.heal import stages as S
from bench.common import finish, parser, print_table, write_json
from cortiq.heal.loss import topk_kl


def setup():
    """The command line and what every variant shares: device, timers, geometry, sizes, the input ids."""
    import argparse

    ap = parser(__doc__)
    ap.add_argument("--geom", default="qwen3-1.7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    if a.tiny:
        a.geom, a.batch, a.seq = "tiny", 4, 64
    dev = "cpu" if a.cpu else "cuda"
    timed, peak_reset, peak_gib = R.timers(dev)
    g = R.GEOMS[a.geom]
    c = argparse.Namespace(dev=dev, timed=timed, peak_reset=peak_reset, peak_gib=peak_gib, g=g, B=a.batch, T=a.seq,
                           K=64, arch=S.arch_of(g), cdt=torch.bfloat16 if dev == "cuda" else torch.float32,
                           rate=R.matmul_rate() if dev == "cuda" else 1e12)  # the CPU measures nothing: MFU is void there
    c.ids = torch.randint(0, g["vocab"], (c.B, c.T), device=dev)
    return a, c


def teacher_variants(c, out: dict) -> None:
    """The teacher's side: top-k from f32 against bf16 logits, the trunk forward eager (and compiled on
    CUDA), SDPA's GQA against repeated KV heads."""
    dev, timed, ids, B, T, K = c.dev, c.timed, c.ids, c.B, c.T, c.K
    H, nh, nkv, hd = c.g["hidden"], c.g["heads"], c.g["kv"], c.g["head_dim"]
    teacher = S.build(c.arch, c.cdt, dev).eval()
    with torch.no_grad():
        h, _ = teacher.forward_hidden(ids)

        def topk_f32():
            return teacher.topk_next(h, K, chunk=8192)

        def topk_bf16():
            rows = h.reshape(B * T, H)
            for s in range(0, B * T, 8192):
                top, idx = teacher.logits(rows[s:s + 8192]).topk(K, -1)
                torch.softmax(top.float(), -1)

        out["head_topk_f32_ms"] = timed(topk_f32) * 1e3
        out["head_topk_bf16_ms"] = timed(topk_bf16) * 1e3
        out["trunk_fwd_ms"] = timed(lambda: teacher.forward_hidden(ids)) * 1e3
        x = torch.randn(B, nh, T, hd, device=dev, dtype=c.cdt)
        kv = torch.randn(B, nkv, T, hd, device=dev, dtype=c.cdt)
        out["sdpa_gqa_ms"] = timed(lambda: F.scaled_dot_product_attention(x, kv, kv, is_causal=True, enable_gqa=True)) * 1e3
        rep = kv.repeat_interleave(nh // nkv, 1)
        out["sdpa_rep_ms"] = timed(lambda: F.scaled_dot_product_attention(x, rep, rep, is_causal=True)) * 1e3
        if dev == "cuda":  # compiled layers (see the docstring for the CPU)
            for layer in teacher.layers:
                layer.compile(dynamic=False)
            out["trunk_fwd_compiled_ms"] = timed(lambda: teacher.forward_hidden(ids), warm=3) * 1e3
    del teacher
    if dev == "cuda":
        torch.cuda.empty_cache()


def student_variant(c, tids, tps, compile_layers=False, micro=1, ckpt=False) -> dict:
    """The student step (fused head + top-k KL, clipping, Adam) with one thing changed: compiled layers,
    `micro` micro-batches, or activation checkpointing; tokens/s, MFU and peak memory."""
    dev, ids, B, T, K, g = c.dev, c.ids, c.B, c.T, c.K, c.g
    H, L = g["hidden"], g["layers"]
    st = S.build(c.arch, torch.float32, dev).train()
    st.model.embed_tokens.weight.requires_grad_(False)
    mt = set(id(p) for p in st.mtp.parameters())
    params = [p for p in st.parameters() if p.requires_grad and id(p) not in mt]
    if compile_layers:
        for layer in st.layers:
            layer.compile(dynamic=False)
    opt = torch.optim.Adam(params, lr=1e-5, fused=dev == "cuda")
    b = B // micro

    def run_layers(hh):
        if not ckpt:
            return st.run_layers(hh, 0, L)
        cos, sin = st.rope(torch.arange(T, device=dev))
        for layer in st.layers:
            hh = torch.utils.checkpoint.checkpoint(layer, hh, cos, sin, use_reentrant=False)
        return hh

    def step():
        for m in range(micro):
            sl = slice(m * b, (m + 1) * b)
            with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
                hh = st.model.norm(run_layers(st.embed(ids[sl])))
                loss = topk_kl(hh.reshape(b * T, H), st.head_weight, tids.view(B, T, K)[sl].reshape(b * T, K),
                               tps.view(B, T, K)[sl].reshape(b * T, K), chunk=8192) / (B * T)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    c.peak_reset()
    s = c.timed(step, warm=3, reps=5)
    head_f = 2 * H * g["vocab"]
    layer_f = (R.flops_per_token(g, T, False) - head_f) / L
    mfu = (3 * L * layer_f + 2 * head_f) * B * T / s / c.rate
    r = {"tok_s": B * T / s, "mfu": mfu, "peak_gib": c.peak_gib()}
    del st, opt
    if dev == "cuda":
        torch.cuda.empty_cache()
    return r


def main():
    a, c = setup()
    dev, B, T, K = c.dev, c.B, c.T, c.K
    out = {}
    teacher_variants(c, out)
    tids = torch.randint(0, c.g["vocab"], (B * T, K), device=dev)
    tps = torch.softmax(torch.randn(B * T, K, device=dev), -1)
    variants = [("plain", {}), ("compiled", {"compile_layers": True}), ("micro2", {"micro": 2}),
                ("micro4", {"micro": 4}), ("compiled_micro2", {"compile_layers": True, "micro": 2}),
                ("ckpt", {"ckpt": True})]
    for name, kw in variants:
        if kw.get("compile_layers") and dev != "cuda":
            continue
        try:
            out[f"step_{name}"] = student_variant(c, tids, tps, **kw)
        except Exception as e:  # one failing variant must not cost the others
            out[f"step_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(name, out[f"step_{name}"], flush=True)
    write_json(a.out, "variants.json", {"device": dev, "geom": a.geom, "batch": B, "seq": T, **out})
    print(f"\n{a.geom}, {B} windows of {T}, on {dev}")
    print_table(["variant", "ms (a step: tokens/s)", "MFU", "peak GiB"],
                [[k, f"{v:.2f}", "", ""] if isinstance(v, float) else
                 [k, f"{v['tok_s']:.0f}", f"{v['mfu']:.3f}", f"{v['peak_gib']:.2f}"] if isinstance(v, dict) else [k, v, "", ""]
                 for k, v in out.items()])
    return 1 if any(isinstance(v, str) for v in out.values()) else 0


if __name__ == "__main__":
    finish(main())
