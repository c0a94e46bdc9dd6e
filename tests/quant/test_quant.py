"""GPTQ / AWQ on a final model: every grouped weight's GPTQ error under its Gram is
at most round-to-nearest's, the stored blocks decode to the weights the quantized
layers computed with, AWQ's folds leave the file computing what the in-memory
model computed, and `cortiq recode --data` reuses the cached Grams."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_helpers import model_and_data  # noqa: E402

from cortiq import codecs  # noqa: E402
from cortiq.cli import main  # noqa: E402
from cortiq.cmf import open_cmf  # noqa: E402
from cortiq.model import load_model  # noqa: E402
from cortiq.quant import QuantSettings, quantize, read_grams, requantize  # noqa: E402
from cortiq.quant.layers import gram_error, groups, more_bits, quantize_layer  # noqa: E402

S = dict(window=64, max_windows=8, device="cpu", awq_grid=5)


@pytest.mark.parametrize("codec", ["q8", "q4", "q4_64", "fp8", "f16", "bf16", "f32"])
def test_roundtrip_is_decode_of_encode(codec):
    c = codecs.get(codec)
    x = torch.randn(7, 45) * torch.logspace(-3, 2, 45)  # uneven scales, a padded last block
    assert torch.equal(c.roundtrip(x), c.decode(c.encode(x), (7, 45)))


def _check_layer(layer, W0: dict, grams: dict, r, method: str, c) -> None:
    """`quantize_layer`'s result `r` on `layer` (its weights before: W0): each group's error under its Gram at most
    the round-to-nearest's by `c`, that one reported as the plain reference computes it (RTN of the original
    weights; AWQ reports RTN of up's rows as its down scales left them, so gptq only), the blocks decoding to
    the weights the layer holds."""
    for row in r.rows:
        assert row["err"] <= row["err_rtn"], row
    for gr in groups(layer) if method == "gptq" else ():
        W = torch.cat([W0[f"{n}.weight"] for n in gr.mods]).double()
        rtn = gram_error(W - c.roundtrip(W.float()).double(), grams[gr.key])
        assert abs(float(rtn) - next(x["err_rtn"] for x in r.rows if x["group"] == gr.key)) <= 1e-9 * float(rtn)
    mods = dict(layer.named_modules())
    for name, st in r.stored.items():
        w = mods[name].weight
        assert torch.equal(c.decode(st, tuple(w.shape)), w.detach()), name


def _correlated_grams(layer, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for gr in groups(layer):
        C = dict(layer.named_modules())[gr.hook].weight.shape[1]
        mix = torch.randn(C, C, generator=g, dtype=torch.float64) / C**0.5 + torch.eye(C, dtype=torch.float64)
        X = torch.randn(4 * C, C, generator=g, dtype=torch.float64) @ mix * torch.linspace(0.1, 4.0, C, dtype=torch.float64)
        out[gr.key] = X.T @ X
    return out


@pytest.mark.parametrize("codec", ["q4", "q8"])
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_group_error_at_most_rtn_and_blocks_decode_to_the_layer(tmp_path, codec, method):
    m, _ = model_and_data(tmp_path)
    model = load_model(m)
    layer = model.layers[0]
    W0 = {n: p.detach().clone() for n, p in layer.named_parameters()}
    grams = _correlated_grams(layer)
    r = quantize_layer(layer, grams, codec, method, block=32)
    _check_layer(layer, W0, grams, r, method, codecs.get(codec))
    for row in r.rows:
        assert row["method"] in ("gptq", "awq")
    if method == "gptq":  # nothing but the matrices moved
        for n, p in layer.named_parameters():
            if p.ndim == 1:
                assert torch.equal(p, W0[n]), n


def _requantized_in_memory(m, grams, s, down8):
    """The model at `m` quantized in memory as `requantize` with `s` does, from the same Grams: each layer by
    quantize_layer (the down_proj of the layers in `down8` in q8), the embedding round-to-nearest in q8 (a
    4-bit file's rule)."""
    model = load_model(m)
    for i, layer in enumerate(model.layers):
        quantize_layer(layer, grams[i], "q4", s.method, block=s.block, damp=s.damp, act_order=s.act_order,
                       awq_grid=s.awq_grid, codec_of={"down_in": "q8"} if i in down8 else None)
    with torch.no_grad():
        e = model.model.embed_tokens.weight
        e.copy_(codecs.get("q8").roundtrip(e))
    return model


def test_awq_file_computes_what_the_quantized_model_computed(tmp_path):
    m, td = model_and_data(tmp_path)
    s = QuantSettings(method="awq", act_order=False, **S)  # on this tiny model only then does a scale win
    r = requantize(m, td, "q4", s, tmp_path / "work", progress=False, log=lambda _: None)
    f = open_cmf(r["path"])
    rep = r["quantize"]["report"]
    assert any(g["method"] == "awq" for g in rep["groups"]), "no group took a scale: the test shows nothing"
    assert rep["metrics"]["quant_err"] < rep["metrics"]["quant_err_rtn"]
    # re-run the quantization in memory from the same Grams: the file holds those weights and folded norms
    n = len(load_model(m).layers)
    down8 = more_bits(n, s.down_8bit)  # the default: some layers' down_proj at q8
    assert down8 and len(down8) < n, "the test shows q4 and q8 down_projs side by side"
    model = _requantized_in_memory(m, read_grams(r["grams"]["path"]), s, down8)
    back = load_model(r["path"])
    for n, p in back.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n
    assert {f.info(n).codec for n in f.names if n.startswith("model.layers.") and n.endswith("proj.weight")
            and not (n.endswith("down_proj.weight") and int(n.split(".")[2]) in down8)} == {"q4"}
    assert {f.info(f"model.layers.{i}.mlp.down_proj.weight").codec for i in down8} == {"q8"}
    ids = torch.randint(0, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(back(ids), model(ids), atol=1e-5)


def test_more_bits_layers():
    # 30 layers: the first four (i < 3.75), the last three (i >= 26.25), and every third between from 5
    assert more_bits(30, "ends") == {0, 1, 2, 3, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    assert more_bits(8, "ends") == {0, 3, 6, 7} and more_bits(5, "all") == set(range(5)) and more_bits(30, "none") == set()
    with pytest.raises(ValueError, match="down_8bit 'half'"):
        more_bits(30, "half")


def test_down_8bit_writes_those_down_projs_in_q8_as_the_layers_computed(tmp_path):
    m, td = model_and_data(tmp_path)
    s = QuantSettings(method="gptq", down_8bit="all", **S)
    r = requantize(m, td, "q4", s, tmp_path / "work", progress=False, log=lambda _: None)
    f = open_cmf(r["path"])
    codec_of = {n: f.info(n).codec for n in f.names if n.startswith("model.layers.") and n.endswith("proj.weight")}
    assert {c for n, c in codec_of.items() if "down_proj" in n} == {"q8"}
    assert {c for n, c in codec_of.items() if "down_proj" not in n} == {"q4"}
    model = _requantized_in_memory(m, read_grams(r["grams"]["path"]), s, more_bits(2, "all"))
    back = dict(load_model(r["path"]).named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, back[n]), n
    # the same model with every down_proj in q4: smaller by exactly those tensors' bytes
    r4 = requantize(m, td, "q4", QuantSettings(method="gptq", down_8bit="none", **S), tmp_path / "work", progress=False, log=lambda _: None)
    f4 = open_cmf(r4["path"])
    downs = [n for n in codec_of if "down_proj" in n]
    q8, q4 = codecs.get("q8"), codecs.get("q4")
    assert f.nbytes() - f4.nbytes() == sum(q8.nbytes(f.info(n).shape) - q4.nbytes(f.info(n).shape) for n in downs)


def test_recode_gptq_reuses_the_cached_grams(tmp_path, monkeypatch, capsys):
    import cortiq.quant.stages as quant

    m, td = model_and_data(tmp_path)
    argv = ["--codec", "q4", "--data", str(td), "--method", "gptq", "--work", str(tmp_path / "work"),
            "--window", "64", "--max-windows", "8", "--device", "cpu"]
    assert main(["recode", str(m), str(tmp_path / "a.cmf"), *argv]) == 0
    a = open_cmf(tmp_path / "a.cmf")
    assert a.provenance["quantize"]["settings"]["method"] == "gptq"
    # the second run: no capture may run, and the quantize stage is made again from the cached Grams
    monkeypatch.setattr(quant, "capture", lambda *a, **k: pytest.fail("the Grams were captured again"))
    for p in (tmp_path / "work").glob("quantize-*"):
        p.unlink()
    capsys.readouterr()
    assert main(["recode", str(m), str(tmp_path / "b.cmf"), *argv]) == 0
    assert "qgrams.q4: reusing" in capsys.readouterr().err
    b = open_cmf(tmp_path / "b.cmf")
    for n in a.names:
        assert bytes(a.raw(n)) == bytes(b.raw(n)), n
    g = b.provenance["quantize"]["groups"]
    assert len(g) == 2 * 4 and sum(x["err"] for x in g) < sum(x["err_rtn"] for x in g)


def test_q8_rounds_to_nearest_unless_method_8bit_asks(tmp_path, monkeypatch):
    import cortiq.quant.stages as quant

    m, td = model_and_data(tmp_path)
    assert main(["recode", str(m), str(tmp_path / "plain.cmf"), "--codec", "q8"]) == 0
    assert "quantize" not in open_cmf(tmp_path / "plain.cmf").provenance
    # --data at the default: nothing it would calibrate, so it is refused rather than ignored
    real = quant.capture
    monkeypatch.setattr(quant, "capture", lambda *a, **k: pytest.fail("q8 took the Grams at the default"))
    argv = ["--codec", "q8", "--work", str(tmp_path / "work"), "--window", "64", "--max-windows", "8",
            "--device", "cpu"]
    assert main(["recode", str(m), str(tmp_path / "d.cmf"), "--data", str(td), *argv]) == 1
    assert not (tmp_path / "d.cmf").exists()
    # --method-8bit gptq: the Grams, and the provenance says so; q4 still takes --method
    monkeypatch.setattr(quant, "capture", real)
    assert main(["recode", str(m), str(tmp_path / "g.cmf"), "--data", str(td), "--method-8bit", "gptq", *argv]) == 0
    g = open_cmf(tmp_path / "g.cmf")
    assert g.provenance["quantize"]["settings"]["method_8bit"] == "gptq"
    assert {x["method"] for x in g.provenance["quantize"]["groups"]} == {"gptq"}
    assert QuantSettings(method="gptq").method_for("q4") == "gptq" and QuantSettings().method_for("q8") == "rtn"


@pytest.mark.parametrize("argv, line", [
    # calibration windows past the model's context
    (["--codec", "q4", "--data", "{td}", "--window", "100000"],
     "{m}: --window 100000 is past the model's context of {ctx} tokens (max_position_embeddings)"),
    # options that act only with another: refused, naming it, rather than ignored
    (["--codec", "q4", "--method", "awq"], "recode: --method acts only with --data (calibrated quantization)"),
    (["--codec", "q4", "--window", "64"], "recode: --window acts only with --data (calibrated quantization)"),
    (["--codec", "q4", "--no-act-order"], "recode: --act-order acts only with --data (calibrated quantization)"),
    (["--codec", "q4", "--work", "{td}"], "recode: --work acts only with --data (the calibration's cached stages)"),
    (["--codec", "f16", "--data", "{td}", "--method", "awq"],
     "recode: --data acts only with a codec GPTQ writes (q4, q4_64, q8), not --codec f16"),
    (["--codec", "q4", "--data", "{td}", "--method", "rtn"], "recode: --data acts only with --method gptq or awq "
                                                             "(rtn takes no data)"),
    (["--codec", "q8", "--data", "{td}", "--method-8bit", "awq", "--method", "gptq"],
     "recode: --method acts only with --codec q4 or q4_64 (--codec q8 takes --method-8bit)"),
    (["--codec", "q4", "--data", "{td}", "--method", "gptq", "--awq-grid", "5"],
     "recode: --awq-grid acts only with --method awq"),
    # q8 is symmetric already, f16 has no blocks: the grid would change nothing
    (["--codec", "q8", "--q4-grid", "symmetric"], "recode: --q4-grid acts only with --codec q4 or q4_64, not --codec q8"),
    (["--codec", "f16", "--q4-grid", "asymmetric"], "recode: --q4-grid acts only with --codec q4 or q4_64, not --codec f16"),
])
def test_recode_refuses_at_start(tmp_path, capsys, argv, line):
    from cortiq.cmf import open_cmf as open_

    m, td = model_and_data(tmp_path)
    before = m.read_bytes()
    names = {"m": m, "td": td, "ctx": open_(m).arch.max_position_embeddings}
    capsys.readouterr()
    assert main(["recode", str(m), str(tmp_path / "o.cmf"), *(a.format(**names) for a in argv)]) == 1
    assert capsys.readouterr().err == "cortiq: " + line.format(**names) + "\n"
    assert m.read_bytes() == before and not list(tmp_path.glob("o.cmf*"))
    assert not (tmp_path / "cortiq-home" / "work").exists()  # no stage ran


def test_bad_input_is_one_line(tmp_path, capsys):
    m, td = model_and_data(tmp_path)
    assert main(["recode", str(m), str(tmp_path / "o.cmf"), "--codec", "q4", "--data", str(tmp_path / "none")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "none" in err[0], err
    with pytest.raises(Exception, match="method awq with codec fp8"):
        quantize(m, tmp_path, "fp8", QuantSettings(**S), tmp_path / "o.cmf")


def test_awq_search_skips_scales_the_codec_cannot_store():
    """A channel of massive activations (its Gram diagonal 1e12 of the others', as real models have)
    stretches diag(G)^α so far that W·s leaves q4's f16 mins: the search must pass over those
    candidates, not fail on them."""
    from cortiq.quant.layers import F16_ROOM, search_alpha

    g = torch.Generator().manual_seed(0)
    W = torch.randn(8, 64, generator=g)
    X = torch.randn(256, 64, generator=g, dtype=torch.float64)
    X[:, 5] *= 1e6
    G = X.T @ X
    alpha, s = search_alpha(W, G, "q4", 11)
    assert torch.isfinite(s).all() and (W.double() * s).abs().max() < F16_ROOM
    assert alpha < 1.0  # the widest candidates were out of range here


def _symmetric(f, n) -> bool:
    return codecs.get(f.info(n).codec).symmetric_blocks(f.stored(n))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_symmetric_grid_lowers_the_gram_error_below_symmetric_rtn(tmp_path, method):
    """On the symmetric grid each group's GPTQ (or AWQ) error under its Gram is at most the symmetric
    round-to-nearest's, reported against that (not the asymmetric one), below it in sum, and every
    block written has min −8·scale and decodes to the layer's weights."""
    m, _ = model_and_data(tmp_path)
    layer = load_model(m).layers[0]
    W0 = {n: p.detach().clone() for n, p in layer.named_parameters()}
    grams = _correlated_grams(layer, seed=1)
    r = quantize_layer(layer, grams, "q4", method, block=32, act_order=True, q4_grid="symmetric")
    sym = codecs.encoder("q4", "symmetric")
    _check_layer(layer, W0, grams, r, method, sym)
    assert sum(x["err"] for x in r.rows) < 0.9 * sum(x["err_rtn"] for x in r.rows)
    assert all(sym.symmetric_blocks(st) for st in r.stored.values())


def test_every_method_writes_symmetric_q4_blocks_and_q8_as_before(tmp_path):
    m, td = model_and_data(tmp_path)
    assert main(["recode", str(m), str(tmp_path / "rtn.cmf"), "--codec", "q4", "--q4-grid", "symmetric"]) == 0
    asym = open_cmf(requantize(m, td, "q4", QuantSettings(method="gptq", **S), tmp_path / "work", progress=False,
                               log=lambda _: None)["path"])
    files = {"rtn": open_cmf(tmp_path / "rtn.cmf")}
    assert files["rtn"].provenance["recode"]["q4_grid"] == "symmetric"
    for method in ("gptq", "awq"):
        s = QuantSettings(method=method, q4_grid="symmetric", **S)
        files[method] = open_cmf(requantize(m, td, "q4", s, tmp_path / "work", progress=False, log=lambda _: None)["path"])
    for method, f in files.items():
        q4 = [n for n in f.names if f.info(n).codec == "q4"]
        # 7 matrices a layer, two layers; down_8bit "ends" keeps a down_proj of gptq's and awq's at q8
        assert len(q4) == 2 * 7 - (method != "rtn") and all(_symmetric(f, n) for n in q4), method
        for n in f.names:  # q8 (the embedding, the down_proj the default keeps at q8) is symmetric already
            if f.info(n).codec == "q8" and method != "awq":
                assert torch.equal(f.stored(n), asym.stored(n)), (method, n)
    assert not any(_symmetric(asym, n) for n in asym.names if asym.info(n).codec == "q4")


def test_the_grid_reaches_the_cache_keys_only_where_it_changes_the_output():
    from cortiq import runner
    from cortiq.measure import REENCODE
    from cortiq.quant import QGRAMS, QUANTIZE

    def d(x):  # an upstream output given by its digest
        return {"digest": x}

    for stage, params in ((QGRAMS, dict(model=d("1"), tdata=d("2"))), (QUANTIZE, dict(model=d("1"), grams=d("3")))):
        keys = {g: runner.digest_of(stage, codec="q4", settings=QuantSettings(q4_grid=g), **params)
                for g in ("asymmetric", "symmetric")}
        assert keys["asymmetric"] == runner.digest_of(stage, codec="q4", settings=QuantSettings(), **params)
        assert keys["symmetric"] != keys["asymmetric"], stage.name
    for codec in ("q4", "q4_64", "q8", "f16"):
        plain = runner.digest_of(REENCODE, model=d("1"), codec=codec)
        assert runner.digest_of(REENCODE, model=d("1"), codec=codec, q4_grid="asymmetric") == plain
        assert (runner.digest_of(REENCODE, model=d("1"), codec=codec, q4_grid="symmetric") != plain) == codec.startswith("q4")


def test_recode_on_the_symmetric_grid_keeps_symmetric_q4_and_regrids_the_rest(tmp_path):
    from cortiq.measure import recode

    m, _ = model_and_data(tmp_path)
    asym = open_cmf(recode(m, tmp_path / "a.cmf", "q4"))
    sym = open_cmf(recode(asym.path, tmp_path / "s.cmf", "q4", q4_grid="symmetric"))  # from q4 blocks with a min
    again = open_cmf(recode(sym.path, tmp_path / "s2.cmf", "q4", q4_grid="symmetric"))  # symmetric already
    for n in asym.names:
        if asym.info(n).codec == "q4":
            assert not _symmetric(asym, n) and _symmetric(sym, n), n
            assert torch.equal(again.stored(n), sym.stored(n)), n  # kept byte for byte, not rounded again
            want = codecs.encoder("q4", "symmetric").roundtrip(asym.tensor(n))
            assert torch.equal(sym.tensor(n), want), n  # the values it had, on the symmetric grid
        else:
            assert torch.equal(sym.stored(n), asym.stored(n)), n
