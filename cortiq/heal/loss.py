"""The distillation loss: KL of the student's next-token distribution against a
sparse top-k target, fused with the head so no [rows, V] tensor exists at once.

Per row r with target probabilities p_r (already scaled by the row's weight,
possibly all 0) over token ids i_r:

    loss_r = Σ_k p_rk · (log p_rk − log_softmax(z_r)[i_rk])        (0·log 0 = 0)

the entropy term makes it a KL against the (sub-)distribution p_r; with a
one-hot target it is exactly the NLL of that token. The functions return the
SUM over rows; the caller divides by the summed row weights.
"""

from __future__ import annotations

import torch

#: rows per chunk of the fused head: [chunk, V] f32 logits live at once
DEFAULT_CHUNK = 1024


def topk_kl_reference(hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The plain computation: full logits, log_softmax, gather. [N,H], [V,H], [N,k], [N,k] -> scalar."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logp = torch.log_softmax((hidden @ head_weight.t()).to(acc), dim=-1)  # [N, V]
    p = probs.to(acc)
    return (torch.xlogy(p, p) - p * logp.gather(1, ids.long())).sum()


class _TopkKL(torch.autograd.Function):
    """Forward and backward in row chunks; backward recomputes each chunk's
    logits (memory is the point: the vocabulary is the widest axis)."""

    @staticmethod
    def forward(ctx, hidden, head_weight, ids, probs, chunk):
        n = hidden.shape[0]
        ids = ids.long()
        acc = torch.promote_types(hidden.dtype, torch.float32)  # f32 for bf16/f16 rows; f64 stays f64
        # the head's matmuls run in the autocast dtype when autocast is on; the
        # backward (which autocast does not reach) uses the same, or its two
        # recomputed [rows, V] products would run in f32 (measured on the H200:
        # 206 of a 393 ms Qwen3-1.7B step)
        dev = hidden.device.type
        cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        ctx.in_dtype = hidden.dtype
        hidden = hidden.to(cdt)
        p = probs.to(acc)
        lse = hidden.new_empty(n, dtype=acc)  # [N]
        total = hidden.new_zeros((), dtype=acc)
        w = head_weight.to(cdt)
        for a in range(0, n, chunk):
            z = (hidden[a : a + chunk] @ w.t()).to(acc)  # [c, V]
            lse[a : a + chunk] = torch.logsumexp(z, dim=-1)
            zi = z.gather(1, ids[a : a + chunk])  # [c, k]
            pc = p[a : a + chunk]
            # Σ p·(log p − (z_i − lse))
            total += (torch.xlogy(pc, pc) - pc * (zi - lse[a : a + chunk, None])).sum()
        ctx.save_for_backward(hidden, head_weight, ids, p, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, g):
        hidden, head_weight, ids, p, lse = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(head_weight.shape, dtype=p.dtype, device=head_weight.device) if need_w else None
        mass = p.sum(1)  # [N] the row's target mass (its weight)
        w = head_weight.to(hidden.dtype)  # hidden was saved in the compute dtype
        for a in range(0, hidden.shape[0], chunk):
            hc = hidden[a : a + chunk]  # [c, H]
            z = (hc @ w.t()).to(p.dtype)  # [c, V]
            # dL/dz = mass·softmax(z) − scatter(p): the target's mass leaves
            # through the normaliser, its entries come back at their ids
            dz = torch.exp(z - lse[a : a + chunk, None]) * mass[a : a + chunk, None]
            dz.scatter_add_(1, ids[a : a + chunk], -p[a : a + chunk])
            dz = (dz * g).to(hidden.dtype)
            if need_h:
                gh[a : a + chunk] = dz @ w
            if need_w:
                gw += (dz.t() @ hc).to(gw.dtype)
        if need_w:
            gw = gw.to(head_weight.dtype)
        if need_h:
            gh = gh.to(ctx.in_dtype)
        return gh, gw, None, None, None


def topk_kl(hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
            chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Summed top-k KL of `hidden` [N,H] (after the final norm) through the head
    `head_weight` [V,H] against `ids`/`probs` [N,k]; rows in chunks of `chunk`."""
    if hidden.dim() != 2 or ids.shape != probs.shape or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_kl: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, probs {tuple(probs.shape)} do not match")
    return _TopkKL.apply(hidden, head_weight, ids, probs, max(1, int(chunk)))
