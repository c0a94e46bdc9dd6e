"""The compress stages on a tiny model and tiny data, and the CLI."""

import json

import pytest
import torch

from cortiq import store
from cortiq.cmf import open_cmf
from cortiq.compress import capture_grams, compress, fold, gptq, learn_masks, read_masks
from cortiq.compress.settings import CompressSettings, FoldSettings, GptqSettings, GramSettings, MaskSettings
from cortiq.tracking import MemoryLogger

from compress_helpers import tiny_cmf, tiny_tdata

MASK = dict(keep_frac=0.75, lr=0.1, l1_init=1.0, l1_step=1.0, eval_every=5, max_steps=150, settle=1, window=64, batch=2)


@pytest.fixture
def tiny(tmp_path):
    m = tiny_cmf(tmp_path / "m.cmf", width=64)
    return m, tiny_tdata(m, tmp_path / "td")


@pytest.mark.parametrize("objective", ["teacher", "data"])
def test_learn_masks_reaches_the_target_and_reports_the_hard_nll(tiny, tmp_path, objective):
    m, td = tiny
    log = MemoryLogger()
    rep = learn_masks(m, td, MaskSettings(**MASK, objective=objective), tmp_path / "masks", log)
    met = rep["metrics"]
    assert rep["reached_target"] and met["mask_pruned"] >= 0.25
    if objective == "data":  # the LM loss of the data's next tokens, open and hard
        assert met["mask_nll_hard"] > 0 and met["mask_nll_open"] > 0
    else:  # the KL to the source: none with every gate open (the gated model is the source), some hard
        assert met["mask_nll_open"] == pytest.approx(0.0, abs=1e-5) and met["mask_nll_hard"] > 0
    logits, r2 = read_masks(tmp_path / "masks")
    assert [len(x) for x in logits] == [64, 64]
    pruned = float(torch.cat([(torch.sigmoid(x) <= 0.5).float() for x in logits]).mean())
    assert pruned == pytest.approx(met["mask_pruned"])
    assert r2["metrics"] == met and store.read_meta(tmp_path / "masks")["stage"] == "masks"
    # logged live at every evaluation: the selected checkpoint is the one evaluated at its step, and the
    # stage's closing metrics repeat what it selected
    # per evaluation under the history row's own name (the same name a reused output's history is replayed under)
    evals = dict(s for s in log.series("pruned") if s[0] is not None)
    assert evals and evals[int(met["mask_step"])] == pytest.approx(met["mask_pruned"])
    assert log.series("mask_pruned")[-1] == (None, met["mask_pruned"])


def test_fold_by_activation_with_repair_then_gptq(tiny, tmp_path):
    m, td = tiny
    gs = GramSettings(window=64, batch=2)
    grep = capture_grams(m, td, None, gs, tmp_path / "grams")
    assert grep["count"] > 0
    # the default scope (auto) ranks activation scores per layer: 32 of each 64-wide layer, whole
    # blocks of the q4 codec, so GPTQ runs on every one
    r = fold(m, None, tmp_path / "grams", FoldSettings(keep_frac=0.5, repair=True), tmp_path / "s.cmf")
    assert r["widths"] == [32, 32] and r["ranked_by"] == "activation" and r["scope"] == "per_layer"
    f = open_cmf(tmp_path / "s.cmf")
    assert f.arch.intermediate_sizes == [32, 32] and f.provenance["fold"]["repaired"]
    q = gptq(tmp_path / "s.cmf", tmp_path / "grams", GptqSettings(codec="q4", block=32), tmp_path / "q.cmf")
    assert all(row["method"] == "gptq" and row["err_gptq"] < row["err_rtn"] for row in q["layers"])
    fq = open_cmf(tmp_path / "q.cmf")
    assert fq.info("model.layers.0.mlp.down_proj.weight").codec == "q4"
    assert fq.info("model.layers.1.self_attn.q_proj.weight").codec == "q4"
    assert fq.info("model.embed_tokens.weight").codec == "f32"
    assert "fold" in fq.provenance and "gptq" in fq.provenance


def test_compress_chain_records_the_mask_run(tiny, tmp_path):
    from cortiq.model import load_model

    m, td = tiny
    s = CompressSettings(masks=MaskSettings(**MASK), fold=FoldSettings(keep_frac=0.75), grams=GramSettings(window=64))
    rep = compress(m, td, s, tmp_path / "s.cmf", work=tmp_path / "work", log=lambda _: None)
    f = open_cmf(tmp_path / "s.cmf")
    # the default scope, per layer: 48 of each layer's 64 kept, one width a runtime can carry
    assert list(f.arch.intermediate_sizes) == [48, 48]
    prov = f.provenance["fold"]
    assert prov["scope"] == "per_layer" and rep["metrics"]["fold_kept_share"] == 0.75
    assert prov["ranked_by"] == "mask" and prov["mask"]["pruned"] >= 0.25 and prov["mask"]["nll_hard"] > 0
    assert load_model(tmp_path / "s.cmf")(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 259)
    # a second run reuses the masks stage
    said = []
    compress(m, td, s, tmp_path / "s2.cmf", work=tmp_path / "work", log=said.append)
    assert any("reusing" in x for x in said)
    assert rep["metrics"]["mask_pruned"] >= 0.25


def test_cli_compress_and_its_errors(tiny, tmp_path, capsys):
    from cortiq.cli import main

    m, td = tiny
    rc = main(["compress", str(m), "--data", str(td), "--out", str(tmp_path / "s.cmf"), "--keep-frac", "0.5",
               "--no-learn-masks", "--grams-window", "64", "--fold-repair", "--use-gptq", "--gptq-codec", "q8",
               "--work", str(tmp_path / "w"), "--retain-sources", "none"])
    assert rc == 0  # (auto scope, activation score: per layer, widths of whole q8 blocks, so GPTQ beats RTN on each)
    said = capsys.readouterr()
    out = json.loads(said.out)
    assert out["fold_kept_share"] == pytest.approx(0.5) and out["gptq_over_rtn"] < 1.0
    w = open_cmf(tmp_path / "s.cmf").arch.intermediate_sizes[0]
    assert said.err.splitlines()[-1] == (f"uniform MLP widths ({w} of {open_cmf(m).arch.intermediate_sizes[0]}): smaller "
                                         "in every format: CMF, GGUF (llama.cpp) and Hugging Face (transformers, vLLM)")
    assert open_cmf(tmp_path / "s.cmf").info("model.layers.0.mlp.down_proj.weight").codec == "q8"
    assert not (tmp_path / "s.cmf.fold.cmf").exists()
    rc = main(["compress", str(m), "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "x.cmf")])
    assert rc == 1 and "nope" in capsys.readouterr().err
    assert not (tmp_path / "x.cmf").exists()
    rc = main(["compress", str(m), "--data", str(td), "--out", str(tmp_path / "x.cmf"), "--device", "gpu0"])
    assert rc == 1 and "compress: device 'gpu0' is not a torch device" in capsys.readouterr().err
    assert not (tmp_path / "x.cmf").exists()
