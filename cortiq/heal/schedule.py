"""Learning-rate schedules of the heal run (warm-up then cosine, and Genesis)."""

from __future__ import annotations

import math

#: Genesis: the share of layers (from the top) trained in epoch 0, 1, 2, 3+
GENESIS_FRACTIONS = (12 / 64, 24 / 64, 40 / 64, 1.0)


def warm_steps(total: int, warm: float) -> int:
    return max(1, int(total * warm))


def lr_shape(step: int, total: int, warm: float, genesis: bool = False) -> float:
    """The multiplier of the peak rate at 1-based `step` of `total`.

    Plain: linear warm-up over max(1, warm·total) steps (Adam's first steps
    move every trained weight by ~lr at once; a long ramp keeps the held-out
    loss from jumping), then a cosine down to 0.1 of the peak at the end.
    Genesis: (1 − e^(−t/τ))·e^(−t/2T) with τ = T/3."""
    if genesis:
        t, tt = float(step), float(total)
        return (1.0 - math.exp(-t / (tt / 3.0))) * math.exp(-t / (2.0 * tt))
    w = warm_steps(total, warm)
    if step <= w:
        return step / w
    pr = min(1.0, (step - w) / max(1, total - w))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * pr))


def genesis_from(epoch: int, num_layers: int, train_from: int) -> int:
    """The lowest layer Genesis trains in `epoch` (0-based): the window widens from the top down."""
    frac = GENESIS_FRACTIONS[min(epoch, len(GENESIS_FRACTIONS) - 1)]
    return max(num_layers - min(num_layers, math.ceil(frac * num_layers)), train_from)


def genesis_decay(layer: int, lowest: int, epoch: int) -> float:
    """Per-layer rate factor exp(−κ·(layer − lowest)), κ = 0.1/(epoch+1): layers
    far above the window's lowest one move less, less so as epochs pass."""
    kappa = 0.1 / (epoch + 1)
    return math.exp(-kappa * max(0, layer - lowest))
