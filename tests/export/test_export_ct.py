"""CMF q8 / q4 → compressed-tensors pack-quantized Hugging Face directories: transformers loads them
quantized with cortiq's NLL, the bytes shrink, `cortiq convert` reads them back, and the packing is
compressed-tensors' own."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_helpers import V, arch_of, recode, write_random  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import TEXT  # noqa: E402

from cortiq.cli import main  # noqa: E402
from cortiq.cmf import Stored, copy_specs, open_cmf, write_cmf  # noqa: E402
from cortiq.convert.hf import convert_hf_dir  # noqa: E402
from cortiq.errors import CortiqError  # noqa: E402
from cortiq.convert import ct  # noqa: E402
from cortiq.export.hf import export_hf  # noqa: E402
from cortiq.model import load_model  # noqa: E402
from cortiq.tokenizer import load_tokenizer  # noqa: E402

pytest.importorskip("compressed_tensors")


def _whole(codec):
    """codec_for: `codec` on every matrix, the embedding and head at q8 (as a whole-model recode)."""
    return lambda n, i: (("q8" if "embed" in n or "lm_head" in n else codec) if len(i.shape) == 2 else i.codec)


def _load(d):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _nll(logits, ids):
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).item()


def _check_loaded_quantized(hf, n_layers=2):
    """Every decoder linear holds packed int32 words and scales, no dense weight (before the first forward,
    on which compressed-tensors' CPU route decompresses them)."""
    for i in range(n_layers):
        for m in (hf.model.layers[i].mlp.gate_proj, hf.model.layers[i].mlp.down_proj):
            params = dict(m.named_parameters())
            assert params["weight_packed"].dtype == torch.int32 and "weight" not in params
            assert getattr(m, "quantization_scheme", None) is not None


def _runs_as_cortiq(out: Path, model_cmf: Path, src: Path, rel: float) -> None:
    """transformers loads `out` quantized, its logits on TEXT within `rel` (of their largest) of `model_cmf`'s
    and its NLL within 0.01."""
    hf = _load(out)
    _check_loaded_quantized(hf)
    ids = torch.tensor([load_tokenizer(src).encode(TEXT).ids])
    with torch.no_grad():
        ref, got = load_model(model_cmf)(ids), hf(ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < rel
    assert abs(_nll(got, ids) - _nll(ref, ids)) < 0.01


def _read_back_byte_for_byte(out: Path, model_cmf: Path, back: Path) -> None:
    """`cortiq convert` of `out` gives every decoder q8 / q4 matrix of `model_cmf` in its codec, byte for byte."""
    b, f = open_cmf(convert_hf_dir(out, back)), open_cmf(model_cmf)
    for n in f.names:
        if n.startswith("model.layers.") and f.info(n).codec in ("q8", "q4"):
            assert b.info(n).codec == f.info(n).codec and torch.equal(b.stored(n), f.stored(n)), n


def _linear_bytes(d: Path) -> int:
    total = 0
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if ".layers." in k:
                t = f.get_tensor(k)
                total += t.numel() * t.element_size() if t.dim() == 2 else 0
    return total


def _symmetric_q4(src: Path, out: Path) -> Path:
    """`src` with every decoder matrix in q4 blocks whose min is −8 steps (symmetric int4): the
    q4 blocks compressed-tensors holds exactly."""
    f = open_cmf(src)
    g = torch.Generator().manual_seed(0)

    def sym(n, shape):
        o, i = shape
        w = f.tensor(n).reshape(-1, 32)
        scale = (w.abs().amax(1) / 7.5).to(torch.float16)
        c = (w / scale.float()[:, None]).round().clamp(-8, 7).to(torch.int8)
        c[torch.rand(c.shape, generator=g) < 0.01] = -8  # the code min −8 steps stands for
        u = (c.to(torch.int16) + 8).to(torch.uint8)
        words = (u[:, 0::2] | (u[:, 1::2] << 4)).reshape(o, i // 2).contiguous().view(torch.int32)
        return Stored(ct.unpack(4, 32, words, scale.reshape(o, i // 32), shape))

    specs = copy_specs(f, _whole("q8"))
    for s in specs:
        if s.name.startswith("model.layers.") and len(s.shape) == 2:
            s.codec, s.get = "q4", (lambda n=s.name, shp=s.shape: sym(n, shp))
            s.__post_init__()
    doc = {k: v for k, v in f.doc.items() if k not in ("codecs", "hashes", "shards")}
    return write_cmf(out, doc, specs)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_q8_export_is_cortiqs_values_and_loads_quantized(tmp_path, family):
    src = write_random(tmp_path / "m.cmf", arch_of(family, widths=(64, 64)), seed=3)
    q8 = recode(src, tmp_path / "q8.cmf", _whole("q8"))
    out = export_hf(q8, tmp_path / "hf")
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    (w,) = [g["weights"] for g in qc["config_groups"].values()]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["strategy"]) == (8, 32, True, "group")
    _runs_as_cortiq(out, q8, src, 1e-5)
    _read_back_byte_for_byte(out, q8, tmp_path / "back.cmf")  # the same codes and scales


def test_q4_export_takes_under_a_third_of_f16_and_a_symmetric_q4_is_exact(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(64, 64)), seed=4)
    f16 = export_hf(src, tmp_path / "f16", dtype="f16")
    q4 = _symmetric_q4(src, tmp_path / "q4.cmf")
    out = export_hf(q4, tmp_path / "hf", dtype="f16")
    assert _linear_bytes(out) <= 0.32 * _linear_bytes(f16)
    _runs_as_cortiq(out, q4, src, 1e-3)  # the q8 embedding and the norms at f16 (--dtype)
    _read_back_byte_for_byte(out, q4, tmp_path / "back.cmf")


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_a_q4_on_the_symmetric_grid_exports_as_exact_4_bit_by_every_method(tmp_path, capsys, method):
    """`cortiq recode --codec q4 --q4-grid symmetric` (round to nearest, or GPTQ / AWQ from data), then
    `export --to hf`: every decoder q4 matrix packed as int4 with nothing dequantized (no note), the linear
    layers at most 32 % of their f16 bytes, transformers runs it quantized with cortiq's NLL, and `cortiq
    convert` reads the same bytes back."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compress"))
    from compress_helpers import tiny_tdata

    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(64, 64)), seed=9)
    f16 = export_hf(src, tmp_path / "f16", dtype="f16")
    argv = ["recode", str(src), str(tmp_path / "q4.cmf"), "--codec", "q4", "--q4-grid", "symmetric"]
    if method != "rtn":
        argv += ["--data", str(tiny_tdata(src, tmp_path / "td")), "--method", method, "--window", "64",
                 "--max-windows", "8", "--device", "cpu", "--work", str(tmp_path / "work")]
    assert main(argv) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "q4.cmf"), "--to", "hf", str(out), "--dtype", "f16"]) == 0
    assert capsys.readouterr().err == ""  # nothing written dequantized, nothing to say
    q4 = open_cmf(tmp_path / "q4.cmf")
    mats = [n for n in q4.names if n.startswith("model.layers.") and len(q4.info(n).shape) == 2]
    assert sum(q4.info(n).codec == "q4" for n in mats) >= len(mats) - 1  # gptq/awq: down_8bit keeps one at q8
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"].values()
    int4 = [t.removeprefix("re:") for g in groups if g["weights"]["num_bits"] == 4 for t in g["targets"]]
    for n in (n for n in mats if q4.info(n).codec == "q4"):  # each a module of the 4-bit group
        assert any(re.fullmatch(t, n.removesuffix(".weight")) for t in int4), n
    assert _linear_bytes(out) <= 0.32 * _linear_bytes(f16)
    _runs_as_cortiq(out, q4.path, src, 1e-3)  # the 4-bit matrices cortiq's values; the q8 embedding at f16
    _read_back_byte_for_byte(out, q4.path, tmp_path / "back.cmf")


def test_q4_of_any_min_is_re_derived_once_and_read_back_as_transformers_runs_it(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("qwen3", widths=(64, 64)), seed=5)
    q4 = recode(src, tmp_path / "q4.cmf", _whole("q4"))
    out = export_hf(q4, tmp_path / "hf", quantized="all")
    back = convert_hf_dir(out, tmp_path / "back.cmf")  # q4 blocks of the values written
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref, got = load_model(back)(ids), _load(out)(ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    b = open_cmf(back)
    again = open_cmf(convert_hf_dir(export_hf(back, tmp_path / "hf2", quantized="all"), tmp_path / "again.cmf"))
    for n in b.names:  # re-derived blocks are symmetric: a second export is exact
        assert torch.equal(again.stored(n), b.stored(n)), n
    assert open_cmf(convert_hf_dir(out, tmp_path / "f16.cmf", codec="f16")).info("model.layers.0.mlp.up_proj.weight").codec == "f16"


def test_pack_is_compressed_tensors_own(tmp_path):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(64, 64)), seed=6)
    for codec, bits in (("q8", 8), ("q4", 4)):
        f = open_cmf(recode(src, tmp_path / f"{codec}.cmf", _whole(codec)))
        n = "model.layers.1.mlp.down_proj.weight"
        p = ct.pack(codec, f.stored(n), f.info(n).shape)
        codes = unpack_from_int32(p["weight_packed"], bits, torch.Size(f.info(n).shape))
        assert torch.equal(pack_to_int32(codes, bits), p["weight_packed"])
        vals = codes.float().reshape(-1, 32) * p["weight_scale"].float().reshape(-1, 1)
        if codec == "q8":  # the library's codes times the scales are cortiq's values
            assert torch.equal(vals.reshape(f.info(n).shape), f.tensor(n))


def test_uniform_widths_shrink_the_f16_export_and_unequal_ones_say_why_not(tmp_path, capsys):
    full = export_hf(write_random(tmp_path / "a.cmf", arch_of("llama", widths=(64, 64)), seed=7), tmp_path / "a", dtype="f16")
    src = write_random(tmp_path / "b.cmf", arch_of("llama", widths=(48, 48)), seed=7)
    assert main(["export", str(src), "--to", "hf", str(tmp_path / "b"), "--dtype", "f16"]) == 0
    assert capsys.readouterr().err == ""
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["intermediate_size"] == 48 and "cortiq_intermediate_sizes" not in cfg
    mlp = {d: sum(_hf_numel(d, k) for k in ("gate_proj", "up_proj", "down_proj")) for d in (full, tmp_path / "b")}
    assert mlp[tmp_path / "b"] == 0.75 * mlp[full]
    uneven = write_random(tmp_path / "c.cmf", arch_of("llama", widths=(64, 32)), seed=7)
    q4 = recode(uneven, tmp_path / "c4.cmf", _whole("q4"))
    assert main(["export", str(q4), "--to", "hf", str(tmp_path / "c")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "widths differ per layer (32..64): every MLP is padded to 64 with zero neurons, which transformers and vLLM "
        "run: no saving there; `cortiq compress --fold-scope per_layer` gives uniform widths that keep it",
        "11 of 11 q4 matrices written dequantized to f32: their blocks keep a min that compressed-tensors' int4 cannot "
        "hold; `cortiq recode --codec q4 --q4-grid symmetric` (any --method) writes q4 that exports exactly as 4-bit, "
        "--quantized all re-derives 4-bit values, not cortiq's (docs/export.md, 'Quantized Hugging Face exports')"]
    assert main(["export", str(q4), "--to", "hf", str(tmp_path / "e"), "--quantized", "all"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[1] == (
        "11 of 11 q4 matrices written as symmetric int4 (compressed-tensors has no per-block min): their values are "
        "re-derived, not cortiq's; `cortiq recode --codec q4 --q4-grid symmetric` (any --method) writes q4 that "
        "exports exactly (docs/export.md, 'Quantized Hugging Face exports')")
    _load(tmp_path / "e")  # padded MLPs dense, the rest packed: one checkpoint transformers loads
    assert main(["export", str(q4), "--to", "hf", str(tmp_path / "d"), "--quantized", "none"]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())


def test_q4_of_any_min_is_exported_exactly_by_default(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(64, 64)), seed=8)
    q4 = recode(src, tmp_path / "q4.cmf", _whole("q4"))
    f = open_cmf(q4)
    assert not any(ct.exact("q4", f.stored(n)) for n in f.names if f.info(n).codec == "q4")
    out = export_hf(q4, tmp_path / "hf")
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = load_model(q4)(ids), _load(out)(ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5
    sym = _symmetric_q4(src, tmp_path / "s.cmf")
    g = open_cmf(sym)
    assert all(ct.exact("q4", g.stored(n)) for n in g.names if g.info(n).codec == "q4")


def _hf_numel(d: Path, proj: str) -> int:
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        return sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys() if proj in k)


def test_convert_refuses_a_quantization_it_does_not_read(tmp_path):
    src = write_random(tmp_path / "m.cmf", arch_of("llama", widths=(64, 64)), seed=8)
    out = export_hf(recode(src, tmp_path / "q8.cmf", _whole("q8")), tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CortiqError) as e:
        convert_hf_dir(out, tmp_path / "back.cmf")
    assert str(e.value) == (f"{out / 'config.json'}: quantization group group_0 (pack-quantized, 8 bits, group 32, "
                            "symmetric False) is not one cortiq reads (symmetric pack-quantized int8 in groups of 32, "
                            "int4 in groups of 32 or 64)")
    assert not (tmp_path / "back.cmf").exists()


def test_runtimes_line_names_where_the_saving_reaches():
    from cortiq.export.hf import runtimes_line

    assert runtimes_line([384, 1152, 1536], 1536) == (
        "MLP widths differ per layer (384..1536 of 1536): smaller in CMF and, for a Llama, GGUF (llama.cpp); the "
        "Hugging Face export pads every MLP to 1536, which transformers and vLLM run in full (--fold-scope "
        "per_layer gives uniform widths)")
    assert runtimes_line([1152] * 3, 1536).startswith("uniform MLP widths (1152 of 1536): smaller in every format")
