"""Quantization-aware distillation: a fake-quantized linear computes exactly
dequantize(quantize(W)) @ x, its gradient is the plain gradient with respect to
the quantized weight (straight through), and a QAT heal writes the model its
held-out loss was measured on, in the codec."""

import pytest
import torch
import torch.nn.functional as F

from cortiq import codecs
from cortiq.cmf import open_cmf
from cortiq.heal import HealSettings, heal
from cortiq.heal.qat import attach, fake_quant
from cortiq.model import load_model

from heal_models import arch, perturbed, random_weights, save, tdata


@pytest.mark.parametrize("codec", ["q4", "q4_64", "q8"])
def test_fake_quant_forward_and_straight_through_gradient(codec):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 24, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(24, 64, generator=g) * torch.logspace(-2, 0, 64))
    x = torch.randn(5, 64, generator=g)
    c = codecs.get(codec)
    Wq = c.decode(c.encode(lin.weight.detach()), (24, 64)).requires_grad_(True)  # the plain reference
    ref = F.linear(x, Wq, lin.bias)

    class Holder(torch.nn.Module):  # attach walks model.layers
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Sequential(lin)])
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(3, 4)
            self.lm_head = None

    h = Holder()
    emb = h.model.embed_tokens.weight.detach().clone()
    assert attach(h, codec, [0]) == 1
    # the frozen embedding is rounded as the file stores it: q8 below 8 bits (cortiq.codecs.KEEP_8BIT)
    q8 = codecs.get("q8")
    assert torch.equal(h.model.embed_tokens.weight, q8.decode(q8.encode(emb), tuple(emb.shape)))
    out = lin(x)
    assert torch.equal(out, ref)
    up = torch.randn(out.shape, generator=g)
    (out * up).sum().backward()
    (ref * up).sum().backward()
    assert torch.equal(lin.weight.grad, Wq.grad)
    assert not torch.equal(fake_quant(lin.weight, codec), lin.weight)  # it does round


def test_qat_heal_scores_and_writes_the_quantized_model(tmp_path):
    a = arch()
    w = random_weights(a)
    teacher = save(tmp_path / "teacher.cmf", a, w)
    student = save(tmp_path / "student.cmf", a, perturbed(w))
    td = tdata(tmp_path, teacher)
    base = dict(window=32, batch=4, topk=8, ce=0.0, epochs=1.0, lr=3e-3, warm=0.05, eval_every=5, checkpoint_every=0,
                device="cpu")
    plain = heal(student, teacher, td, HealSettings(**base), tmp_path / "plain.cmf", progress=False)
    rep = heal(student, teacher, td, HealSettings(**base, qat_codec="q4"), tmp_path / "qat.cmf", progress=False)
    # the held-out loss before any step is the quantized student's, not the f32 one's
    assert rep["metrics"]["heldout_start"] != plain["metrics"]["heldout_start"]
    f = open_cmf(tmp_path / "qat.cmf")
    mats = [n for n in f.names if len(f.info(n).shape) == 2]
    head = [n for n in mats if n.startswith(("model.embed_tokens.", "lm_head."))]
    assert head and {f.info(n).codec for n in head} == {"q8"}  # the embedding and head of a 4-bit file
    assert {f.info(n).codec for n in mats if n not in head} == {"q4"}
    # the NLL reported for the healed model is the written file's
    from cortiq.measure import score

    assert score({"f": str(tmp_path / "qat.cmf")}, td, "test", "answer", "cpu", False)["f"] == \
        pytest.approx(rep["nll"]["healed"], abs=1e-6)
    m = load_model(tmp_path / "qat.cmf")
    assert torch.isfinite(m(torch.zeros(1, 8, dtype=torch.long))).all()
