"""Learning-rate schedules of the heal run: the shape of the peak rate (warm-up
then cosine, or Genesis: cortiq.train_loop, which the MTP draft's loop shares) and
Genesis's widening window of trained layers with its per-layer decay."""

from __future__ import annotations

import math

#: Genesis: the share of layers (from the top) trained in epoch 0, 1, 2, 3+
GENESIS_FRACTIONS = (12 / 64, 24 / 64, 40 / 64, 1.0)


def genesis_from(epoch: int, num_layers: int, train_from: int) -> int:
    """The lowest layer Genesis trains in `epoch` (0-based): the window widens from the top down."""
    frac = GENESIS_FRACTIONS[min(epoch, len(GENESIS_FRACTIONS) - 1)]
    return max(num_layers - min(num_layers, math.ceil(frac * num_layers)), train_from)


def genesis_decay(layer: int, lowest: int, epoch: int) -> float:
    """Per-layer rate factor exp(−κ·(layer − lowest)), κ = 0.1/(epoch+1): layers
    far above the window's lowest one move less, less so as epochs pass."""
    kappa = 0.1 / (epoch + 1)
    return math.exp(-kappa * max(0, layer - lowest))
