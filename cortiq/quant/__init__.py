"""Quantization of a final model into cortiq's block codecs by GPTQ (or AWQ-style
scales and GPTQ) from calibration windows of its data: `quantize_chain` (the
qgrams and quantize stages, cortiq.quant.stages), `requantize` (that chain for
`cortiq recode`), the per-layer solves in cortiq.quant.layers.

Names load on first use, so `cortiq.quant.settings` (the CLI's defaults) stays
free of torch.
"""

from __future__ import annotations

from .._lazy import exports

_EXPORTS = {
    "QuantSettings": "settings", "METHODS": "settings", "BLOCK_CODECS": "settings",
    **{name: "stages" for name in ("QGRAMS", "QUANTIZE", "capture", "quantize", "quantize_chain", "read_grams",
                                   "requantize", "uses_grams")},
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
