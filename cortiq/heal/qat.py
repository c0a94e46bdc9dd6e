"""Quantization-aware distillation: the student's trained matrices run
fake-quantized in a block codec.

Each linear of the trained layers computes with codec.roundtrip(W) (the
codec's own dequantize(quantize(W)), the values a file in that codec holds)
in place of W; the gradient passes straight through to the f32 master W (the
straight-through estimator: ∂L/∂W := ∂L/∂Ŵ). The frozen matrices the healed
file also writes in the codec (embedding, head, layers below the trained
ones while they still run) are rounded once, in place, so the held-out loss
the best checkpoint is chosen on is the quantized model's, and the export in
the codec writes exactly the weights that loss was measured with (encode of
the trained W gives the blocks roundtrip computed with). A cached prefix is
the unquantized student's output: with train_from > 0 and the prefix cached,
the layers below are seen unquantized in training.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .. import codecs
from .settings import QAT_CODECS  # noqa: F401  (qat's name for them)


class _RoundTrip(torch.autograd.Function):
    """Forward: the codec's roundtrip of w; backward: the gradient unchanged."""

    @staticmethod
    def forward(ctx, w, codec_name):
        return codecs.get(codec_name).roundtrip(w).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


# the block quantizer reads back its scales' finiteness on the host: a break in the
# compiled graph, so it runs eagerly, once per linear per forward
@torch.compiler.disable
def fake_quant(w: torch.Tensor, codec_name: str) -> torch.Tensor:
    """codec.roundtrip(w) with a straight-through gradient."""
    return _RoundTrip.apply(w, codec_name)


def _forward(self, x):
    return F.linear(x, fake_quant(self.weight, self.qat_codec), self.bias)


def attach(model, codec_name: str, trained: range | list[int], frozen_run: range | list[int] = ()) -> int:
    """Make every nn.Linear of the layers `trained` run fake-quantized in
    `codec_name`, and round the frozen matrices a quantized file holds (the
    embedding and head, and the linears of the layers `frozen_run`, which run
    but do not train) once in place. Returns how many linears train fake-quantized."""
    if codec_name == "none":
        return 0
    c = codecs.get(codec_name)
    n = 0
    for i in trained:
        for mod in model.layers[i].modules():
            if isinstance(mod, torch.nn.Linear):
                mod.qat_codec = codec_name
                mod.forward = types.MethodType(_forward, mod)
                n += 1
    with torch.no_grad():
        frozen = [model.model.embed_tokens.weight] + ([] if model.lm_head is None else [model.lm_head.weight])
        frozen += [m.weight for i in frozen_run for m in model.layers[i].modules() if isinstance(m, torch.nn.Linear)]
        for w in frozen:
            w.copy_(c.roundtrip(w))
    return n


@torch.no_grad()
def rounded(model, codec_name: str):
    """`model` with every matrix a file in `codec_name` quantizes (cortiq.codecs.choose_codec: every 2-D weight)
    replaced in place by its roundtrip: what that file computes ("none": unchanged)."""
    if codec_name != "none":
        c = codecs.get(codec_name)
        for name, p in model.named_parameters():
            if p.ndim == 2 and not name.endswith("neuron_logits"):
                p.copy_(c.roundtrip(p))
    return model
