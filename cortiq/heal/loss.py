"""The distillation losses, fused with the head so no [rows, V] tensor exists
beyond one chunk of rows: `topk_kl` (KL against a sparse target: top-k or
sampled entries), `topk_rest_kl` (the same plus one bucket holding the target's
mass off the listed ids, scored against the student's 1 − Σq), `dense_kl` (the
teacher's whole distribution, both heads run chunk by chunk). Each has a plain
`*_reference` beside it.

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


def _dtypes(hidden: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the accumulation dtype: f32, or f64 for f64 rows; the compute dtype: autocast's when on, else the rows')."""
    dev = hidden.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    return torch.promote_types(hidden.dtype, torch.float32), cdt


class _HeadGrads:
    """The head's gradients, summed chunk by chunk from each chunk's dL/dz [c, V]:
    dL/dhidden rows (dz @ W) and dL/dW (dzᵀ @ hidden, accumulated in `acc`)."""

    def __init__(self, ctx, hidden, head_weight, acc):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        self.gh = torch.empty_like(hidden) if need_h else None
        self.gw = torch.zeros(head_weight.shape, dtype=acc, device=head_weight.device) if need_w else None
        self.in_dtype, self.w_dtype = ctx.in_dtype, head_weight.dtype

    def add(self, sl: slice, dz, hc, w) -> None:
        if self.gh is not None:
            self.gh[sl] = dz @ w
        if self.gw is not None:
            self.gw += (dz.t() @ hc).to(self.gw.dtype)

    def result(self):
        return (None if self.gh is None else self.gh.to(self.in_dtype),
                None if self.gw is None else self.gw.to(self.w_dtype))


class _TopkKL(torch.autograd.Function):
    """Forward and backward in row chunks; backward recomputes each chunk's
    logits (memory is the point: the vocabulary is the widest axis)."""

    @staticmethod
    def forward(ctx, hidden, head_weight, ids, probs, chunk):
        n = hidden.shape[0]
        ids = ids.long()
        acc, cdt = _dtypes(hidden)  # f32 for bf16/f16 rows; f64 stays f64
        # the head's matmuls run in the autocast dtype when autocast is on; the
        # backward (which autocast does not reach) uses the same, or its two
        # recomputed [rows, V] products would run in f32 and take half a
        # Qwen3-1.7B step (bench/RESULTS.md, "What bounds the misses")
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
        grads = _HeadGrads(ctx, hidden, head_weight, p.dtype)
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
            grads.add(slice(a, a + chunk), dz, hc, w)
        return *grads.result(), None, None, None


def _chunk_terms(z, ids, p, mass, want_dz: bool):
    """One chunk's summed KL terms and, when wanted, dL/dz [c, V] in z's dtype,
    from its logits z [c, V] (compute dtype), ids/p [c, k], mass [c] (p's dtype).
    Compiled on CUDA: the logsumexp and the exp·mass pass over [c, V] become
    fused kernels that read z twice and write dL/dz once in z's dtype, with no
    f32 [c, V] tensor in memory; the listed entries are then overwritten with
    their exact value mass·q − Σp (an id listed twice, as a "sampled" row's
    unused slots may be, gets the sum of its entries), each rounded once."""
    zf = z.to(p.dtype)
    lse = torch.logsumexp(zf, dim=-1)  # [c]
    zi = zf.gather(1, ids)  # [c, k]
    loss = (torch.xlogy(p, p) - p * (zi - lse[:, None])).sum()
    if not want_dz:
        return loss, None
    # dL/dz = mass·softmax(z) − scatter(p)
    dz = (torch.exp(zf - lse[:, None]) * mass[:, None]).to(z.dtype)  # [c, V]
    same = ids[:, :, None] == ids[:, None, :]  # [c, k, k]
    listed = torch.exp(zi - lse[:, None]) * mass[:, None] - (same * p[:, None, :]).sum(-1)  # [c, k]
    return loss, dz.scatter(1, ids, listed.to(z.dtype))


_COMPILED_TERMS = {}


def _compile_terms(**kw):
    """`_chunk_terms` under torch.compile with dynamo's automatic dynamic shapes: the first
    chunk size gets a static graph, the second turns the row count symbolic, so two graphs serve
    every size. A chunk's rows vary in `mtp heal` (its windows' scored rows differ, so the last
    chunk of each batch has a size of its own); with static shapes every new size compiled again,
    about 1.6 s each on a CPU, until dynamo's limit of 64 graphs: 100 s or more of a heal."""
    return torch.compile(_chunk_terms, dynamic=None, **kw)


def _terms_for(device: torch.device):
    """`_chunk_terms`, compiled once per process on CUDA; eager elsewhere (the CPU path and the tests' reference).
    Should the compilation fail, one line says so and the eager function (the same arithmetic) is used."""
    if device.type != "cuda":
        return _chunk_terms
    if "cuda" not in _COMPILED_TERMS:
        compiled = _compile_terms()

        def terms(*a):
            try:
                return compiled(*a)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001 (a compiler failure, not a value error: eager computes the same)
                import sys

                print(f"cortiq: the fused top-k KL's compiled passes failed ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:160]}); running them eager", file=sys.stderr)
                _COMPILED_TERMS["cuda"] = _chunk_terms
                return _chunk_terms(*a)

        _COMPILED_TERMS["cuda"] = terms
    return _COMPILED_TERMS["cuda"]


class _TopkKLAhead(torch.autograd.Function):
    """The gradient computed in the forward: each chunk's logits are made once
    (one [rows, V] product, not two), its dL/dz goes straight into dL/dhidden
    (dz @ W) and dL/dW, and the backward only scales them by the incoming
    gradient (the loss is a scalar sum). The idea of the fused linear losses of
    Liger-kernel, for a sparse target. Under no_grad it is the forward alone."""

    @staticmethod
    def forward(ctx, hidden, head_weight, ids, probs, chunk, ahead):
        n = hidden.shape[0]
        ids = ids.long()
        acc, cdt = _dtypes(hidden)
        need_h, need_w = ahead and ctx.needs_input_grad[0], ahead and ctx.needs_input_grad[1]
        h, w = hidden.to(cdt), head_weight.to(cdt)
        p = probs.to(acc)
        mass = p.sum(1)  # [N] the row's target mass (its weight)
        gh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # [N, H]
        gw = torch.zeros(head_weight.shape, dtype=acc, device=head_weight.device) if need_w else None  # [V, H]
        terms = _terms_for(hidden.device)
        total = hidden.new_zeros((), dtype=acc)
        for a in range(0, n, chunk):
            sl = slice(a, a + chunk)
            z = h[sl] @ w.t()  # [c, V] in the compute dtype
            loss, dz = terms(z, ids[sl], p[sl], mass[sl], need_h or need_w)
            total += loss
            if need_h:
                gh[sl] = dz @ w
            if need_w:
                gw += (dz.t() @ h[sl]).to(acc)
        ctx.save_for_backward(gh, gw)
        ctx.w_dtype = head_weight.dtype
        return total

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return (None if gh is None else gh * g.to(gh.dtype),
                None if gw is None else (gw * g).to(ctx.w_dtype), None, None, None, None)


def topk_kl(hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
            chunk: int = DEFAULT_CHUNK, grad_ahead: bool = True) -> torch.Tensor:
    """Summed top-k KL of `hidden` [N,H] (after the final norm) through the head
    `head_weight` [V,H] against `ids`/`probs` [N,k]; rows in chunks of `chunk`.
    `grad_ahead`: the gradient made in the forward (two [rows, V] products per
    chunk instead of three); off, the backward recomputes each chunk's logits."""
    if hidden.dim() != 2 or ids.shape != probs.shape or ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_kl: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, probs {tuple(probs.shape)} do not match")
    if grad_ahead:
        ahead = torch.is_grad_enabled() and (hidden.requires_grad or head_weight.requires_grad)
        return _TopkKLAhead.apply(hidden, head_weight, ids, probs, max(1, int(chunk)), ahead)
    return _TopkKL.apply(hidden, head_weight, ids, probs, max(1, int(chunk)))


# ── the rest bucket: k listed entries plus one for everything else ───────


def topk_rest_kl_reference(hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                           rest: torch.Tensor) -> torch.Tensor:
    """The plain computation of `topk_rest_kl`: full logits, the listed entries
    gathered, the rest bucket as log(1 − Σq) (fine in f64 for the sizes tests use)."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logp = torch.log_softmax((hidden @ head_weight.t()).to(acc), dim=-1)  # [N, V]
    p, r = probs.to(acc), rest.to(acc)
    qs = logp.gather(1, ids.long()).exp().sum(1)  # [N] the student's mass on the listed ids
    listed = (torch.xlogy(p, p) - p * logp.gather(1, ids.long())).sum()
    return listed + (torch.xlogy(r, r) - r * torch.log1p(-qs)).sum()


class _TopkRestKL(torch.autograd.Function):
    """Σ_r [Σ_k p_rk (log p_rk − log q_rk) + ρ_r (log ρ_r − log(1 − Σ_k q_rk))]
    in row chunks. log(1 − Σq) is taken as logsumexp of the logits off the
    listed ids minus the full logsumexp: exact when the listed ids hold almost
    all of the mass, where 1 − Σq in floating point would cancel to 0 or less."""

    @staticmethod
    def forward(ctx, hidden, head_weight, ids, probs, rest, chunk):
        n = hidden.shape[0]
        ids = ids.long()
        acc, cdt = _dtypes(hidden)
        ctx.in_dtype = hidden.dtype
        hidden = hidden.to(cdt)
        p, r = probs.to(acc), rest.to(acc)
        lse = hidden.new_empty(n, dtype=acc)  # [N] over the vocabulary
        lse_r = hidden.new_empty(n, dtype=acc)  # [N] over the ids not listed
        total = hidden.new_zeros((), dtype=acc)
        w = head_weight.to(cdt)
        for a in range(0, n, chunk):
            sl = slice(a, a + chunk)
            z = (hidden[sl] @ w.t()).to(acc)  # [c, V]
            lse[sl] = torch.logsumexp(z, dim=-1)
            zi = z.gather(1, ids[sl])  # [c, k]
            off = torch.logsumexp(z.scatter(1, ids[sl], float("-inf")), dim=-1)  # [c]; −inf when all listed
            # a row with no rest mass has no rest term (and −inf would make it 0·∞)
            has = r[sl] > 0
            lse_r[sl] = torch.where(has, off, lse[sl])
            pc, rc = p[sl], r[sl]
            total += (torch.xlogy(pc, pc) - pc * (zi - lse[sl, None])).sum()
            total += torch.where(has, torch.xlogy(rc, rc) - rc * (lse_r[sl] - lse[sl]), 0.0).sum()
        ctx.save_for_backward(hidden, head_weight, ids, p, r, lse, lse_r)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, g):
        hidden, head_weight, ids, p, r, lse, lse_r = ctx.saved_tensors
        chunk = ctx.chunk
        grads = _HeadGrads(ctx, hidden, head_weight, p.dtype)
        mass = p.sum(1) + r  # [N] the row's whole target mass
        w = head_weight.to(hidden.dtype)
        for a in range(0, hidden.shape[0], chunk):
            sl = slice(a, a + chunk)
            hc = hidden[sl]  # [c, H]
            z = (hc @ w.t()).to(p.dtype)  # [c, V]
            # dL/dz_j = M·q_j − p_j (listed j) − ρ·q_j/(1 − Σq) (j not listed):
            # the rest bucket pulls the unlisted ids up in proportion to their share of it
            dz = torch.exp(z - lse[sl, None]) * mass[sl, None]
            dz -= torch.exp(z.scatter_(1, ids[sl], float("-inf")) - lse_r[sl, None]) * r[sl, None]
            dz.scatter_add_(1, ids[sl], -p[sl])
            dz = (dz * g).to(hidden.dtype)
            grads.add(sl, dz, hc, w)
        return *grads.result(), None, None, None, None


def topk_rest_kl(hidden: torch.Tensor, head_weight: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                 rest: torch.Tensor, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Summed KL of `hidden` [N,H] through `head_weight` [V,H] against the
    listed entries `ids`/`probs` [N,k] (distinct ids per row, unnormalised)
    plus a rest bucket `rest` [N]: the target's mass off the listed ids, scored
    against the student's 1 − Σq over the same ids."""
    if hidden.dim() != 2 or ids.shape != probs.shape or ids.shape[0] != hidden.shape[0] or rest.shape != ids.shape[:1]:
        raise ValueError(f"topk_rest_kl: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, probs {tuple(probs.shape)}, "
                         f"rest {tuple(rest.shape)} do not match")
    return _TopkRestKL.apply(hidden, head_weight, ids, probs, rest, max(1, int(chunk)))


# ── the dense reference target: the teacher's whole distribution, online ──


def dense_kl_reference(hidden, head_weight, t_hidden, t_head_weight, nxt, weight, ce: float) -> torch.Tensor:
    """Plain: Σ_r w_r·KL(α·onehot(next_r) + (1−α)·softmax(teacher_r) ‖ softmax(student_r))."""
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logq = torch.log_softmax((hidden @ head_weight.t()).to(acc), -1)  # [N, V]
    t = (1.0 - ce) * torch.softmax((t_hidden @ t_head_weight.t()).to(acc), -1)
    t = t + ce * torch.nn.functional.one_hot(nxt.long(), t.shape[1]).to(acc)
    return (weight.to(acc)[:, None] * (torch.xlogy(t, t) - t * logq)).sum()


def _dense_target(zt, nxt, ce: float):
    """[c, V] target rows α·onehot(next) + (1−α)·softmax(zt), f32/f64 as zt."""
    t = torch.softmax(zt, -1) * (1.0 - ce)
    if ce > 0.0:
        t.scatter_add_(1, nxt[:, None], torch.full_like(t[:, :1], ce))
    return t


class _DenseKL(torch.autograd.Function):
    """Both heads in row chunks: neither model's [rows, V] logits exist beyond one chunk."""

    @staticmethod
    def forward(ctx, hidden, head_weight, t_hidden, t_head_weight, nxt, weight, ce, chunk):
        n = hidden.shape[0]
        nxt = nxt.long()
        acc, cdt = _dtypes(hidden)
        ctx.in_dtype = hidden.dtype
        hidden, t_hidden = hidden.to(cdt), t_hidden.detach().to(cdt)
        w, tw = head_weight.to(cdt), t_head_weight.detach().to(cdt)
        wt = weight.to(acc)
        total = hidden.new_zeros((), dtype=acc)
        for a in range(0, n, chunk):
            sl = slice(a, a + chunk)
            logq = torch.log_softmax((hidden[sl] @ w.t()).to(acc), -1)  # [c, V]
            t = _dense_target((t_hidden[sl] @ tw.t()).to(acc), nxt[sl], ce)  # [c, V]
            total += (wt[sl, None] * (torch.xlogy(t, t) - t * logq)).sum()
        ctx.save_for_backward(hidden, head_weight, t_hidden, t_head_weight, nxt, wt)
        ctx.ce, ctx.chunk = ce, chunk
        return total

    @staticmethod
    def backward(ctx, g):
        hidden, head_weight, t_hidden, t_head_weight, nxt, wt = ctx.saved_tensors
        grads = _HeadGrads(ctx, hidden, head_weight, wt.dtype)
        w, tw = head_weight.to(hidden.dtype), t_head_weight.to(hidden.dtype)
        for a in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(a, a + ctx.chunk)
            hc = hidden[sl]
            q = torch.softmax((hc @ w.t()).to(wt.dtype), -1)  # [c, V]
            t = _dense_target((t_hidden[sl] @ tw.t()).to(wt.dtype), nxt[sl], ctx.ce)
            dz = ((q - t) * (wt[sl, None] * g)).to(hidden.dtype)  # a target row sums to 1: dL/dz = w·(q − t)
            grads.add(sl, dz, hc, w)
        return *grads.result(), None, None, None, None, None, None


def dense_kl(hidden: torch.Tensor, head_weight: torch.Tensor, t_hidden: torch.Tensor, t_head_weight: torch.Tensor,
             nxt: torch.Tensor, weight: torch.Tensor, ce: float = 0.0, chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Summed KL of the student rows `hidden` [N,H] through `head_weight` [V,H]
    against the teacher's whole next-token distribution (its rows `t_hidden`
    [N,H'] through `t_head_weight` [V,H']), the data's next token `nxt` [N]
    mixed in with weight `ce`, each row scaled by `weight` [N]. The teacher's
    side gets no gradient."""
    n = hidden.shape[0]
    if hidden.dim() != 2 or t_hidden.shape[0] != n or nxt.shape != (n,) or weight.shape != (n,) \
            or head_weight.shape[0] != t_head_weight.shape[0]:
        raise ValueError(f"dense_kl: hidden {tuple(hidden.shape)}, teacher rows {tuple(t_hidden.shape)}, next "
                         f"{tuple(nxt.shape)}, weight {tuple(weight.shape)}, heads {tuple(head_weight.shape)} / "
                         f"{tuple(t_head_weight.shape)} do not match")
    return _DenseKL.apply(hidden, head_weight, t_hidden, t_head_weight, nxt, weight, float(ce), max(1, int(chunk)))
