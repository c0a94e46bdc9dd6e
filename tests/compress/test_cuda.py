"""The compress stages on CUDA against the same stages on the CPU (tiny model).

The CPU path is the reference (it is what the other compress tests pin down).
On CUDA in f32 the stages must agree with it to rounding; under bf16
autocast (the CUDA default) the masks may take a slightly different path,
so what must agree is what the fold uses: the kept neurons.
"""

import pytest
import torch

from cortiq.cmf import open_cmf
from cortiq.compress import capture_grams, fold, gptq, learn_masks, read_grams, read_masks
from cortiq.compress.folding import select_kept
from cortiq.compress.settings import FoldSettings, GptqSettings, GramSettings, MaskSettings

from compress_helpers import tiny_cmf, tiny_tdata

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: the data objective: on a tiny random model the teacher objective's KL stays near zero for the few steps
#: here, every gate moves by the L1 term alone and the kept sets are ties (the teacher row below compares values)
MASK = dict(keep_frac=0.75, lr=0.1, l1_init=1.0, l1_step=1.0, eval_every=5, max_steps=150, settle=1, window=64, batch=2,
            objective="data")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda")
    m = tiny_cmf(d / "m.cmf", width=64)
    return m, tiny_tdata(m, d / "td"), d


def _kept_overlap(a, b, keep=0.75):
    ka, kb = select_kept(a, keep), select_kept(b, keep)
    same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(ka, kb))
    return same / sum(len(x) for x in ka)


def test_masks_on_cuda_keep_the_neurons_the_cpu_keeps(tiny):
    m, td, d = tiny
    out = {}
    for label, dev, cdt in (("cpu", "cpu", "f32"), ("f32", "cuda", "f32"), ("bf16", "cuda", "bf16")):
        rep = learn_masks(m, td, MaskSettings(**MASK), d / f"masks-{label}", device=dev, compute_dtype=cdt)
        assert rep["device"].startswith(dev) and rep["compute_dtype"] == {"f32": "float32", "bf16": "bfloat16"}[cdt]
        out[label] = (read_masks(d / f"masks-{label}")[0], rep["metrics"])
    (cpu, mc), (f32, m32), (bf, mbf) = out["cpu"], out["f32"], out["bf16"]
    assert m32["mask_nll_open"] == pytest.approx(mc["mask_nll_open"], rel=1e-5)
    assert mbf["mask_nll_open"] == pytest.approx(mc["mask_nll_open"], rel=2e-2)
    assert _kept_overlap(cpu, f32) >= 0.97
    assert _kept_overlap(cpu, bf) >= 0.85
    assert mbf["mask_pruned"] >= 0.25 and m32["mask_pruned"] >= 0.25


def test_teacher_masks_on_cuda_equal_the_cpu_in_f32(tiny):
    m, td, d = tiny
    gates = {}
    for dev in ("cpu", "cuda"):
        learn_masks(m, td, MaskSettings(**{**MASK, "objective": "teacher"}), d / f"tmasks-{dev}", device=dev,
                    compute_dtype="f32")
        gates[dev] = read_masks(d / f"tmasks-{dev}")[0]
    assert len(gates["cpu"]) == len(gates["cuda"])
    for a, b in zip(gates["cpu"], gates["cuda"]):
        torch.testing.assert_close(b.cpu(), a, rtol=1e-4, atol=1e-5)


def test_grams_repair_and_gptq_on_cuda_match_the_cpu(tiny):
    m, td, d = tiny
    gs = GramSettings(window=64, batch=2)
    reps = {}
    for label, dev, cdt in (("cpu", "cpu", "f32"), ("f32", "cuda", "f32"), ("bf16", "cuda", "bf16")):
        reps[label] = capture_grams(m, td, None, gs, d / f"grams-{label}", device=dev, compute_dtype=cdt)
        assert reps[label]["device"].startswith(dev)
    cpu, n = read_grams(d / "grams-cpu")
    for label, tol in (("f32", 1e-5), ("bf16", 3e-2)):
        got, n2 = read_grams(d / f"grams-{label}")
        assert n2 == n and sorted(got) == sorted(cpu)
        for l in cpu:
            assert got[l].dtype == torch.float64
            rel = float((got[l] - cpu[l]).norm() / cpu[l].norm())
            assert rel < tol, (label, l, rel)
    # the fold's least squares: the same Grams, solved on either device
    fs = FoldSettings(keep_frac=0.5, repair=True)
    for dev in ("cpu", "cuda"):
        fold(m, None, d / "grams-cpu", fs, d / f"s-{dev}.cmf", device=dev)
    a, b = open_cmf(d / "s-cpu.cmf"), open_cmf(d / "s-cuda.cmf")
    assert a.provenance["fold"]["kept"] == b.provenance["fold"]["kept"]
    for name in a.names:
        assert torch.allclose(a.tensor(name), b.tensor(name), rtol=1e-5, atol=1e-7), name
    # GPTQ of the folded student: the same codes but for rare rounding ties
    qs = GptqSettings(codec="q4", block=32)
    q = {dev: gptq(d / "s-cpu.cmf", d / "grams-cpu", qs, d / f"q-{dev}.cmf", device=dev) for dev in ("cpu", "cuda")}
    qa, qb = open_cmf(d / "q-cpu.cmf"), open_cmf(d / "q-cuda.cmf")
    for i in range(2):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        wa, wb = qa.tensor(name), qb.tensor(name)
        assert float((wa == wb).float().mean()) >= 0.995, name
    for ra, rb in zip(q["cpu"]["layers"], q["cuda"]["layers"]):
        assert rb["err_gptq"] == pytest.approx(ra["err_gptq"], rel=1e-2)
        assert rb["err_rtn"] == pytest.approx(ra["err_rtn"], rel=1e-9)
        assert rb["err_gptq"] < rb["err_rtn"]


@pytest.mark.parametrize("objective", ["data", "teacher"])
def test_graphed_mask_step_equals_the_eager_step(tiny, objective):
    from cortiq.compress.masks import learn_model_masks
    from cortiq.data import Tdata, windows
    from cortiq.model import load_model

    m, td, _ = tiny
    s = MaskSettings(**{**MASK, "max_steps": 40, "objective": objective})
    t = Tdata.open(td)
    train, val = windows(t, "train", s.window, loss_on=s.loss_on), windows(t, "val", s.window, loss_on=s.loss_on)
    for cdt in (torch.float32, torch.bfloat16):
        runs = {}
        for graph in (False, True):
            model = load_model(m, device="cuda")
            runs[graph] = learn_model_masks(model, train, val, s, compute=cdt, graph=graph)
            assert all(l.mlp.neuron_logits is None for l in model.layers)
        eager, graphed = runs[False], runs[True]
        assert graphed.nll_open == pytest.approx(eager.nll_open, rel=1e-5)
        assert [h["step"] for h in graphed.history] == [h["step"] for h in eager.history]
        for h, g in zip(eager.history, graphed.history):
            assert g["loss"] == pytest.approx(h["loss"], rel=1e-3)
        if cdt == torch.float32:
            for a, b in zip(eager.logits, graphed.logits):
                assert torch.allclose(a, b, atol=1e-3), float((a - b).abs().max())
        assert _kept_overlap([x.cpu() for x in eager.logits], [x.cpu() for x in graphed.logits]) >= 0.97
