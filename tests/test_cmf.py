"""CMF: a safetensors file with the cmf document; lazy memory-mapped reads, a
streaming atomic writer, shards, sha256 per tensor, provenance."""

import gc
import hashlib
import json
import struct
import weakref

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cortiq import cmf, codecs
from cortiq.arch import Arch
from cortiq.cmf import CmfError, Spec, Stored
from cortiq.errors import CortiqError
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

ARCH = Arch("llama", vocab_size=259, hidden_size=32, num_layers=2, intermediate_sizes=[48, 40],
            num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)


def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": (torch.randn(259, 32, generator=g), "q8"),
        "model.norm.weight": (torch.rand(32, generator=g) + 0.5, "f32"),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(48, 32, generator=g), "q4"),
        "model.layers.0.mlp.down_proj.weight": (torch.randn(32, 48, generator=g), "q4_64"),
        "model.layers.1.mlp.up_proj.weight": (torch.randn(40, 32, generator=g), "bf16"),
        "model.layers.1.mlp.down_proj.weight": (torch.randn(32, 40, generator=g), "f16"),
        "model.layers.1.self_attn.q_proj.weight": (torch.randn(32, 32, generator=g) * 0.01, "fp8"),
        "odd": (torch.randn(3, 5, 7, generator=g), "q8"),
    }


def write(path, ts=None, shard_bytes=cmf.SHARD_BYTES, provenance=None):
    ts = ts or tensors()
    specs = [Spec(n, c, tuple(t.shape), lambda t=t: t) for n, (t, c) in ts.items()]
    tok = tokenizer_doc(byte_tokenizer_json(), eos_ids=[256])
    return cmf.write_cmf(path, cmf.new_doc(ARCH, tok, provenance or {"convert": {"source": "test"}}), specs,
                         shard_bytes=shard_bytes)


def test_round_trip_every_codec(tmp_path):
    ts = tensors()
    f = cmf.open_cmf(write(tmp_path / "m.cmf", ts))
    assert f.arch == ARCH and f.eos_id == 256
    assert set(f.names) == set(ts)
    for name, (t, codec) in ts.items():
        info = f.info(name)
        assert info.codec == codec and info.shape == tuple(t.shape)
        got = f.tensor(name)
        assert got.dtype == torch.float32 and got.shape == t.shape
        assert bool(((got - t).abs() <= codecs.get(codec).bound(t)).all()), name
        assert f.tensor(name, torch.float16).dtype == torch.float16
    assert f.verify() == []


def test_is_a_valid_safetensors_file(tmp_path):
    ts = tensors()
    path = write(tmp_path / "m.cmf", ts)
    f = cmf.open_cmf(path)
    with safe_open(path, "pt") as g:
        assert set(g.keys()) == set(ts)
        doc = json.loads(g.metadata()["cmf"])
        assert doc["format"] == "cmf" and doc["arch"]["hidden_size"] == 32
        for name in ts:
            assert torch.equal(g.get_tensor(name), f.stored(name))
    # plain tensors are typed and of their logical shape, quantized ones flat bytes
    assert f.stored("model.layers.1.mlp.up_proj.weight").dtype == torch.bfloat16
    assert f.stored("model.norm.weight").shape == (32,)
    assert f.stored("odd").dtype == torch.uint8 and f.stored("odd").dim() == 1


def test_reads_are_lazy_views_of_the_map(tmp_path):
    f = cmf.open_cmf(write(tmp_path / "m.cmf", shard_bytes=4096))
    assert len(f.paths) > 1
    assert all(m is None for m in f._maps)  # opening reads headers only
    name = "model.norm.weight"
    raw = f.raw(name)
    assert isinstance(raw.base, np.memmap) or isinstance(raw, np.memmap)
    mapped = [m is not None for m in f._maps]
    assert mapped.count(True) == 1 and mapped[f.info(name).shard]
    # stored() shares the map's memory; tensor() is a fresh copy that can be changed freely
    st = f.stored(name)
    assert np.shares_memory(st.numpy(), raw)
    t = f.tensor(name)
    t.add_(1.0)
    assert torch.equal(f.tensor(name), st)


def test_typed_tensors_are_aligned(tmp_path):
    path = write(tmp_path / "m.cmf")
    f = cmf.open_cmf(path)
    for info in f.infos.values():
        assert info.start % cmf._ST_DTYPES[info.st_dtype][2] == 0, info.name


def test_writer_streams_one_tensor_at_a_time(tmp_path):
    """Each getter runs once, and the tensor it gave is gone before the next one runs."""
    alive: list[weakref.ref] = []
    calls = []

    def getter(name, shape):
        def get():
            gc.collect()
            assert all(r() is None for r in alive), "an earlier tensor is still held"
            calls.append(name)
            t = torch.randn(shape)
            alive.append(weakref.ref(t))
            return t
        return get

    specs = [Spec(f"t{i}", c, (64, 32), getter(f"t{i}", (64, 32))) for i, c in enumerate(["f32", "q8", "f16", "q4"] * 3)]
    cmf.write_cmf(tmp_path / "m.cmf", cmf.new_doc(ARCH, None), specs)
    assert sorted(calls) == sorted(s.name for s in specs)


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "m.cmf"
    write(path)
    before = path.read_bytes()
    seen = {}

    def boom():
        seen["partial"] = sorted(p.name for p in tmp_path.iterdir())
        raise RuntimeError("boom")

    specs = [Spec("a", "f32", (4,), lambda: torch.zeros(4)), Spec("b", "q8", (4, 32), boom)]
    with pytest.raises(RuntimeError, match="boom"):
        cmf.write_cmf(path, cmf.new_doc(ARCH, None), specs)
    assert "m.cmf.partial" in seen["partial"]  # while writing, only the .partial is new
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.cmf"]  # no partial left
    assert path.read_bytes() == before  # the old model is untouched


def test_atomic_write_of_shards_leaves_nothing_on_failure(tmp_path):
    specs = [Spec(f"t{i}", "f32", (256,), lambda: torch.zeros(256)) for i in range(4)]
    specs.append(Spec("bad", "f32", (256,), lambda: torch.zeros(3)))  # the wrong shape
    with pytest.raises(CortiqError, match=r"m\.cmf: tensor 'bad': shape \[3\]"):
        cmf.write_cmf(tmp_path / "m.cmf", cmf.new_doc(ARCH, None), specs, shard_bytes=1024)
    assert list(tmp_path.iterdir()) == []


def test_codec_errors_name_the_file_and_tensor(tmp_path):
    specs = [Spec("big", "f16", (2,), lambda: torch.tensor([1.0, 1e9]))]
    with pytest.raises(CortiqError, match=r"m\.cmf: tensor 'big': f16: values beyond"):
        cmf.write_cmf(tmp_path / "m.cmf", cmf.new_doc(ARCH, None), specs)
    assert list(tmp_path.iterdir()) == []


def test_shards_open_through_the_first(tmp_path):
    ts = tensors()
    path = write(tmp_path / "m.cmf", ts, shard_bytes=8192)
    files = sorted(p.name for p in tmp_path.iterdir())
    n = len(files)
    assert n >= 3 and files == sorted(["m.cmf"] + [f"m-{i:05d}-of-{n:05d}.cmf" for i in range(2, n + 1)])
    f = cmf.open_cmf(path)
    assert len({i.shard for i in f.infos.values()}) == n
    for name, (t, codec) in ts.items():
        assert bool(((f.tensor(name) - t).abs() <= codecs.get(codec).bound(t)).all())
    assert f.verify() == []
    # a missing shard is named
    last = f.paths[-1].name
    assert last == f"m-{n:05d}-of-{n:05d}.cmf"
    (tmp_path / last).unlink()
    with pytest.raises(CmfError, match=f"shard {last} is missing"):
        cmf.open_cmf(path)


def test_hashes_are_sha256_of_stored_bytes_and_verify_catches_a_flipped_byte(tmp_path):
    path = write(tmp_path / "m.cmf")
    f = cmf.open_cmf(path)
    for name in f.names:
        assert f.doc["hashes"][name] == hashlib.sha256(f.raw(name).tobytes()).hexdigest()
    victim = f.info("model.layers.0.mlp.up_proj.weight")
    data = bytearray(path.read_bytes())
    data[victim.start + 5] ^= 0x01
    path.write_bytes(bytes(data))
    assert cmf.open_cmf(path).verify() == ["model.layers.0.mlp.up_proj.weight"]


def test_provenance_is_extended_never_lost(tmp_path):
    src = cmf.open_cmf(write(tmp_path / "a.cmf", provenance={"convert": {"source": "x.gguf"}}))
    doc = cmf.with_provenance(src.doc, "fold", {"keep": 0.5})
    doc = cmf.with_provenance(doc, "recode", {"codec": "q8"})
    doc = cmf.with_provenance(doc, "recode", {"codec": "f16"})
    assert src.provenance == {"convert": {"source": "x.gguf"}}  # the source's document is not changed
    out = cmf.open_cmf(cmf.write_cmf(tmp_path / "b.cmf", doc, cmf.copy_specs(src)))
    assert list(out.provenance) == ["convert", "fold", "recode", "recode#2"]
    assert out.provenance["recode"] == {"codec": "q8"} and out.provenance["recode#2"] == {"codec": "f16"}
    assert out.tokenizer == src.tokenizer and out.arch == src.arch


def test_copy_specs_copies_bytes_or_recodes(tmp_path):
    src = cmf.open_cmf(write(tmp_path / "a.cmf"))
    new = torch.randn(32)
    specs = cmf.copy_specs(src, lambda n, i: "q8" if n == "model.layers.1.mlp.up_proj.weight" else i.codec,
                           replace={"model.norm.weight": new})
    out = cmf.open_cmf(cmf.write_cmf(tmp_path / "b.cmf", src.doc, specs))
    for name in src.names:
        if name in ("model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
            continue
        assert out.doc["hashes"][name] == src.doc["hashes"][name]  # copied byte for byte
    re = "model.layers.1.mlp.up_proj.weight"
    assert out.info(re).codec == "q8"
    assert bool(((out.tensor(re) - src.tensor(re)).abs() <= codecs.get("q8").bound(src.tensor(re))).all())
    assert torch.equal(out.tensor("model.norm.weight"), new)
    assert out.verify() == []


def test_stored_spec_must_match_its_codec(tmp_path):
    specs = [Spec("a", "q8", (4, 32), lambda: Stored(torch.zeros(10, dtype=torch.uint8)))]
    with pytest.raises(CortiqError, match="10 bytes encoded, 136 expected"):
        cmf.write_cmf(tmp_path / "m.cmf", cmf.new_doc(ARCH, None), specs)
    assert list(tmp_path.iterdir()) == []


# ── bad files ──


def test_truncated_file(tmp_path):
    path = write(tmp_path / "m.cmf")
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CmfError, match=r"m\.cmf: truncated"):
        cmf.open_cmf(path)
    path.write_bytes(data[:100])  # inside the header
    with pytest.raises(CmfError, match=r"m\.cmf: truncated"):
        cmf.open_cmf(path)
    path.write_bytes(data[:5])
    with pytest.raises(CmfError, match=r"m\.cmf: not a CMF file \(only 5 bytes\)"):
        cmf.open_cmf(path)


def test_not_cmf(tmp_path):
    text = tmp_path / "t.cmf"
    text.write_text("hello, this is not a model at all\n" * 10)
    with pytest.raises(CmfError, match=r"t\.cmf: not a CMF file"):
        cmf.open_cmf(text)
    plain = tmp_path / "p.safetensors"
    save_file({"w": torch.zeros(3)}, plain)
    with pytest.raises(CmfError, match=r"p\.safetensors: not a CMF file \(a safetensors file without the cmf document\)"):
        cmf.open_cmf(plain)
    with pytest.raises(CmfError, match="no such file"):
        cmf.open_cmf(tmp_path / "missing.cmf")
    with pytest.raises(CmfError, match="is a directory"):
        cmf.open_cmf(tmp_path)


def _rewrite_doc(path, change):
    """Rewrite a CMF header in place (same data) after `change(doc)`."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    doc = json.loads(header["__metadata__"]["cmf"])
    change(doc)
    header["__metadata__"]["cmf"] = json.dumps(doc)
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_unknown_codec_in_a_file(tmp_path):
    path = write(tmp_path / "m.cmf")
    _rewrite_doc(path, lambda d: d["codecs"]["odd"].update(codec="q3"))
    with pytest.raises(CmfError, match=r"m\.cmf: tensor 'odd': unknown codec 'q3' \(known: f32"):
        cmf.open_cmf(path)


def test_codec_that_does_not_fit_its_storage(tmp_path):
    path = write(tmp_path / "m.cmf")
    _rewrite_doc(path, lambda d: d["codecs"]["odd"].update(shape=[3, 5, 20]))
    with pytest.raises(CmfError, match=r"tensor 'odd': stored as U8\[136\], codec q8 of \[3, 5, 20\] needs U8\[340\]"):
        cmf.open_cmf(path)


def test_bad_arch_and_newer_version(tmp_path):
    path = write(tmp_path / "m.cmf")
    _rewrite_doc(path, lambda d: d["arch"].update(num_kv_heads=3))
    with pytest.raises(CmfError, match=r"m\.cmf: the arch is missing or malformed .*do not group"):
        cmf.open_cmf(path)
    path = write(tmp_path / "n.cmf")
    _rewrite_doc(path, lambda d: d.update(version=99))
    with pytest.raises(CmfError, match="version 99 is newer"):
        cmf.open_cmf(path)


def test_overlapping_ranges_are_refused(tmp_path):
    path = write(tmp_path / "m.cmf", {"a": (torch.zeros(4), "f32"), "b": (torch.zeros(4), "f32")})
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["b"]["data_offsets"] = header["a"]["data_offsets"]
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    with pytest.raises(CmfError, match="does not start where the previous one ends"):
        cmf.open_cmf(path)
