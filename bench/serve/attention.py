"""The decode engine's attention call alone, in every form torch offers (for bench/DECODE.md): one device call.

    python -m bench.serve.attention [--shapes 1x1x512,32x13x512] [--skip flex_attention] [--out DIR]
    python -m bench.serve.attention --cpu --tiny   # every variant once on a CPU, f32, against SDPA (no figures)

The call as the fused engine makes it (cortiq.model.decode): SmolLM2-135M's 3 KV heads, 3 queries a KV head,
head dim 64, bf16; q grouped [S, 3, 3·T, 64]; K and V the first L rows of [S, 3, 1040, 64] caches; the additive
mask `_ctx_rows` builds ([S, 1, 3·T, L], broadcast over heads). Per variant and shape: µs a call, timed as the
engine runs it (30 calls captured in one CUDA graph, replayed), the kernels one call launches (profiler), and
the largest difference from the default SDPA call. Variants: SDPA as called (torch picks cuDNN on an H100),
the mask's layout (contiguous, one per head, boolean), each SDPA backend forced, K and V contiguous, the
product written out (matmul, softmax, matmul) eager and compiled, and FlexAttention with the mask as a score
modifier.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from bench.common import finish, log, parser, print_table, write_json
from cortiq.model.decode.layers import _ctx_rows

HKV, G, D, M = 3, 3, 64, 1040  # SmolLM2-135M's attention; M: the engine's cache rows at context 1024
SHAPES = ((1, 1, 256), (1, 1, 512), (1, 4, 512), (1, 13, 512), (32, 1, 512), (32, 4, 512), (32, 13, 512))


def inputs(S: int, T: int, L: int, dev, dt):
    """q, K, V and the mask of a step of S slots, T rows a slot, L keys, as the engine lays them out."""
    cos = torch.randn(M, D, device=dev, dtype=dt)
    pos = torch.full((S,), L - T - 8, device=dev)
    mask = _ctx_rows(pos, torch.arange(T, device=dev), torch.arange(L, device=dev), cos, cos, HKV, G, D)[3]
    q = torch.randn(S, T, HKV, G, D, device=dev, dtype=dt).permute(0, 2, 3, 1, 4).reshape(S, HKV, G * T, D)
    K = torch.randn(S, HKV, M, D, device=dev, dtype=dt)
    return q, K[:, :, :L], torch.randn_like(K)[:, :, :L], mask


def variants(q, K, V, mask, compiled: bool):
    """(name, a call) for each form of the same attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = F.scaled_dot_product_attention
    mc = mask.contiguous()
    mh = mask.expand(q.shape[0], HKV, -1, -1).contiguous()
    yield "SDPA as called", lambda: sdpa(q, K, V, attn_mask=mask)
    yield "mask contiguous", lambda: sdpa(q, K, V, attn_mask=mc)
    yield "mask per head", lambda: sdpa(q, K, V, attn_mask=mh)
    yield "bool mask", lambda: sdpa(q, K, V, attn_mask=mc == 0)
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("math", SDPBackend.MATH)]
    for name, be in backends if q.is_cuda else backends[2:]:
        def forced(be=be):
            with sdpa_kernel([be]):
                return sdpa(q, K, V, attn_mask=mc)
        yield name, forced
    Kc, Vc = K.contiguous(), V.contiguous()
    yield "K and V contiguous", lambda: sdpa(q, Kc, Vc, attn_mask=mc)

    def explicit():
        s = torch.matmul(q, K.transpose(-1, -2)) * D ** -0.5 + mc  # [S, Hkv, G·T, L]
        return torch.matmul(s.softmax(-1), V)

    yield "matmul-softmax-matmul", explicit
    if compiled:  # inductor's CPU builds cost more than the smoke test's budget
        from torch.nn.attention.flex_attention import flex_attention

        yield "the same, compiled", torch.compile(explicit, fullgraph=True)
        flex = torch.compile(flex_attention, dynamic=False)
        yield "flex_attention", lambda: flex(q, K, V, score_mod=lambda sc, b, h, i, j: sc + mc[b, 0, i, j])


def graph_us(fn, calls: int = 30, reps: int = 20) -> float:
    """µs a call of `fn` replayed from one CUDA graph of `calls` calls (the engine's launch cost)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps / calls * 1e6


def kernels(fn) -> list[str]:
    """The CUDA kernels one call launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def main():
    ap = parser(__doc__)
    ap.add_argument("--shapes", default=None, help="SxTxL,... slots, rows a slot, keys (default: the table's seven)")
    ap.add_argument("--skip", default="", help="variants left out, comma-separated names as the table prints them")
    a = ap.parse_args()
    try:
        shapes = [tuple(map(int, x.split("x", 2))) for x in a.shapes.split(",")] if a.shapes else SHAPES
        assert all(len(x) == 3 and min(x) > 0 for x in shapes)
    except (ValueError, AssertionError):
        raise SystemExit(f"bench.serve.attention: --shapes {a.shapes!r}: give SxTxL,... (slots, rows a slot, keys; each ≥ 1)")
    skip = set(filter(None, a.skip.split(",")))
    cuda = not a.cpu
    if cuda:
        assert torch.cuda.is_available(), "the benchmark needs a CUDA device (--cpu --tiny smoke-tests it)"
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    names = [n for n, _ in variants(*inputs(1, 1, 16, dev, dt), compiled=cuda)]
    if skip - set(names):
        raise SystemExit(f"bench.serve.attention: --skip {','.join(sorted(skip - set(names)))}: no such variant here "
                         f"(variants: {', '.join(names)})")
    rows = []
    for S, T, L in shapes[1::3] if a.tiny and not a.shapes else shapes:
        q, K, V, mask = inputs(S, T, L, dev, dt)
        ref = F.scaled_dot_product_attention(q, K, V, attn_mask=mask).float()
        for name, fn in variants(q, K, V, mask, compiled=cuda):
            if name in skip:
                continue
            row = {"slots": S, "rows": T, "keys": L, "variant": name}
            try:
                row["max_err"] = (fn().float() - ref).abs().max().item()
                if cuda:
                    row["us"] = graph_us(fn)
                    ks = kernels(fn)
                    row["kernels"] = len(ks)
                    row["names"] = sorted({k[:48] for k in ks})
            except Exception as e:  # a variant torch cannot run here is a row of the table, not the end of it
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            log(row)
            rows.append(row)
    write_json(a.out, "attention.json", {"device": torch.cuda.get_device_name() if cuda else "cpu",
                                         "dtype": str(dt), "torch": torch.__version__, "rows": rows})
    print_table(["slots", "rows", "keys", "variant", "µs a call", "kernels", "max |err|"],
                [[r["slots"], r["rows"], r["keys"], r["variant"],
                  f"{r['us']:.2f}" if "us" in r else r.get("error", "-"), r.get("kernels", "-"),
                  f"{r['max_err']:.3g}" if "max_err" in r else "-"] for r in rows])
    return 0


if __name__ == "__main__":
    finish(main())
