"""Tensor codecs: how a tensor's values are laid out as bytes in a CMF file.

A codec is named and self-describing: the CMF header records, for every tensor
not stored as plain f32/f16/bf16, the codec's name and the tensor's logical
shape, so any reader can decode it. Quantized codecs work on the tensor
flattened in row-major order, cut into blocks (the last block zero-padded);
every operation is vectorised over blocks.

| name   | per block                         | bytes / weight |
| ------ | --------------------------------- | -------------- |
| f32    | -                                 | 4              |
| f16    | -                                 | 2              |
| bf16   | -                                 | 2              |
| q8     | f16 scale + 32 × int8             | 34/32 = 1.0625 |
| q4     | f16 scale, f16 min + 32 × uint4   | 20/32 = 0.625  |
| q4_64  | f16 scale, f16 min + 64 × uint4   | 36/64 = 0.5625 |
| fp8    | f16 scale + 32 × float8 e4m3      | 34/32 = 1.0625 |

q8 is symmetric (x ≈ scale·q, q in [-127, 127]); q4 is asymmetric
(x ≈ min + scale·q, q in [0, 15]). Scales are rounded *up* to f16 and q4's min
*down*, so no value ever falls outside the codes and is clipped: the error of
every value stays within half a step, subnormal f16 scales included. The
registry takes more: subclass :class:`Codec` and call :func:`register`.

A q4 block may also be written on a symmetric grid (:func:`encoder` with
q4_grid "symmetric"): min = −8·scale exactly in f16, so x = scale·(q − 8),
the signed int4 of compressed-tensors (what transformers and vLLM load as
4-bit). The bytes and the decode are q4's; only the encoder's choice of scale
and min differs. Its scale is the least f16 that holds the block's most
negative value at −8 steps and its largest at +7, so nothing is clipped
there either.

A whole model written in one codec (:func:`choose_codec`) has it on its
matrices; below 8 bits its embedding, head and MTP eh_proj stay at q8
(:data:`KEEP_8BIT`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .errors import CortiqError

__all__ = ["Codec", "CodecError", "get", "encoder", "names", "register", "choose_codec", "rule_key", "KEEP_8BIT", "PLAIN",
           "Q4_GRIDS"]


class CodecError(CortiqError, ValueError):
    """An unknown codec or bytes that do not match a codec's layout."""


class Codec:
    """Encodes f32 tensors into a storage tensor and decodes them back."""

    name: str
    #: plain codecs are stored as a typed tensor of the logical shape
    plain: bool = False

    def nbytes(self, shape: tuple[int, ...]) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """f32 (any shape) → the storage tensor (typed for plain codecs, uint8 else)."""
        raise NotImplementedError

    def decode(self, stored: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The storage tensor → f32 of the logical shape."""
        raise NotImplementedError

    def bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element bound on |decode(encode(x)) − x| (for tests and checks)."""
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x)) as f32 of x's shape, on x's device and without the
        byte packing: the values a model stored in this codec computes with
        (quantization-aware training runs its forward on them)."""
        return self.decode(self.encode(x.detach().cpu()), tuple(x.shape)).to(x.device)

    def bytes_per_weight(self) -> float:
        return self.nbytes((1 << 20,)) / float(1 << 20)


@dataclass(frozen=True)
class _Plain(Codec):
    name: str
    dtype: torch.dtype
    #: relative rounding error of the format (half an ulp)
    rel: float
    plain: bool = True

    def nbytes(self, shape):
        return math.prod(shape) * torch.finfo(self.dtype).bits // 8

    def encode(self, x):
        x = x.detach()
        big = torch.finfo(self.dtype).max
        if self.dtype != torch.float32 and x.numel() and bool((x.abs() > big).any()):
            raise CodecError(f"{self.name}: values beyond ±{big:g} do not fit")
        return x.to(self.dtype).contiguous()

    def roundtrip(self, x):
        return x.detach().to(self.dtype).to(torch.float32)

    def decode(self, stored, shape):
        if stored.dtype != self.dtype:
            raise CodecError(f"{self.name}: stored as {stored.dtype}, expected {self.dtype}")
        return stored.reshape(shape).to(torch.float32)

    def bound(self, x):
        if not self.rel:
            return torch.zeros_like(x, dtype=torch.float32)
        fi = torch.finfo(self.dtype)
        # half an ulp: relative in the normal range, half the subnormal spacing below it
        return x.abs().to(torch.float32) * self.rel + fi.tiny * fi.eps / 2


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Flatten and zero-pad to whole blocks: [n_blocks, block] f32."""
    flat = x.detach().reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % block
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.reshape(-1, block)


def _n_blocks(shape, block):
    return -(-math.prod(shape) // block)


_F16_EPS = 2.0**-10  # f16 spacing relative to a value (10 mantissa bits)
_F16_TINY = 2.0**-24  # f16 spacing below its normal range (subnormals)


def _f16_up(x: torch.Tensor, name: str) -> torch.Tensor:
    """f32 → the least f16 ≥ x (a scale that never clips its block)."""
    h = x.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise CodecError(f"{name}: values are not finite or too large for an f16 scale")
    return torch.where(h.to(torch.float32) < x, torch.nextafter(h, h.new_tensor(math.inf)), h)


def _f16_down(x: torch.Tensor, name: str) -> torch.Tensor:
    """f32 → the greatest f16 ≤ x."""
    h = x.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise CodecError(f"{name}: values are not finite or too large for an f16 min")
    return torch.where(h.to(torch.float32) > x, torch.nextafter(h, h.new_tensor(-math.inf)), h)


class _Q8(Codec):
    """int8 blocks, one f16 scale each: x ≈ scale·q."""

    name = "q8"
    block = 32

    def nbytes(self, shape):
        return _n_blocks(shape, self.block) * (2 + self.block)

    def quantize(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, block] f32 → (q int8 [n, block], scale f16 [n])."""
        scale = _f16_up(b.abs().amax(dim=1) / 127.0, self.name)
        s = scale.to(torch.float32)
        inv = torch.where(s > 0, 1.0 / s, 0.0)  # [n]; an all-zero block codes as zeros
        q = (b * inv[:, None]).round_().clamp_(-127, 127)
        return q.to(torch.int8), scale

    def pack(self, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        out = torch.empty(n, 2 + self.block, dtype=torch.uint8)
        out[:, :2] = scale.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
        out[:, 2:] = q.contiguous().view(torch.uint8)
        return out.reshape(-1)

    def encode(self, x):
        return self.pack(*self.quantize(_blocks(x, self.block)))

    def roundtrip(self, x):
        q, scale = self.quantize(_blocks(x, self.block))
        # decode's arithmetic: f32 codes times the f16 scale widened to f32
        v = q.to(torch.float32) * scale.to(torch.float32)[:, None]
        return v.reshape(-1)[: x.numel()].reshape(x.shape)

    def decode(self, stored, shape):
        n = _n_blocks(shape, self.block)
        if stored.dtype != torch.uint8 or stored.numel() != n * (2 + self.block):
            raise CodecError(f"q8: {stored.numel()} bytes do not hold {list(shape)}")
        raw = stored.reshape(n, 2 + self.block)
        scale = raw[:, :2].contiguous().view(torch.float16).to(torch.float32)  # [n, 1]
        q = raw[:, 2:].contiguous().view(torch.int8).to(torch.float32)
        return (q * scale).reshape(-1)[: math.prod(shape)].reshape(shape)

    def bound(self, x):
        b = _blocks(x, self.block)
        amax = b.abs().amax(dim=1, keepdim=True)
        # half a step; the step is amax/127 rounded up to f16; f32 arithmetic on top
        step = amax / 127.0 * (1 + _F16_EPS) + _F16_TINY
        per = step / 2 + amax * 2.0**-22
        return per.expand_as(b).reshape(-1)[: x.numel()].reshape(x.shape)


def _minus_8(scale: torch.Tensor, name: str) -> torch.Tensor:
    """f16 scales → the f16 min −8·scale of a symmetric block (exact: a power of two times an f16)."""
    lo = scale.to(torch.float16) * -8.0
    if not bool(torch.isfinite(lo).all()):
        raise CodecError(f"{name}: values too large for the f16 min of a symmetric block")
    return lo


class _Q4(Codec):
    """uint4 blocks with f16 scale and min: x ≈ min + scale·q, q in 0..15; `symmetric`: an encoder
    whose every block has min = −8·scale (the same bytes and decode)."""

    def __init__(self, block: int, symmetric: bool = False):
        self.block = block
        self.name = "q4" if block == 32 else f"q4_{block}"
        self.symmetric = symmetric

    def nbytes(self, shape):
        return _n_blocks(shape, self.block) * (4 + self.block // 2)

    def quantize(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, block] f32 → (q uint8 [n, block] in 0..15, scale f16 [n], min f16 [n])."""
        if self.symmetric:
            # the least scale that holds the most negative value at −8 steps and the largest at +7
            reach = torch.maximum(b.amax(dim=1).clamp_min(0) / 7.0, b.amin(dim=1).neg().clamp_min(0) / 8.0)
            scale = _f16_up(reach, self.name)
            lo = _minus_8(scale, self.name)
        else:
            lo = _f16_down(b.amin(dim=1), self.name)
            scale = _f16_up((b.amax(dim=1) - lo.to(torch.float32)) / 15.0, self.name)
        lo32 = lo.to(torch.float32)
        s = scale.to(torch.float32)
        inv = torch.where(s > 0, 1.0 / s, 0.0)  # [n]; a constant block codes as zeros
        q = ((b - lo32[:, None]) * inv[:, None]).round_().clamp_(0, 15)
        return q.to(torch.uint8), scale, lo

    def pack(self, q, scale, lo):
        n = q.shape[0]
        out = torch.empty(n, 4 + self.block // 2, dtype=torch.uint8)
        out[:, :2] = scale.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
        out[:, 2:4] = lo.to(torch.float16).contiguous().view(torch.uint8).reshape(n, 2)
        out[:, 4:] = q[:, 0::2] | (q[:, 1::2] << 4)
        return out.reshape(-1)

    def encode(self, x):
        return self.pack(*self.quantize(_blocks(x, self.block)))

    def roundtrip(self, x):
        q, scale, lo = self.quantize(_blocks(x, self.block))
        # decode's arithmetic: min + codes · scale, all in f32
        v = lo.to(torch.float32)[:, None] + q.to(torch.float32) * scale.to(torch.float32)[:, None]
        return v.reshape(-1)[: x.numel()].reshape(x.shape)

    def decode(self, stored, shape):
        n = _n_blocks(shape, self.block)
        width = 4 + self.block // 2
        if stored.dtype != torch.uint8 or stored.numel() != n * width:
            raise CodecError(f"{self.name}: {stored.numel()} bytes do not hold {list(shape)}")
        raw = stored.reshape(n, width)
        scale = raw[:, 0:2].contiguous().view(torch.float16).to(torch.float32)
        lo = raw[:, 2:4].contiguous().view(torch.float16).to(torch.float32)
        packed = raw[:, 4:]
        q = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(n, self.block).to(torch.float32)
        return (lo + q * scale).reshape(-1)[: math.prod(shape)].reshape(shape)

    def symmetric_blocks(self, stored: torch.Tensor) -> bool:
        """True when every block of the stored bytes has min = −8·scale (a symmetric encoder's blocks, and
        the int4 blocks compressed-tensors holds exactly), whichever encoder wrote them."""
        raw = stored.reshape(-1, 4 + self.block // 2)
        scale = raw[:, :2].contiguous().view(torch.float16).reshape(-1)
        lo = raw[:, 2:4].contiguous().view(torch.float16).reshape(-1)
        return bool(torch.equal(lo, scale * -8.0))

    def bound(self, x):
        b = _blocks(x, self.block)
        lo, hi = b.amin(dim=1, keepdim=True), b.amax(dim=1, keepdim=True)
        mag = torch.maximum(lo.abs(), hi.abs())
        if self.symmetric:
            # half a step; the step is the larger of max/7 and −min/8, rounded up to f16
            reach = torch.maximum(hi.clamp_min(0) / 7.0, lo.neg().clamp_min(0) / 8.0)
            step = reach * (1 + _F16_EPS) + _F16_TINY
            return (step / 2 + mag * 2.0**-21).expand_as(b).reshape(-1)[: x.numel()].reshape(x.shape)
        # half a step; the step spans [min rounded down to f16, max] in 15, rounded up to f16
        span = hi - lo + lo.abs() * _F16_EPS + _F16_TINY
        step = span / 15.0 * (1 + _F16_EPS) + _F16_TINY
        per = step / 2 + mag * 2.0**-21
        return per.expand_as(b).reshape(-1)[: x.numel()].reshape(x.shape)


class _FP8(Codec):
    """float8 e4m3 blocks of 32 with an f16 scale: x ≈ scale·f8 (amax maps to 448)."""

    name = "fp8"
    block = 32

    def nbytes(self, shape):
        return _n_blocks(shape, self.block) * (2 + self.block)

    def encode(self, x):
        b = _blocks(x, self.block)
        scale = _f16_up(b.abs().amax(dim=1) / 448.0, self.name)
        s = scale.to(torch.float32).clamp_min(1e-30)
        f8 = (b / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        n = b.shape[0]
        out = torch.empty(n, 2 + self.block, dtype=torch.uint8)
        out[:, :2] = scale.contiguous().view(torch.uint8).reshape(n, 2)
        out[:, 2:] = f8.view(torch.uint8)
        return out.reshape(-1)

    def decode(self, stored, shape):
        n = _n_blocks(shape, self.block)
        if stored.dtype != torch.uint8 or stored.numel() != n * (2 + self.block):
            raise CodecError(f"fp8: {stored.numel()} bytes do not hold {list(shape)}")
        raw = stored.reshape(n, 2 + self.block)
        scale = raw[:, :2].contiguous().view(torch.float16).to(torch.float32)
        v = raw[:, 2:].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        return (v * scale).reshape(-1)[: math.prod(shape)].reshape(shape)

    def bound(self, x):
        b = _blocks(x, self.block)
        amax = b.abs().amax(dim=1, keepdim=True)
        # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value; its subnormals
        # are spaced 2^-9 of the scale (the scale: amax/448 rounded up to f16)
        scale = amax / 448.0 * (1 + _F16_EPS) + _F16_TINY
        per = b.abs() * 2.0**-4 + scale * 2.0**-10 + amax * 2.0**-22
        return per.reshape(-1)[: x.numel()].reshape(x.shape)


_REGISTRY: dict[str, Codec] = {}


def register(codec: Codec, replace: bool = False) -> Codec:
    """Add `codec` to the registry under `codec.name` (a name is taken once
    unless `replace`)."""
    if not isinstance(codec, Codec):
        raise TypeError(f"{codec!r} is not a Codec")
    if codec.name in _REGISTRY and not replace and _REGISTRY[codec.name] is not codec:
        raise CodecError(f"codec {codec.name!r} is already registered")
    if codec.name == "keep":
        raise CodecError("'keep' is not a codec name (it means: leave each tensor's codec as it is)")
    _REGISTRY[codec.name] = codec
    return codec


for _c in (
    _Plain("f32", torch.float32, 0.0),
    _Plain("f16", torch.float16, 2.0**-11),
    _Plain("bf16", torch.bfloat16, 2.0**-8),
    _Q8(),
    _Q4(32),
    _Q4(64),
    _FP8(),
):
    register(_c)

#: plain codecs by the safetensors dtype name they are stored as
PLAIN = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def names() -> list[str]:
    return list(_REGISTRY)


#: how q4 / q4_64 blocks are placed (QuantSettings.q4_grid): "asymmetric" over each block's [min, max];
#: "symmetric" with min = −8·scale, the blocks compressed-tensors' int4 holds exactly (docs/export.md,
#: "Quantized Hugging Face exports")
Q4_GRIDS = ("asymmetric", "symmetric")
_SYMMETRIC: dict[str, Codec] = {}


def takes_grid(name: str) -> bool:
    """True for a codec whose blocks a q4 grid places (q4, q4_64); False for every other name ("keep" too)."""
    return isinstance(_REGISTRY.get(name), _Q4)


def encoder(name: str, q4_grid: str = "asymmetric") -> Codec:
    """The codec that encodes `name` on `q4_grid` (Q4_GRIDS): the registered codec, or for a q4 codec and
    "symmetric" its twin that writes symmetric blocks (same name, bytes and decode). Other codecs ignore
    the grid: q8 is symmetric already, plain codecs have none."""
    if q4_grid not in Q4_GRIDS:
        raise CodecError(f"q4 grid {q4_grid!r}: one of {', '.join(Q4_GRIDS)}")
    c = get(name)
    if q4_grid == "asymmetric" or not takes_grid(name):
        return c
    if name not in _SYMMETRIC:
        _SYMMETRIC[name] = _Q4(c.block, symmetric=True)
    return _SYMMETRIC[name]


def get(name: str) -> Codec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r} (known: {', '.join(_REGISTRY)})") from None


#: Matrices a whole model written in a codec of fewer than 8 bits keeps at q8 (by name: a CMF
#: tensor's or a module parameter's name holding one of these). The token embedding is also the
#: head in a tied model (SmolLM2): every logit is a dot product with its rows, so q4's error there
#: reaches every token's distribution, and it is a fifth of a 135M model's weights. llama.cpp's
#: 4-bit types keep the head (or a tied token_embd) at 6 bits for the same reason. eh_proj, the
#: MTP draft's input projection, starts as [0 | I]: a q4 block of 32 holding one weight near 1
#: spends its 16 levels on it and rounds the rest to 0 or 1/15. On a pruned and healed SmolLM2-135M
#: the embedding at q8 lowered q4 round-to-nearest's excess over f16 on every text, to about half on
#: the heal source's own, for a sixth more bytes (bench/QUALITY.md, "The embedding at q8").
KEEP_8BIT = ("embed_tokens.", "lm_head.", "eh_proj.")


def below_8_bits(c: Codec) -> bool:
    """True for a quantized codec of fewer than 8 bits a weight (q4, q4_64): the ones the rule above applies to."""
    return not c.plain and c.bytes_per_weight() < 1.0


def rule_key(codec: str) -> dict:
    """What a stage that writes a whole model in `codec` adds to its cache key for the rule above: the
    names kept at q8 when `codec` has fewer than 8 bits (so a cache made before the rule, or under
    another one, is not taken for its output), nothing otherwise (the digests of every other codec stay)."""
    if codec in ("keep", "none"):
        return {}
    return {"keep_8bit": list(KEEP_8BIT)} if below_8_bits(get(codec)) else {}


def choose_codec(requested: str, shape: tuple[int, ...], current: str = "f32", name: str = "",
                 keep_8bit: tuple[str, ...] = KEEP_8BIT) -> str:
    """The codec a tensor `name` of `shape`, now in `current`, gets when a whole
    model is written in `requested`: "keep" keeps `current`; a plain codec
    applies to every tensor; a quantized one to matrices only (ndim = 2):
    vectors (norms, biases) and conv kernels stay plain, as they are or f32; and
    below 8 bits a matrix named in `keep_8bit` goes to q8 (an empty `name`, or
    `keep_8bit=()`, quantizes every matrix alike)."""
    if requested == "keep":
        return get(current).name
    c = get(requested)
    if c.plain:
        return c.name
    if len(shape) == 2:
        return "q8" if below_8_bits(c) and name and any(k in name for k in keep_8bit) else c.name
    return current if get(current).plain else "f32"


def to_numpy_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's bytes as a uint8 array (no copy where possible)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().reshape(-1).view(np.uint8)
