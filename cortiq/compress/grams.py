"""Illumination: Grams G = Σ a aᵀ of chosen layers' down_proj inputs (the
MLP activations a [I]) over a set of windows.

Accumulators are f64 [I, I], on the model's device. When those of every
chosen layer do not fit the memory room, the layers are split into parts run
one pass each; a pass saves the residual stream where it stops (the input of
the layer after its last), per batch, and the next pass starts from it, so
every layer runs once per window set. The room is half the free device memory
on CUDA (the forward's activations need the rest), a quarter of the RAM on the
CPU; CORTIQ_GRAM_ROOM_MB caps it (tests use it to force passes).

On CUDA the forward may run under bf16 autocast; each batch's product AᵀA is
then taken in f64 (Hopper's f64 tensor cores run it at about the f32 rate,
and no f32 rounding enters the sum). Padding rows are zeroed, not dropped, so
no step waits on the host.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from ..errors import CortiqError

ACC_BYTES = 8  # f64 accumulators


def room_bytes(room_mb: float = 0, device=None) -> int:
    """The memory room for the accumulators: `room_mb`, else half the free
    memory of a CUDA `device`, else a quarter of the RAM; CORTIQ_GRAM_ROOM_MB
    (a float, MB) caps any of them."""
    if room_mb > 0:
        room = int(room_mb * (1 << 20))
    elif device is not None and torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        room = free // 2
    else:
        try:
            room = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
        except (ValueError, OSError, AttributeError):
            room = 4 << 30
    cap = os.environ.get("CORTIQ_GRAM_ROOM_MB")
    if cap:
        try:
            room = min(room, int(float(cap) * (1 << 20)))
        except ValueError:
            raise CortiqError(f"CORTIQ_GRAM_ROOM_MB={cap!r} is not a number of MB") from None
    return room


def plan_parts(widths: dict[int, int], layers: Sequence[int], room: int) -> list[list[int]]:
    """Consecutive groups of `layers` (sorted) whose accumulators fit `room`
    (a single layer over the room still gets its own part)."""
    parts: list[list[int]] = [[]]
    used = 0
    for layer in sorted(layers):
        b = ACC_BYTES * widths[layer] ** 2
        if parts[-1] and used + b > room:
            parts.append([])
            used = 0
        parts[-1].append(layer)
        used += b
    return parts if parts[0] else []


def add_gram(acc: torch.Tensor, a: torch.Tensor, keep: torch.Tensor) -> None:
    """acc [I, I] f64 += Σ aᵢ aᵢᵀ over the rows of a [b, T, I] where keep [b, T] is set."""
    with torch.autocast(acc.device.type, enabled=False):  # the product must not drop to bf16
        if acc.is_cuda:
            x = (a * keep[..., None].to(a.dtype)).reshape(-1, a.shape[-1]).double()  # [b·T, I], padding rows 0
            acc.addmm_(x.T, x)
        else:
            sel = a[keep].float()  # [n, I]: real tokens only
            acc.add_((sel.T @ sel).double())


@torch.no_grad()
def capture_model_grams(
    model,
    ids: torch.Tensor,
    rows: torch.Tensor,
    layers: Sequence[int],
    room: int,
    batch: int = 4,
    progress: Callable[[int], None] | None = None,
    compute: torch.dtype = torch.float32,
) -> tuple[dict[int, torch.Tensor], int, int]:
    """Grams of `layers`' down_proj inputs over windows ids [N, T] (int64),
    counting the rows where `rows` [N, T] (bool) is set (real tokens, not
    padding), on the device the model is on, the forward under autocast to
    `compute` when that is not f32. Returns ({layer: G f64 [I, I] on the CPU},
    rows counted, passes)."""
    n_layers = len(model.layers)
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise CortiqError(f"Gram capture: layers {bad} are not in 0..{n_layers - 1}")
    if ids.shape[0] == 0:
        raise CortiqError("Gram capture: no windows")
    widths = {l: int(model.layers[l].mlp.down_proj.weight.shape[1]) for l in layers}
    parts = plan_parts(widths, layers, room)
    dev = next(model.parameters()).device
    starts = list(range(0, ids.shape[0], batch))
    count = int(rows.sum())
    per_batch = [int(rows[s : s + batch].sum()) for s in starts]  # counted on the host, once
    ids_d, rows_d = ids.to(dev), rows.to(dev)  # a few MB at most: no copy per batch
    out: dict[int, torch.Tensor] = {}
    resume: list[torch.Tensor] | None = None  # per batch: hidden input [b, T, H] of layer `at`
    at = 0
    for part in parts:
        accs = {l: torch.zeros(widths[l], widths[l], dtype=torch.float64, device=dev) for l in part}
        cur = {"mask": None}

        def hook(layer):
            def fn(mod, inp):
                add_gram(accs[layer], inp[0], cur["mask"])  # inp[0]: the activations [b, T, I]
            return fn

        handles = [model.layers[l].mlp.down_proj.register_forward_pre_hook(hook(l)) for l in part]
        stop = part[-1] + 1
        nxt: list[torch.Tensor] = []
        try:
            for k, s in enumerate(starts):
                cur["mask"] = rows_d[s : s + batch]
                with torch.autocast(dev.type, dtype=compute, enabled=compute != torch.float32):
                    h = model.embed(ids_d[s : s + batch]) if resume is None else resume[k].to(dev)
                    h = model.run_layers(h, at, stop)  # [b, T, H]
                if part is not parts[-1]:
                    nxt.append(h.to("cpu"))
                if progress:
                    progress(per_batch[k])
        finally:
            for hd in handles:
                hd.remove()
        resume, at = nxt, stop
        for l in part:
            if not bool((torch.diagonal(accs[l]) > 0).any()):
                raise CortiqError(f"Gram capture: layer {l}: the captured activations are all zero")
            out[l] = accs[l].cpu()
        del accs
    return out, count, len(parts)
