"""`mtp init`: give a model without a draft a fresh MTP block, so every model
the converters read can be MTP-healed.

The block starts as close to "the trunk, once more" as its shape allows:
its layer is a copy of the trunk's last full-attention layer, `eh_proj` is
[0 | I] so the block's input is hnorm(h_p) (the hidden row passes through and
the next token's embedding is not yet read), enorm and hnorm are identity
gains (ones, or zeros in the offset style), and its norm is the trunk's final
norm, so the shared head reads its output as it reads the trunk's.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from ..arch import FULL
from ..cmf import CmfFile, Spec, Stored, open_cmf, with_provenance, write_cmf
from ..errors import CortiqError

PREFIX = "model.mtp."


def has_draft(f: CmfFile) -> bool:
    return f"{PREFIX}eh_proj.weight" in f


def draft_is_fresh(f: CmfFile) -> bool:
    """Whether `f`'s draft is as `mtp init` made it: the provenance, in the order the stages
    ran, records an `mtp init` and no `mtp heal` that trained a step since (a measure-only
    heal, or a compress / heal of the trunk, leaves the draft fresh)."""
    fresh = False
    for key, block in f.provenance.items():
        stage = key.split("#", 1)[0]
        if stage == "mtp_init":
            fresh = bool((block or {}).get("fresh", False))
        elif stage == "mtp_heal" and int((block or {}).get("steps", 0)) > 0:
            fresh = False
    return fresh


def mtp_init(model_cmf: str | os.PathLike, out_cmf: str | os.PathLike) -> dict:
    """Write `out_cmf`: the model of `model_cmf` (tensors copied as stored) plus a fresh model.mtp.* block."""
    f = open_cmf(model_cmf)
    if has_draft(f):
        raise CortiqError(f"{f.path}: already carries an MTP draft (model.mtp.*); `mtp heal` retrains it")
    arch = copy.deepcopy(f.arch)
    full = [i for i, t in enumerate(arch.layer_types) if t == FULL]
    if not full:
        raise CortiqError(f"{f.path}: no full-attention layer to start a draft from")
    L = full[-1]
    H = arch.hidden_size
    src = f"model.layers.{L}."
    specs = [Spec(n, f.info(n).codec, f.info(n).shape, lambda n=n: Stored(f.stored(n))) for n in f.names]
    for n in f.names:
        if n.startswith(src):
            new = f"{PREFIX}layers.0." + n[len(src):]
            specs.append(Spec(new, f.info(n).codec, f.info(n).shape, lambda n=n: Stored(f.stored(n))))
    ident = torch.zeros(H) if arch.norm_style == "offset" else torch.ones(H)
    eh = torch.cat([torch.zeros(H, H), torch.eye(H)], 1)  # [H, 2H]: the block input is hnorm(h_p)
    specs += [
        Spec(f"{PREFIX}eh_proj.weight", "f32", (H, 2 * H), lambda: eh),
        Spec(f"{PREFIX}enorm.weight", "f32", (H,), lambda: ident),
        Spec(f"{PREFIX}hnorm.weight", "f32", (H,), lambda: ident),
        Spec(f"{PREFIX}norm.weight", f.info("model.norm.weight").codec, (H,), lambda: Stored(f.stored("model.norm.weight"))),
    ]
    arch.mtp_layers = 1
    arch.mtp_intermediate_size = int(arch.intermediate_sizes[L])
    doc = {k: v for k, v in f.doc.items() if k not in ("codecs", "hashes", "shards")}
    doc["arch"] = arch.to_dict()
    # "fresh": `mtp heal` reads it to pick its "fresh" preset (cortiq.mtp.settings.PRESETS)
    doc = with_provenance(doc, "mtp_init", {"source": str(f.path), "layer": L, "fresh": True})
    out = write_cmf(Path(out_cmf), doc, specs)
    return {"out": str(out), "layer": L, "metrics": {}}
