"""Which fast paths pay, measured in one device call (notes for bench/RESULTS.md).

    python bench/variants.py [--geom qwen3-1.7b]

Each variant changes one thing against cortiq's plain path at the benchmark
geometry and batch: the teacher's top-k in bf16 instead of f32 logits, SDPA's
GQA against repeated KV heads, torch.compile of each decoder layer, the
student step in micro-batches (activation memory), activation checkpointing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import run as R  # noqa: E402
import stages as S  # noqa: E402

from cortiq.heal.loss import topk_kl  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--geom", default="qwen3-1.7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    a = ap.parse_args()
    g = R.GEOMS[a.geom]
    B, T, K = a.batch, a.seq, 64
    rate = R.matmul_rate()
    arch = S.arch_of(g)
    H, L = g["hidden"], g["layers"]
    ids = torch.randint(0, g["vocab"], (B, T), device="cuda")
    out = {}

    teacher = S.build(arch, torch.bfloat16).eval()
    with torch.no_grad():
        h, _ = teacher.forward_hidden(ids)

        def topk_f32():
            return teacher.topk_next(h, K, chunk=8192)

        def topk_bf16():
            rows = h.reshape(B * T, H)
            for s in range(0, B * T, 8192):
                top, idx = teacher.logits(rows[s:s + 8192]).topk(K, -1)
                torch.softmax(top.float(), -1)

        out["head_topk_f32_ms"] = R.timed(topk_f32) * 1e3
        out["head_topk_bf16_ms"] = R.timed(topk_bf16) * 1e3
        out["trunk_fwd_ms"] = R.timed(lambda: teacher.forward_hidden(ids)) * 1e3
        x = torch.randn(B, 16, T, 128, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(B, 8, T, 128, device="cuda", dtype=torch.bfloat16)
        out["sdpa_gqa_ms"] = R.timed(lambda: F.scaled_dot_product_attention(x, kv, kv, is_causal=True, enable_gqa=True)) * 1e3
        rep = kv.repeat_interleave(2, 1)
        out["sdpa_rep_ms"] = R.timed(lambda: F.scaled_dot_product_attention(x, rep, rep, is_causal=True)) * 1e3
        # compiled layers
        for layer in teacher.layers:
            layer.compile(dynamic=False)
        out["trunk_fwd_compiled_ms"] = R.timed(lambda: teacher.forward_hidden(ids), warm=3) * 1e3
    del teacher
    torch.cuda.empty_cache()

    tids = torch.randint(0, g["vocab"], (B * T, K), device="cuda")
    tps = torch.softmax(torch.randn(B * T, K, device="cuda"), -1)

    def student_variant(compile_layers=False, micro=1, ckpt=False):
        st = S.build(arch, torch.float32).train()
        st.model.embed_tokens.weight.requires_grad_(False)
        mt = set(id(p) for p in st.mtp.parameters())
        params = [p for p in st.parameters() if p.requires_grad and id(p) not in mt]
        if compile_layers:
            for layer in st.layers:
                layer.compile(dynamic=False)
        opt = torch.optim.Adam(params, lr=1e-5, fused=True)
        b = B // micro

        def run_layers(hh):
            if not ckpt:
                return st.run_layers(hh, 0, L)
            cos, sin = st.rope(torch.arange(T, device="cuda"))
            for layer in st.layers:
                hh = torch.utils.checkpoint.checkpoint(layer, hh, cos, sin, use_reentrant=False)
            return hh

        def step():
            for m in range(micro):
                sl = slice(m * b, (m + 1) * b)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    hh = st.model.norm(run_layers(st.embed(ids[sl])))
                    loss = topk_kl(hh.reshape(b * T, H), st.head_weight, tids.view(B, T, K)[sl].reshape(b * T, K),
                                   tps.view(B, T, K)[sl].reshape(b * T, K), chunk=8192) / (B * T)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)

        R.peak_reset()
        s = R.timed(step, warm=3, reps=5)
        head_f = 2 * H * g["vocab"]
        layer_f = (R.flops_per_token(g, T, False) - head_f) / L
        mfu = (3 * L * layer_f + 2 * head_f) * B * T / s / rate
        r = {"tok_s": B * T / s, "mfu": mfu, "peak_gib": R.peak_gib()}
        del st, opt
        torch.cuda.empty_cache()
        return r

    for name, kw in [("plain", {}), ("compiled", {"compile_layers": True}), ("micro2", {"micro": 2}),
                     ("micro4", {"micro": 4}), ("compiled_micro2", {"compile_layers": True, "micro": 2}),
                     ("ckpt", {"ckpt": True})]:
        try:
            out[f"step_{name}"] = student_variant(**kw)
        except Exception as e:  # one failing variant must not cost the others
            out[f"step_{name}"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(name, out[f"step_{name}"], flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
