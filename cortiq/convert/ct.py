"""cortiq's block codecs as compressed-tensors "pack-quantized" weights, and back.

A Hugging Face directory whose config.json has a `quantization_config` with
`quant_method: compressed-tensors` is loaded by transformers (through the
`compressed-tensors` package) and by vLLM as a quantized model: each linear
module holds `weight_packed` (int32 words), `weight_scale` and `weight_shape`
instead of `weight`. Its "group" strategy is cortiq's block layout whenever a
matrix's input width is a multiple of the block: the codec cuts the flattened
row-major tensor into blocks, so each block is `group_size` consecutive input
columns of one output row.

- q8 (x = scale·q, q in -127..127, one f16 scale per 32) is compressed-tensors'
  symmetric int8 with group_size 32: the same codes (packed four to a word, each
  offset by 128) and the same f16 scales, so every weight is exactly cortiq's.
- q4 / q4_64 (x = min + scale·q, q in 0..15, an f16 min and scale per block)
  has no exact form there: compressed-tensors' zero point is a whole number of
  steps (packed int4), and a block's min is not in general. Its asymmetric
  checkpoints also fail to load in transformers (the zero point's packed shape
  is refused), so a q4 block is written as symmetric int4 (x = scale·c,
  c in -8..7): the block's own grid when its min is −8 steps (a q4 block made
  symmetric, as every quantizer writes them under QuantSettings.q4_grid
  "symmetric": then it is exact), else the scale, among a few candidates each
  refitted by least squares to its codes, that is nearest cortiq's values.
  docs/export.md gives what that costs in NLL and the way to exact 4-bit files.
  Symmetric int4 values are q4 blocks (min = −8·scale, exact in f16), so
  reading such a checkpoint back gives q4 blocks byte for byte.
"""

from __future__ import annotations

import torch

from .. import codecs

#: cortiq codec → (bits, group size); the codecs written as pack-quantized weights
SCHEMES = {"q8": (8, 32), "q4": (4, 32), "q4_64": (4, 64)}
#: (bits, group size) → the cortiq codec a pack-quantized weight reads back as
CODEC_OF = {(8, 32): "q8", (4, 32): "q4", (4, 64): "q4_64"}
#: the tensors that replace a quantized module's `weight`
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")
#: the symmetric int4 scales tried for a q4 block: its largest |value| over these steps
_DIVISORS = (8.0, 7.5, 7.0, 6.5, 6.0)


def packable(codec: str, shape: tuple[int, ...]) -> bool:
    """True when a tensor of `codec` and `shape` is a matrix whose blocks follow its rows."""
    return codec in SCHEMES and len(shape) == 2 and shape[1] % SCHEMES[codec][1] == 0


def exact(codec: str, stored: torch.Tensor) -> bool:
    """True when a packable matrix's values survive packing exactly: every q8 matrix, and a q4 one whose
    every block's min is −8 steps (a symmetric block: compressed-tensors' int4 grid)."""
    return SCHEMES[codec][0] == 8 or codecs.get(codec).symmetric_blocks(stored)


def packed_shapes(codec: str, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Checkpoint name suffix → (shape, safetensors dtype) of a packed `codec` matrix."""
    bits, g = SCHEMES[codec]
    o, i = shape
    return {"weight_packed": ((o, i * bits // 32), "I32"), "weight_scale": ((o, i // g), "F16"),
            "weight_shape": ((2,), "I64")}


def _q4_symmetric(scale: torch.Tensor, lo: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4 blocks (scale, min f16 [n], codes [n, g] in 0..15) → symmetric int4 (codes [n, g] in -8..7,
    scale f16 [n]) nearest their values (see the module doc)."""
    s, m = scale.to(torch.float32), lo.to(torch.float32)
    v = m[:, None] + q.to(torch.float32) * s[:, None]
    best_c, best_s = q.to(torch.int8) - 8, scale.to(torch.float16)  # exact where m = −8·s
    best = ((v - best_c.to(torch.float32) * s[:, None]) ** 2).sum(1)
    amax = v.abs().amax(1)
    for d in _DIVISORS:
        S = (amax / d).to(torch.float16)
        for _ in range(2):  # the grid, then its least-squares refit to its own codes
            S32 = S.to(torch.float32)
            c = (v / torch.where(S32 > 0, S32, 1.0)[:, None]).round_().clamp_(-8, 7)
            err = ((v - c * S32[:, None]) ** 2).sum(1)
            take = err < best
            best = torch.where(take, err, best)
            best_c = torch.where(take[:, None], c.to(torch.int8), best_c)
            best_s = torch.where(take, S, best_s)
            S = ((v * c).sum(1) / (c * c).sum(1).clamp_min(1.0)).to(torch.float16)
            S = torch.where(torch.isfinite(S) & (S > 0), S, best_s)
    return best_c, best_s


def pack(codec: str, stored: torch.Tensor, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A `packable` matrix's codec bytes → its pack-quantized tensors (weight_packed int32,
    weight_scale f16, weight_shape int64)."""
    bits, g = SCHEMES[codec]
    o, i = shape
    n = o * i // g
    raw = stored.reshape(n, -1)
    scale = raw[:, :2].contiguous().view(torch.float16).reshape(n)
    if bits == 8:
        # compressed-tensors stores code+128 per byte, little-endian within each int32 word
        packed = (raw[:, 2:] ^ 0x80).contiguous().reshape(o, i)
    else:
        lo = raw[:, 2:4].contiguous().view(torch.float16).reshape(n)
        nib = raw[:, 4:]
        q = torch.stack([nib & 0xF, nib >> 4], 2).reshape(n, g)
        c, scale = _q4_symmetric(scale, lo, q)
        u = (c.to(torch.int16) + 8).to(torch.uint8)
        # element k of a word at bits 4k: cortiq's nibble order (low nibble first)
        packed = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous().reshape(o, i // 2)
    return {"weight_packed": packed.view(torch.int32), "weight_scale": scale.reshape(o, i // g).contiguous(),
            "weight_shape": torch.tensor([o, i], dtype=torch.int64)}


def unpack(bits: int, group: int, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Pack-quantized symmetric tensors → the bytes of cortiq's `CODEC_OF[(bits, group)]` with the same
    values (q8 codes and scales as they are; int4 as q4 blocks of min −8·scale)."""
    o, i = shape
    n = o * i // group
    words = packed.contiguous().view(torch.uint8).reshape(n, group * bits // 8)
    s = scale.to(torch.float16).reshape(n, 1)
    if bits == 8:
        return torch.cat([s.view(torch.uint8), words ^ 0x80], 1).reshape(-1)
    lo = (s.to(torch.float32) * -8.0).to(torch.float16)  # exact: a power of two times an f16
    return torch.cat([s.view(torch.uint8), lo.view(torch.uint8), words], 1).reshape(-1)


def _target(names: list[str]) -> str:
    """One compressed-tensors target (a `re:` pattern) naming exactly these modules."""
    return "re:^(" + "|".join(n.replace(".", r"\.") for n in names) + ")$"


def quantization_config(modules: dict[str, str]) -> dict:
    """config.json's `quantization_config` for the quantized linear `modules` (HF module name → codec):
    one config group per codec, its target naming its modules (vLLM and transformers both match `re:`)."""
    groups = {}
    for k, codec in enumerate(sorted(set(modules.values()), key=list(SCHEMES).index)):
        bits, g = SCHEMES[codec]
        names = [m for m, c in modules.items() if c == codec]
        groups[f"group_{k}"] = {
            "targets": [_target(names)],
            "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": g,
                        "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}},
            "input_activations": None, "output_activations": None, "format": "pack-quantized",
        }
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": groups, "ignore": [], "kv_cache_scheme": None, "sparsity_config": {},
            "transform_config": {}, "global_compression_ratio": None}


def read_scheme(qc, where: str) -> dict[str, tuple[int, int]] | None:
    """Module-name pattern → (bits, group) of a compressed-tensors `quantization_config` cortiq reads
    back (symmetric int8 / int4 groups of 32 or 64, pack-quantized); None when `qc` is absent."""
    from ..errors import CortiqError

    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        raise CortiqError(f"{where}: quantization_config {str(qc)[:80]} is not one cortiq reads "
                          "(compressed-tensors pack-quantized int4 / int8 groups)")
    out = {}
    for name, grp in (qc.get("config_groups") or {}).items():
        w = (grp or {}).get("weights") or {}
        key = (w.get("num_bits"), w.get("group_size"))
        fmt = grp.get("format") or qc.get("format")
        if fmt != "pack-quantized" or w.get("type") != "int" or not w.get("symmetric", True) or key not in CODEC_OF:
            raise CortiqError(f"{where}: quantization group {name} ({fmt}, {w.get('num_bits')} bits, group "
                              f"{w.get('group_size')}, symmetric {w.get('symmetric', True)}) is not one cortiq reads "
                              "(symmetric pack-quantized int8 in groups of 32, int4 in groups of 32 or 64)")
        for t in grp.get("targets") or []:
            out[t] = key
    return out

