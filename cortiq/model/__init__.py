"""The torch decoder family (Llama, Qwen2, Qwen3, Qwen3-Next / Qwen3.5 hybrid):
`load_model` builds it from a CMF file, `export_model` writes it back."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from ..cmf import CmfError, CmfFile, Spec, new_doc, open_cmf, with_provenance, write_cmf
from ..codecs import choose_codec
from ..codecs import get as get_codec
from ..errors import CortiqError
from .decoder import CausalLM, rope_inv_freq

__all__ = ["CausalLM", "load_model", "check_tensors", "export_model"]


def _arch_for(f: CmfFile):
    """The file's arch, with what its tensors say about the MTP block."""
    arch = copy.deepcopy(f.arch)
    if "model.mtp.eh_proj.weight" in f:
        arch.mtp_layers = max(arch.mtp_layers, 1)
        g = "model.mtp.layers.0.mlp.gate_proj.weight"
        if g in f:
            arch.mtp_intermediate_size = f.info(g).shape[0]
    else:
        arch.mtp_layers = 0
    return arch


def load_model(path, dtype: torch.dtype = torch.float32, device="cpu", verify: bool = True,
               allow_nonfinite: bool = False) -> CausalLM:
    """A CausalLM with the weights of a CMF file (quantized tensors dequantized
    to `dtype`). Every model parameter must be in the file and every file
    tensor must be a model parameter; otherwise a CortiqError names them.
    Each tensor's sha256 is checked as it is read (`verify=False` skips it) and
    NaN/Inf weights are refused unless `allow_nonfinite`."""
    f = path if isinstance(path, CmfFile) else open_cmf(path)
    model = check_tensors(f)
    model._inv_freq = rope_inv_freq(model.arch).to(device)
    params = dict(model.named_parameters())
    mods = dict(model.named_modules())
    for name, p in params.items():
        mod, _, attr = name.rpartition(".")
        t = f.checked_tensor(name, dtype, verify=verify, finite=not allow_nonfinite).to(device)
        setattr(mods[mod], attr, torch.nn.Parameter(t, requires_grad=p.requires_grad))
    model.source = f
    return model.eval()


def check_tensors(f: CmfFile) -> CausalLM:
    """Refuse a file whose tensors are not exactly its architecture's (every parameter present,
    no other name, each of the arch's shape): what loading, verifying, re-encoding and exporting
    all require. Returns the model built on the meta device (no memory)."""
    f.check_layers()
    arch = _arch_for(f)
    with torch.device("meta"):
        model = CausalLM(arch)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in f]
    if missing:
        raise CortiqError(f"{f.path}: missing tensors {missing[:4]}{' ...' if len(missing) > 4 else ''} for a {arch.arch_name} model")
    extra = [n for n in f.names if n not in params]
    if extra:
        raise CortiqError(f"{f.path}: tensors the {arch.arch_name} model has no place for: {extra[:4]}{' ...' if len(extra) > 4 else ''}")
    for name, p in params.items():
        shape = tuple(f.info(name).shape)
        if shape != tuple(p.shape):
            raise CortiqError(f"{f.path}: tensor {name!r} has shape {list(shape)}, the arch says {list(p.shape)}")
    return model


def check_file(f: CmfFile) -> CausalLM:
    """`check_tensors`, and the tokenizer the file carries (when it carries one) loads."""
    model = check_tensors(f)
    if (f.tokenizer or {}).get("json"):
        from ..tokenizer import from_doc

        from_doc(f.tokenizer, str(f.path))
    return model


def verify_file(f: CmfFile, progress=None) -> None:
    """Every check loading makes, over the whole file, without building the model: the
    tensors are the arch's, the tokenizer loads, every tensor matches its sha256 and holds
    no NaN or Inf. Raises CmfError naming the failing tensors."""
    check_file(f)
    nonfinite: list[str] = []
    bad = f.verify(progress=progress, nonfinite=nonfinite)

    def shown(names):
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    if bad:
        raise CmfError(f"{f.path}: {len(bad)} of {len(f.infos)} tensors fail their sha256: {shown(bad)}")
    if nonfinite:
        raise CmfError(f"{f.path}: {len(nonfinite)} of {len(f.infos)} tensors hold NaN or Inf values: {shown(nonfinite)}")


def _current_arch(model: CausalLM):
    arch = copy.deepcopy(model.arch)
    arch.intermediate_sizes = [int(l.mlp.down_proj.weight.shape[1]) for l in model.layers]
    if model.mtp is not None:
        arch.mtp_layers = 1
        arch.mtp_intermediate_size = int(model.mtp.layers[0].mlp.down_proj.weight.shape[1])
    else:
        arch.mtp_layers, arch.mtp_intermediate_size = 0, 0
    return arch


def export_model(model: CausalLM, src, out_path, codec: str = "keep", provenance_stage: str | None = None,
                 provenance: dict | None = None) -> Path:
    """Write the model's current weights as a CMF file: arch from the model
    (per-layer widths included), tokenizer and provenance from `src`, plus
    `provenance[provenance_stage]` when given. codec "keep": each tensor in its
    codec in `src` (f32 if new or reshaped); a codec name: that codec for 2-D
    weights, f32 for norms, biases, conv and gate vectors. Neuron gate logits
    are not model weights and are not written."""
    src = src if isinstance(src, CmfFile) else open_cmf(src)
    if codec != "keep":
        get_codec(codec)
    arch = _current_arch(model)
    doc = new_doc(arch, src.tokenizer, src.provenance)
    if provenance_stage:
        doc = with_provenance(doc, provenance_stage, provenance or {})
    specs = []
    for name, p in model.named_parameters():
        if name.endswith("neuron_logits"):
            continue
        same = name in src and tuple(src.info(name).shape) == tuple(p.shape)
        c = choose_codec(codec, tuple(p.shape), src.info(name).codec if same else "f32", name)
        specs.append(Spec(name, c, tuple(p.shape), lambda p=p: p.detach().float().cpu()))
    return write_cmf(Path(out_path), doc, specs)
