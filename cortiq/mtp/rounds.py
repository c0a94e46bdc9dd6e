"""The draft's chain computed for every row at once as a decode round has it.

In speculative decoding a round that starts after row r runs the draft's
step 1 at row r (the trunk's hidden row h_r, token r+1), step 2 at row r+1
(step 1's output, token r+2), and so on. Its attention sees the block's rows
0..r computed from the trunk's own hidden rows (after each round the block's
cache is rebuilt from them) and the round's own rows r+1..r+j-1, each at its
own position. Feeding step j every row's step j-1 output (one plain block
pass per step) gives step j a context of draft rows everywhere instead: the
context real decoding never sees. Measured on SmolLM2-class drafts that
measure and real decoding disagree at depth 2 and 3.

Here step j of the chain that starts at row r, for every r at once ([B, T]
chains per batch), attends to the trunk-sourced keys 0..r (a causal mask)
and to the keys of its own chain's rows of steps 2..j (one extra key per
step, the same index r). Shapes: h [B, T, H] trunk rows; ids [B, T]; step j's
output [B, T, H] holds at index r the chain starting at r (its row r+j-1),
predicting token r+j+1.

`decode_steps_reference` runs the block one row at a time through its KV
cache, as `generate_speculative` does; the tests compare the two.
"""

from __future__ import annotations

import contextlib

import torch

from .measures import shifted


def _attend(q, k, v, extra: list, rep: int) -> torch.Tensor:
    """Row r of q [B, hq, T, D] attends to k/v rows 0..r [B, hkv, T, D] and to row r of each
    (k, v) in `extra` (its chain's own earlier rows). -> [B, hq, T, D]"""
    T, D = q.shape[2], q.shape[3]
    scale = D ** -0.5
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2)).float() * scale  # [B, hq, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    ev = []
    parts = [s]
    for ke, ve in extra:
        ke, ve = ke.repeat_interleave(rep, 1), ve.repeat_interleave(rep, 1)
        parts.append(((q * ke).sum(-1).float() * scale)[..., None])  # [B, hq, T, 1]
        ev.append(ve)
    p = torch.softmax(torch.cat(parts, -1), -1)  # [B, hq, T, T + len(extra)]
    o = p[..., :T].to(v.dtype) @ v
    for i, ve in enumerate(ev):
        o = o + p[..., T + i : T + i + 1].to(ve.dtype) * ve
    return o


def decode_steps(model, h: torch.Tensor, ids: torch.Tensor, steps: int, pad: int, train_step: int | None = None):
    """The chain's outputs for steps 1..`steps` as decode rounds compute them: a list of
    [B, T, H] (normed; index r: the chain starting at row r). With `train_step` = j only
    step j and the trunk-sourced rows it attends to keep a graph (the steps before it run
    without one); else the ambient grad mode holds."""
    mtp = model.mtp
    layer = mtp.layers[0]
    attn = layer.self_attn
    rep = attn.hq // attn.hkv
    B, T = ids.shape
    dev = h.device

    def block_input(src, j):
        return mtp.eh_proj(torch.cat([mtp.enorm(model.embed(shifted(ids, j, pad))), mtp.hnorm(src)], -1))

    def rest(x, o, gate):
        o = o.transpose(1, 2).reshape(B, T, attn.hq * attn.d)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        y = x + attn.o_proj(o)
        y = y + layer.mlp(layer.post_attention_layernorm(y))
        return mtp.norm(y)

    cos0, sin0 = model.rope(torch.arange(T, device=dev))
    x1 = block_input(h, 1)  # [B, T, H]: the trunk-sourced rows
    q1, k1, v1, g1 = attn.qkv(layer.input_layernorm(x1), cos0, sin0)
    outs, extra = [], []
    for j in range(1, steps + 1):
        off = train_step is not None and j != train_step
        with torch.no_grad() if off else contextlib.nullcontext():
            if j == 1:
                x, q, g = x1, q1, g1
            else:
                x = block_input(outs[-1], j)
                cos, sin = model.rope(torch.arange(j - 1, T + j - 1, device=dev))
                q, k, v, g = attn.qkv(layer.input_layernorm(x), cos, sin)
                extra.append((k, v))
            outs.append(rest(x, _attend(q, k1, v1, extra, rep), g))
    return outs


@torch.no_grad()
def decode_steps_reference(model, h: torch.Tensor, ids: torch.Tensor, steps: int, pad: int):
    """Each chain start r alone, through the block's KV cache as speculative decoding runs it:
    rows 0..r-1 from the trunk, then step 1 at row r, step 2 at row r+1... (tests only)."""
    B, T = ids.shape
    nxt = [shifted(ids, j, pad) for j in range(steps + 1)]
    outs = [torch.zeros_like(h) for _ in range(steps)]
    for r in range(T):
        st = model.mtp.layers[0].new_state()
        if r > 0:
            model.mtp_forward(h[:, :r], nxt[1][:, :r], 0, st)
        x = h[:, r : r + 1]
        for j in range(1, steps + 1):
            x = model.mtp_forward(x, nxt[j][:, r : r + 1], r + j - 1, st)
            outs[j - 1][:, r] = x[:, 0]
    return outs
