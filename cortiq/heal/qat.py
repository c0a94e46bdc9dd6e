"""Quantization-aware distillation: the student's trained matrices run
fake-quantized in a block codec.

Each linear of the trained layers computes with codec.roundtrip(W) (the
codec's own dequantize(quantize(W)), the values a file in that codec holds)
in place of W; the gradient passes straight through to the f32 master W (the
straight-through estimator: ∂L/∂W := ∂L/∂Ŵ). The frozen matrices the healed
file also writes quantized (embedding and head, in q8 where the codec has
fewer than 8 bits, and the layers below the trained ones while they still
run) are rounded once, in place, as the file stores them, so the held-out loss
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
    codecs.get(codec_name)  # an unknown codec fails before the model is touched
    n = 0
    for i in trained:
        for mod in model.layers[i].modules():
            if isinstance(mod, torch.nn.Linear):
                mod.qat_codec = codec_name
                mod.forward = types.MethodType(_forward, mod)
                n += 1
    frozen = {f"model.layers.{i}.{k}": m.weight for i in frozen_run for k, m in model.layers[i].named_modules()
              if isinstance(m, torch.nn.Linear)}
    frozen.update((k, p) for k, p in model.named_parameters() if k.startswith(("model.embed_tokens.", "lm_head.")))
    for name, w in frozen.items():
        _round_as_stored(name, w, codec_name)
    return n


@torch.no_grad()
def _round_as_stored(name: str, w: torch.Tensor, codec_name: str) -> None:
    """w, in place, as a file written in `codec_name` holds it (cortiq.codecs.choose_codec by name: the
    embedding and head of a 4-bit file are q8)."""
    c = codecs.get(codecs.choose_codec(codec_name, tuple(w.shape), "f32", name))
    if not c.plain:
        w.copy_(c.roundtrip(w))


@torch.no_grad()
def rounded(model, codec_name: str):
    """`model` with every matrix a file in `codec_name` quantizes (cortiq.codecs.choose_codec: every 2-D weight,
    the embedding and head of a 4-bit file in q8) replaced in place by its roundtrip: what that file computes
    ("none": unchanged)."""
    if codec_name != "none":
        for name, p in model.named_parameters():
            if p.ndim == 2 and not name.endswith("neuron_logits"):
                _round_as_stored(name, p, codec_name)
    return model
