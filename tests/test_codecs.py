"""Codecs: round-trip error within each codec's bound, bytes per weight, the
byte layout, the registry."""

import math

import numpy as np
import pytest
import torch

from cortiq import codecs
from cortiq.codecs import Codec, CodecError

BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8": 34 / 32, "q4": 20 / 32, "q4_64": 36 / 64, "fp8": 34 / 32}
QUANTIZED = ["q8", "q4", "q4_64", "fp8"]


def test_registry_has_the_codecs_of_the_design():
    assert set(BYTES_PER_WEIGHT) <= set(codecs.names())


@pytest.mark.parametrize("name", sorted(BYTES_PER_WEIGHT))
def test_bytes_per_weight(name):
    c = codecs.get(name)
    assert c.bytes_per_weight() == pytest.approx(BYTES_PER_WEIGHT[name], rel=1e-12)
    shape = (37, 45)  # 1665 values: a partial last block
    stored = c.encode(torch.randn(shape))
    assert stored.numel() * stored.element_size() == c.nbytes(shape)
    if not c.plain:
        block = c.block
        per_block = round(BYTES_PER_WEIGHT[name] * block)
        assert c.nbytes(shape) == math.ceil(1665 / block) * per_block


@pytest.mark.parametrize("name", sorted(BYTES_PER_WEIGHT))
@pytest.mark.parametrize("scale", [1.0, 3e-2, 1e-5, 1e-8, 300.0])
@pytest.mark.parametrize("shape", [(37, 45), (1000,), (3, 5, 7), (64, 32)])
def test_round_trip_within_bound(name, scale, shape):
    torch.manual_seed(hash((name, scale, shape)) % 2**31)
    c = codecs.get(name)
    x = torch.randn(shape) * scale
    x.view(-1)[::17] *= 6  # outliers inside blocks
    y = c.decode(c.encode(x), shape)
    assert y.shape == x.shape and y.dtype == torch.float32
    err, bound = (y - x).abs(), c.bound(x)
    assert bool((err <= bound).all()), float((err / bound).max())
    if name != "f32":
        # the bound is a real bound, not a loose one: some value comes near it
        assert float((err / bound).max()) > 0.25


@pytest.mark.parametrize("name", QUANTIZED)
def test_bounds_are_about_half_a_step(name):
    x = torch.randn(4096)
    b = codecs.get(name).bound(x)
    amax = x.reshape(-1, codecs.get(name).block).abs().amax(1)
    if name == "q8":
        assert float((b.reshape(amax.shape[0], -1)[:, 0] / (amax / 254)).max()) < 1.01
    elif name.startswith("q4"):
        blocks = x.reshape(amax.shape[0], -1)
        step = (blocks.amax(1) - blocks.amin(1)) / 15
        assert float((b.reshape(amax.shape[0], -1)[:, 0] / (step / 2)).max()) < 1.01


@pytest.mark.parametrize("name", QUANTIZED)
def test_blocks_are_independent(name):
    c = codecs.get(name)
    x = torch.randn(8 * 64) * 1e-3
    x[:64] *= 1e4  # a loud first block (both block sizes) must not coarsen the others
    y = c.decode(c.encode(x), x.shape)
    quiet = x[64:]
    assert bool(((y[64:] - quiet).abs() <= c.bound(quiet)).all())


@pytest.mark.parametrize("name", sorted(BYTES_PER_WEIGHT))
def test_zeros_constants_and_empty(name):
    c = codecs.get(name)
    z = torch.zeros(70)
    assert torch.equal(c.decode(c.encode(z), z.shape), z)
    for x in (torch.full((64,), 0.5), torch.full((64,), -2.0)):  # whole blocks (no zero padding)
        y = c.decode(c.encode(x), x.shape)
        if c.plain or name.startswith("q4"):  # the block's min is the constant: exact
            assert torch.equal(y, x)
        assert bool(((y - x).abs() <= c.bound(x)).all())
    e = torch.zeros(0, 4)
    assert c.nbytes(e.shape) == 0
    assert c.decode(c.encode(e), e.shape).shape == (0, 4)
    s = torch.tensor(1.5)
    assert c.decode(c.encode(s), ()).shape == ()


def test_q8_layout():
    """Per block: the f16 scale (little endian), then 32 int8 codes."""
    x = torch.arange(-16, 16, dtype=torch.float32) * 0.25  # amax 4 → scale 4/127
    raw = codecs.get("q8").encode(x)
    assert raw.dtype == torch.uint8 and raw.numel() == 34
    scale = raw[:2].view(torch.float16).float()
    assert float(scale) == pytest.approx(4 / 127, rel=2**-10)
    assert float(scale) >= 4 / 127  # rounded up: no code is clipped
    q = raw[2:].view(torch.int8).float()
    assert torch.equal(q, torch.round(x / scale))


def test_q4_layout():
    """Per block: f16 scale, f16 min, then 16 bytes: element 2k in the low nibble, 2k+1 in the high one."""
    x = torch.cat([torch.arange(16.0), torch.arange(15.0, -1, -1)])  # min 0, step 1
    raw = codecs.get("q4").encode(x)
    assert raw.numel() == 20
    assert float(raw[:2].view(torch.float16)) == 1.0 and float(raw[2:4].view(torch.float16)) == 0.0
    codes = torch.stack([raw[4:] & 0xF, raw[4:] >> 4], 1).reshape(-1)
    assert torch.equal(codes.float(), x)


def test_quantized_scales_never_clip_subnormal_blocks():
    # amax/127 far below f16's normal range: the scale is a subnormal f16
    x = torch.linspace(-3e-6, 3e-6, 64)
    for name in QUANTIZED:
        c = codecs.get(name)
        assert bool(((c.decode(c.encode(x), x.shape) - x).abs() <= c.bound(x)).all()), name


@pytest.mark.parametrize("name", QUANTIZED + ["f16"])
def test_non_finite_or_out_of_range_raises(name):
    c = codecs.get(name)
    with pytest.raises(CodecError, match=name):
        c.encode(torch.tensor([1.0, float("inf")] * 16))
    if name == "f16":
        with pytest.raises(CodecError, match="65504"):
            c.encode(torch.tensor([1e6]))


def test_decode_rejects_wrong_sizes():
    stored = codecs.get("q8").encode(torch.randn(64))
    with pytest.raises(CodecError, match="q8"):
        codecs.get("q8").decode(stored, (65,))
    with pytest.raises(CodecError, match="f16"):
        codecs.get("f16").decode(torch.zeros(4), (4,))


def test_unknown_codec_names_the_known_ones():
    with pytest.raises(CodecError, match=r"unknown codec 'q3' \(known: f32, f16"):
        codecs.get("q3")


class _Half(Codec):
    """A toy codec: f16 bytes stored as uint8 (a registry test)."""

    name = "test_half"

    def nbytes(self, shape):
        return 2 * math.prod(shape)

    def encode(self, x):
        return x.to(torch.float16).contiguous().view(torch.uint8).reshape(-1)

    def decode(self, stored, shape):
        return stored.view(torch.float16).float().reshape(shape)

    def bound(self, x):
        return x.abs() * 2**-11 + 2**-25


def test_registry_takes_more_and_refuses_a_taken_name():
    c = codecs.register(_Half())
    assert codecs.get("test_half") is c
    assert codecs.register(c) is c  # the same codec again is harmless
    with pytest.raises(CodecError, match="already registered"):
        codecs.register(_Half())
    with pytest.raises(CodecError, match="keep"):
        h = _Half()
        h.name = "keep"
        codecs.register(h)
    x = torch.randn(5, 7)
    assert bool(((c.decode(c.encode(x), x.shape) - x).abs() <= c.bound(x)).all())


def test_choose():
    assert codecs.choose_codec("keep", (4, 4), "q8") == "q8"
    assert codecs.choose_codec("f16", (4,), "f32") == "f16"  # plain codecs: every tensor
    assert codecs.choose_codec("q8", (4, 4), "f16") == "q8"  # quantized: matrices...
    assert codecs.choose_codec("q8", (4,), "bf16") == "bf16"  # ...vectors stay plain
    assert codecs.choose_codec("q4", (4,), "q8") == "f32"
    # below 8 bits the embedding, the head and the draft's eh_proj stay at q8, by name ...
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.mtp.eh_proj.weight"):
        assert codecs.choose_codec("q4", (4, 4), "f16", name) == "q8"
        assert codecs.choose_codec("q4_64", (4, 4), "f16", name) == "q8"
        assert codecs.choose_codec("q4", (4, 4), "f16", name, keep_8bit=()) == "q4"
        assert codecs.choose_codec("fp8", (4, 4), "f16", name) == "fp8"  # 8 bits: no exception
        assert codecs.choose_codec("q4", (4,), "f32", name) == "f32"  # a vector of that name stays plain
    # ... and every other matrix, or a matrix with no name, is in the codec asked for
    assert codecs.choose_codec("q4", (4, 4), "f16", "model.layers.0.mlp.down_proj.weight") == "q4"
    assert codecs.choose_codec("q4", (4, 4), "f16") == "q4"
    with pytest.raises(CodecError):
        codecs.choose_codec("zz", (4, 4), "f32")


def test_rule_key_names_the_rule_only_below_8_bits():
    # a stage writing a whole model puts the 8-bit names in its key for a 4-bit codec only, so the
    # digests of every other codec are those from before the rule
    assert codecs.rule_key("q4") == codecs.rule_key("q4_64") == {"keep_8bit": list(codecs.KEEP_8BIT)}
    for c in ("q8", "fp8", "f16", "f32", "bf16", "keep", "none"):
        assert codecs.rule_key(c) == {}


# ── q4 on a symmetric grid (codecs.encoder(name, "symmetric")) ──

def _f16_at_least(v: float) -> np.float16:
    """The least f16 ≥ v (v ≥ 0), one value at a time."""
    h = np.float16(v)
    return np.nextafter(h, np.float16(np.inf)) if float(h) < v else h


def _symmetric_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    """Symmetric q4 by hand, block by block: the least f16 scale with max ≤ 7 steps and −min ≤ 8, min −8
    steps, each value rounded to the nearest of the 16 levels min + k·scale (computed in f32 as decode does)."""
    flat = x.reshape(-1).tolist()
    flat += [0.0] * (-len(flat) % block)
    out = []
    for a in range(0, len(flat), block):
        b = np.array(flat[a : a + block], dtype=np.float32)
        s = _f16_at_least(max(max(float(b.max()), 0.0) / 7.0, max(-float(b.min()), 0.0) / 8.0))
        lo, s32 = np.float32(np.float16(-8.0) * s), np.float32(s)
        for v in b:
            q = 0 if s32 == 0 else min(max(round(float(np.float32(np.float32(v - lo) * np.float32(1.0 / s32)))), 0), 15)
            out.append(float(np.float32(lo + np.float32(q) * s32)))
    return torch.tensor(out[: x.numel()], dtype=torch.float32).reshape(x.shape)


@pytest.mark.parametrize("name", ["q4", "q4_64"])
@pytest.mark.parametrize("shape,scale", [((37, 45), 1.0), ((3, 5, 7), 3e-2), ((130,), 1e-6), ((7, 64), 300.0)])
def test_symmetric_q4_is_the_plain_reference_and_every_min_is_minus_8_steps(name, shape, scale):
    torch.manual_seed(hash((name, shape)) % 2**31)
    x = torch.randn(shape) * scale
    x.view(-1)[::13] *= 5  # outliers inside blocks
    x.view(-1)[:32] = x.view(-1)[:32].abs()  # a block of one sign, then of the other
    x.view(-1)[32:64] = -x.view(-1)[32:64].abs()
    c, plain = codecs.encoder(name, "symmetric"), codecs.get(name)
    stored = c.encode(x)
    assert c.name == name and stored.numel() == plain.nbytes(shape)  # q4's bytes, q4's decode
    raw = stored.reshape(-1, 4 + c.block // 2)
    scale16, lo16 = raw[:, :2].contiguous().view(torch.float16), raw[:, 2:4].contiguous().view(torch.float16)
    assert torch.equal(lo16.float(), scale16.float() * -8.0)
    assert c.symmetric_blocks(stored) and not plain.symmetric_blocks(plain.encode(x))
    y = plain.decode(stored, shape)
    assert torch.equal(y, _symmetric_reference(x, c.block))
    assert bool(((y - x).abs() <= c.bound(x)).all()) and torch.equal(c.roundtrip(x), y)


def test_the_grid_names_one_encoder_per_codec():
    assert codecs.encoder("q4") is codecs.get("q4")
    assert codecs.encoder("q8", "symmetric") is codecs.get("q8")  # symmetric already
    assert codecs.encoder("f16", "symmetric") is codecs.get("f16")
    assert codecs.encoder("q4", "symmetric") is codecs.encoder("q4", "symmetric") is not codecs.get("q4")
    assert [n for n in codecs.names() if codecs.takes_grid(n)] == ["q4", "q4_64"] and not codecs.takes_grid("keep")
    with pytest.raises(CodecError, match="q4 grid 'odd': one of asymmetric, symmetric"):
        codecs.encoder("q4", "odd")
    with pytest.raises(CodecError, match="symmetric block"):  # 60000 at +7 steps: −8 steps past f16's largest
        codecs.encoder("q4", "symmetric").encode(torch.full((32,), 60000.0))
