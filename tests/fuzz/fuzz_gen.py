"""Corrupted model files: a tiny valid CMF file and HF folder, and mutations of them
(truncations, type swaps, huge counts, deep nesting, traversal paths, symlinks out,
template injection, NaN weights, bad hashes)."""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from cortiq.arch import Arch
from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

V, EOS = 259, 256
ARCH = Arch(arch_name="llama", vocab_size=V, hidden_size=16, num_layers=2, intermediate_sizes=[24, 24], num_heads=2,
            num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=64)
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


def model_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The weights of ARCH, small random values (HF llama names are CMF names)."""
    from cortiq.model import CausalLM

    torch.manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in CausalLM(ARCH).named_parameters()}
    return {n: (1.0 + 0.1 * torch.randn(s)) if len(s) == 1 else 0.1 * torch.randn(s) for n, s in shapes.items()}


def write_valid_cmf(path: Path, template: str | None = None, tensors: dict | None = None) -> Path:
    tok = tokenizer_doc(byte_tokenizer_json(), [EOS], chat_template=template)
    ts = tensors or model_tensors()
    return write_cmf(path, new_doc(ARCH, tok), specs_from_tensors(ts.items(), "f32"))


# ── the CMF file as (header, data) ──────────────────────────────────────


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict | str | bytes, data: bytes) -> bytes:
    h = header if isinstance(header, bytes) else (header if isinstance(header, str) else json.dumps(header)).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def with_doc(raw: bytes, change: Callable[[dict], object]) -> bytes:
    """`raw` with its cmf document replaced by `change(doc)` (a new value, or the doc changed in place)."""
    header, data = split(raw)
    doc = json.loads(header["__metadata__"]["cmf"])
    new = change(doc)
    header["__metadata__"]["cmf"] = json.dumps(doc if new is None else new)
    return join(header, data)


def with_arch(key: str, value) -> Callable[[bytes], bytes]:
    def f(raw):
        def ch(doc):
            if value is _DELETE:
                del doc["arch"][key]
            else:
                doc["arch"][key] = value
        return with_doc(raw, ch)
    return f


def with_entry(name: str, key: str, value) -> Callable[[bytes], bytes]:
    """A tensor's safetensors entry (`dtype`, `shape`, `data_offsets`) set to `value`."""
    def f(raw):
        header, data = split(raw)
        header[name][key] = value
        return join(header, data)
    return f


def set_doc(key: str, value) -> Callable[[bytes], bytes]:
    def f(raw):
        def ch(doc):
            doc[key] = value
        return with_doc(raw, ch)
    return f


_DELETE = object()
NORM = "model.norm.weight"


def _flip_data_byte(raw: bytes) -> bytes:
    header, data = split(raw)
    b, _ = header[NORM]["data_offsets"]
    d = bytearray(data)
    d[b] ^= 0x40
    return join(header, bytes(d))


def _nan_norm(raw: bytes) -> bytes:
    """A NaN in the final norm, its hash updated to match (a file damaged *before* it was hashed)."""
    header, data = split(raw)
    b, e = header[NORM]["data_offsets"]
    d = bytearray(data)
    d[b : b + 4] = struct.pack("<f", float("nan"))
    doc = json.loads(header["__metadata__"]["cmf"])
    doc["hashes"][NORM] = hashlib.sha256(bytes(d[b:e])).hexdigest()
    header["__metadata__"]["cmf"] = json.dumps(doc)
    return join(header, bytes(d))


def _drop_hash(raw: bytes) -> bytes:
    return with_doc(raw, lambda doc: doc["hashes"].pop(NORM) and None)


def _deep_header(raw: bytes) -> bytes:
    _, data = split(raw)
    return join('{"a":' + "[" * 200_000 + "]" * 200_000 + "}", data)


def _deep_doc(raw: bytes) -> bytes:
    header, data = split(raw)
    header["__metadata__"]["cmf"] = '{"format": "cmf", "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    return join(header, data)


def _renamed(new: str) -> Callable[[bytes], bytes]:
    """The final norm's entry (and its hash) under another name."""
    def f(raw):
        header, data = split(raw)
        header[new] = header.pop(NORM)
        doc = json.loads(header["__metadata__"]["cmf"])
        doc["hashes"][new] = doc["hashes"].pop(NORM)
        header["__metadata__"]["cmf"] = json.dumps(doc)
        return join(header, data)
    return f


INJECT = "{{ cycler.__init__.__globals__.os.popen('touch INJECTED').read() }}"

#: name → (mutation of the valid file's bytes, commands that must refuse it, the message they give).
#: Commands: inspect, verify, recode, nll (which loads the model). Those not listed may succeed
#: (inspect does not read tensors, say) but must not crash.
ALL = ("inspect", "verify", "recode", "nll")
LOAD = ("verify", "recode", "nll")
CMF_CASES: dict[str, tuple[Callable[[bytes], bytes], tuple, str]] = {
    "doc is a list": (lambda r: with_doc(r, lambda d: [d]), ALL, r"the cmf document is list"),
    "doc is a number": (lambda r: with_doc(r, lambda d: 3), ALL, r"the cmf document is int"),
    "version is a string": (set_doc("version", "1"), ALL, r"version is '1', not a positive integer"),
    "version is a table": (set_doc("version", {}), ALL, r"version is '\{\}'"),
    "version from the future": (set_doc("version", 99), ALL, r"CMF version 99 is newer"),
    "hashes is a list": (set_doc("hashes", []), ALL, r"hashes is list, not a table"),
    "a hash is a number": (lambda r: with_doc(r, lambda d: d["hashes"].__setitem__(NORM, 5)), ALL,
                           r"the hash of 'model.norm.weight' is not a sha256"),
    "codecs is a list": (set_doc("codecs", ["q8"]), ALL, r"codecs is list, not a table"),
    "codec shape negative": (set_doc("codecs", {NORM: {"codec": "q8", "shape": [-16]}}), ALL, r"codecs entry"),
    "codec unknown": (set_doc("codecs", {NORM: {"codec": "zz9", "shape": [16]}}), ALL, r"unknown codec|zz9"),
    "tokenizer is a string": (set_doc("tokenizer", "x"), ALL, r"tokenizer is str, not a table"),
    "eos ids are strings": (lambda r: with_doc(r, lambda d: d["tokenizer"].__setitem__("eos_ids", ["a"])), ALL,
                            r"tokenizer.eos_ids"),
    "provenance is a list": (set_doc("provenance", [1]), ALL, r"provenance is list, not a table"),
    "shards is a string": (set_doc("shards", "abc"), ALL, r"shards is not a list"),
    "shard climbs out": (set_doc("shards", ["../../etc/passwd"]), ALL, r"not a plain file name"),
    "shard is absolute": (set_doc("shards", ["/etc/passwd"]), ALL, r"not a plain file name"),
    "arch is a list": (set_doc("arch", [1, 2]), ALL, r"the arch is list"),
    "arch key missing": (with_arch("hidden_size", _DELETE), ALL, r"arch keys missing: \['hidden_size'\]"),
    "arch key unknown": (with_arch("bogus", 1), ALL, r"unknown arch keys \['bogus'\]"),
    "10**8 layers": (with_arch("num_layers", 10**8), ALL, r"num_layers 100000000 is out of range"),
    "1000 layers, 2 present": (lambda r: with_arch("layer_types", ["full_attention"] * 1000)(
        with_arch("intermediate_sizes", [24] * 1000)(with_arch("num_layers", 1000)(r))),
                               ("nll",), r"holds tensors of 2 layers, its arch says 1000"),
    "a layer past the arch": (lambda r: with_arch("layer_types", ["full_attention"])(
        with_arch("intermediate_sizes", [24])(with_arch("num_layers", 1)(r))), ALL,
        r"holds tensors of layer 1, its arch says 1 layers"),
    "vocab 10**12": (with_arch("vocab_size", 10**12), ALL, r"vocab_size 1000000000000 is out of range"),
    "vocab mismatch": (with_arch("vocab_size", 1000), ALL, r"model.embed_tokens.weight is \[259, 16\], its arch says"),
    "fractional hidden": (with_arch("hidden_size", 2.5), ALL, r"hidden_size is float 2.5, not an integer"),
    "boolean layers": (with_arch("num_layers", True), ALL, r"num_layers is bool"),
    "huge width list": (with_arch("intermediate_sizes", [24] * 200_000), ALL, r"intermediate_sizes must be 2 integers"),
    "huge layer_types": (with_arch("layer_types", ["full_attention"] * 200_000), ALL, r"layer_types must be a list of 2"),
    "nan theta": (lambda r: with_doc(r, lambda d: d["arch"].__setitem__("rope_theta", "NaN")), ALL,
                  r"rope_theta is str"),
    "rope_scaling a string": (with_arch("rope_scaling", "x"), ALL, r"rope_scaling is str, not a small table"),
    "llama3 scaling no factors": (with_arch("rope_scaling", {"rope_type": "llama3", "factor": 8}), ALL,
                                  r"rope_scaling.low_freq_factor of llama3 scaling"),
    "norm style a number": (with_arch("norm_style", 3), ALL, r"norm_style is int"),
    "header nested 200k deep": (_deep_header, ALL, r"the header is nested too deeply"),
    "doc nested 200k deep": (_deep_doc, ALL, r"the cmf document is nested too deeply"),
    "negative shape": (with_entry(NORM, "shape", [-16]), ALL, r"malformed entry 'model.norm.weight'"),
    "fractional shape": (with_entry(NORM, "shape", [15.5]), ALL, r"malformed entry 'model.norm.weight'"),
    "string offsets": (with_entry(NORM, "data_offsets", ["0", "64"]), ALL, r"malformed entry"),
    "huge shape": (with_entry(NORM, "shape", [10**12, 10**12]), ALL, r"byte range does not match its shape"),
    "unknown dtype": (with_entry(NORM, "dtype", "F128"), ALL, r"unsupported dtype F128"),
    "bad tokenizer json": (lambda r: with_doc(r, lambda d: d["tokenizer"].__setitem__("json", "{not json")), LOAD,
                           r"its tokenizer does not load"),
    "trailing bytes": (lambda r: r + b"\0" * 24, ALL, r"24 trailing bytes after the last tensor"),
    "codec of no tensor": (set_doc("codecs", {"model.gone.weight": {"codec": "q8", "shape": [16, 16]}}), ALL,
                           r"codec entries for tensors the file does not hold: \['model.gone.weight'\]"),
    "name climbs out": (_renamed("../model.norm.weight"), ALL, r"tensor name '../model.norm.weight' is not a dotted name"),
    "name is absolute": (_renamed("/etc/model.norm.weight"), ALL, r"tensor name '/etc/model.norm.weight' is not a dotted"),
    "name unknown": (_renamed("model.bogus.weight"), LOAD, r"missing tensors \['model.norm.weight'\]"),
    "shape not the arch's": (with_entry(NORM, "shape", [2, 8]), LOAD,
                             r"'model.norm.weight' has shape \[2, 8\], the arch says \[16\]"),
    "flipped data byte": (_flip_data_byte, LOAD, r"fail their sha256|does not match its recorded sha256"),
    "hash missing": (_drop_hash, LOAD, r"fail their sha256|has no recorded sha256"),
    "NaN weight": (_nan_norm, LOAD, r"hold NaN or Inf|holds 1 NaN or Inf"),
    "empty file": (lambda r: b"", ALL, r"not a CMF file \(only 0 bytes\)"),
    "header length 2**63": (lambda r: struct.pack("<Q", 1 << 63) + r[8:], ALL, r"no safetensors header"),
}


# ── a Hugging Face folder ───────────────────────────────────────────────

HF_CONFIG = {"model_type": "llama", "vocab_size": V, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": True, "max_position_embeddings": 64, "eos_token_id": EOS}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_hf(d: Path, sharded: bool = False, template: str = CHATML) -> Path:
    """A tiny llama folder: config.json, model.safetensors (or two shards and an index), tokenizer files."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    ts = model_tensors()
    (d / "config.json").write_text(json.dumps(HF_CONFIG))
    if sharded:
        names = sorted(ts)
        half = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
        for fn, ns in half.items():
            save_file({n: ts[n].contiguous() for n in ns}, str(d / fn))
        wm = {n: fn for fn, ns in half.items() for n in ns}
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        save_file({n: t.contiguous() for n, t in ts.items()}, str(d / "model.safetensors"))
    (d / "tokenizer.json").write_text(byte_tokenizer_json())
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": template}))
    return d


def edit_json(p: Path, change: Callable[[dict], object]):
    doc = json.loads(p.read_text())
    new = change(doc)
    p.write_text(json.dumps(doc if new is None else new))


def hf_config(key, value):
    def f(d: Path, outside: Path):
        edit_json(d / "config.json", lambda c: c.__setitem__(key, value))
    return f


def hf_weight_map(fn_of: Callable[[Path, str], str]):
    """Point the first weight_map entry's file at `fn_of(outside, original)`; the real shard
    is copied there, so the converter would succeed if it followed the path."""
    def f(d: Path, outside: Path):
        import shutil

        idx = d / "model.safetensors.index.json"
        doc = json.loads(idx.read_text())
        name = sorted(doc["weight_map"])[0]
        orig = doc["weight_map"][name]
        outside.mkdir(parents=True, exist_ok=True)
        shutil.copy(d / orig, outside / orig)
        new = fn_of(outside, orig)
        for n, fn in doc["weight_map"].items():
            if fn == orig:
                doc["weight_map"][n] = new
        (d / orig).unlink()
        idx.write_text(json.dumps(doc))
    return f


def _symlink_out(d: Path, outside: Path):
    outside.mkdir(parents=True, exist_ok=True)
    (d / "model.safetensors").rename(outside / "secret.safetensors")
    (d / "model.safetensors").symlink_to(outside / "secret.safetensors")


def _template(t: str):
    def f(d: Path, outside: Path):
        edit_json(d / "tokenizer_config.json", lambda c: c.__setitem__("chat_template", t))
    return f


def _write(name: str, text: str | bytes):
    def f(d: Path, outside: Path):
        p = d / name
        p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    return f


def _fifo(name: str):
    def f(d: Path, outside: Path):
        import os

        (d / name).unlink()
        os.mkfifo(d / name)
    return f


#: name → (sharded?, mutation(folder, a folder outside it), the message `convert` gives)
HF_CASES: dict[str, tuple[bool, Callable[[Path, Path], None], str]] = {
    "weight_map climbs out": (True, hf_weight_map(lambda o, fn: f"../{o.name}/{fn}"), r"leads outside the model folder"),
    "weight_map absolute": (True, hf_weight_map(lambda o, fn: str(o / fn)), r"is an absolute path"),
    "weight_map not a table": (True, lambda d, o: edit_json(d / "model.safetensors.index.json",
                                                            lambda c: c.__setitem__("weight_map", [1])),
                               r"no weight_map table"),
    "weights symlinked out": (False, _symlink_out, r"leads outside the model folder"),
    "config 10**8 layers": (False, hf_config("num_hidden_layers", 10**8), r"num_hidden_layers 100000000 is out of range"),
    "config 5 layers, 2 present": (False, hf_config("num_hidden_layers", 5), r"config.json says 5 layers, the weights hold 2"),
    "config hidden a string": (False, hf_config("hidden_size", "abc"), r"hidden_size is str 'abc', not an integer"),
    "config hidden fractional": (False, hf_config("hidden_size", 16.5), r"hidden_size is float 16.5"),
    "config model_type a list": (False, hf_config("model_type", ["llama"]), r"config.json: .*wrong type|unsupported"),
    "config a list": (False, _write("config.json", "[1, 2]"), r"holds a JSON list, not an object"),
    "config nested deep": (False, _write("config.json", "[" * 200_000 + "]" * 200_000), r"nested too deeply"),
    "config binary": (False, _write("config.json", b"\xff\xfe\x00\x01" * 64), r"not UTF-8 text"),
    "config a FIFO": (False, _fifo("config.json"), r"not a regular file"),
    "eos a string": (False, hf_config("eos_token_id", "abc"), r"eos_token_id is abc, not a token id"),
    "template injection": (False, _template(INJECT), r"SecurityError"),
    "template range bomb": (False, _template("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                                             "{% endfor %}"), r"render budget"),
    "template syntax error": (False, _template("{% for %}"), r"does not compile"),
    "template a number": (False, _template(5), r"chat_template is int, not a string"),
    "tokenizer.json garbage": (False, _write("tokenizer.json", "{not json"), r"not a tokenizer the tokenizers library reads"),
    "safetensors garbage": (False, _write("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{bad json}" + b"\0" * 64),
                            r"not a readable safetensors file"),
}


def mutated(raw: bytes, name: str) -> bytes:
    return CMF_CASES[name][0](copy.copy(raw))
