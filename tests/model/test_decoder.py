"""The model against transformers' own implementations, on tiny random models."""

import pytest
import torch
import torch.nn.functional as F

from cortiq.convert.hf import convert_hf_dir
from cortiq.model import export_model, load_model
from cortiq.cmf import open_cmf

from model_helpers import _perturb_norms, save_hf, tiny_llama, tiny_qwen3, tiny_qwen3_next


def _compare(hf, tmp_path, T=37):
    _perturb_norms(hf)
    src = save_hf(hf, tmp_path / "hf")
    cmf = convert_hf_dir(src, tmp_path / "m.cmf")
    m = load_model(cmf)
    ids = torch.randint(0, 259, (2, T))
    with torch.no_grad():
        ref = hf(ids).logits
        got = m(ids)
    assert got.shape == ref.shape
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, float(err)
    return m, ids, ref


@pytest.mark.parametrize("tie", [False, True])
def test_llama_matches_transformers(tmp_path, tie):
    _compare(tiny_llama(tie=tie), tmp_path)


def test_qwen3_matches_transformers(tmp_path):
    m, _, _ = _compare(tiny_qwen3(), tmp_path)
    assert m.arch.qk_norm and m.lm_head is None


def test_qwen3_next_matches_transformers(tmp_path):
    # T=70 > one 64-token GDN chunk
    m, _, _ = _compare(tiny_qwen3_next(), tmp_path, T=70)
    assert m.arch.layer_types == ["linear_attention", "full_attention"] * 2


def test_entry_points_agree_with_forward(tmp_path):
    m, ids, ref = _compare(tiny_llama(), tmp_path, T=20)
    with torch.no_grad():
        h, caught = m.forward_hidden(ids, capture=(0, 1))
        assert torch.allclose(m.logits(h), ref, rtol=1e-4, atol=1e-4)
        # layers 0..1 then 1..2 from layer 0's output reproduce the whole stack
        h0 = m.run_layers(m.embed(ids), 0, 1)
        assert torch.allclose(h0, caught[0], atol=1e-6)
        assert torch.allclose(m.model.norm(m.run_layers(h0, 1, 2)), h, atol=1e-5)
        tid, tp = m.topk_next(h, 5, chunk=7)  # a chunk that does not divide B·T
        lg = m.logits(h)
        top, idx = lg.topk(5, -1)
    assert torch.equal(tid, idx)
    assert torch.allclose(tp, torch.softmax(top, -1), atol=1e-6)
    assert torch.allclose(tp.sum(-1), torch.ones(2, 20))


def test_neuron_gates_and_export_roundtrip(tmp_path):
    m, ids, ref = _compare(tiny_llama(), tmp_path, T=9)
    m.set_neuron_gates(True, init=2.0)
    assert m.layers[0].mlp.neuron_logits.shape == (80,)
    with torch.no_grad():
        gated = m(ids)
        m.set_neuron_gates(True, init=40.0)  # σ(40) = 1: the ungated model
        assert torch.allclose(m(ids), ref, atol=1e-5)
    assert not torch.allclose(gated, ref, atol=1e-3)
    m.set_neuron_gates(False)
    # fold layer 0 to 50 neurons, export, reload: widths per layer survive
    with torch.no_grad():
        mlp = m.layers[0].mlp
        keep = torch.arange(50)
        mlp.gate_proj = torch.nn.Linear(48, 50, bias=False)
        mlp.up_proj = torch.nn.Linear(48, 50, bias=False)
        mlp.down_proj = torch.nn.Linear(50, 48, bias=False)
        folded = m(ids)
    out = export_model(m, open_cmf(tmp_path / "m.cmf"), tmp_path / "f.cmf", provenance_stage="fold", provenance={"keep": 50})
    f = open_cmf(out)
    assert f.arch.intermediate_sizes == [50, 80]
    assert f.provenance["fold"] == {"keep": 50} and "convert" in f.provenance
    m2 = load_model(out)
    with torch.no_grad():
        assert torch.equal(m2(ids), folded)
    del keep


def test_quantized_export_loads_dequantized(tmp_path):
    m, ids, ref = _compare(tiny_llama(), tmp_path, T=9)
    out = export_model(m, open_cmf(tmp_path / "m.cmf"), tmp_path / "q.cmf", codec="q8")
    f = open_cmf(out)
    assert f.info("model.layers.0.mlp.up_proj.weight").codec == "q8"
    assert f.info("model.norm.weight").codec == "f32"
    with torch.no_grad():
        q = load_model(out)(ids)
    assert (q - ref).abs().max() / ref.abs().max() < 0.05


def test_missing_tensor_is_a_clear_error(tmp_path):
    from cortiq.cmf import copy_specs, write_cmf
    from cortiq.errors import CortiqError

    _compare(tiny_llama(), tmp_path, T=4)
    src = open_cmf(tmp_path / "m.cmf")
    specs = [s for s in copy_specs(src) if s.name != "model.norm.weight"]
    write_cmf(tmp_path / "bad.cmf", src.doc, specs)
    with pytest.raises(CortiqError, match=r"bad.cmf: missing tensors \['model.norm.weight'\]"):
        load_model(tmp_path / "bad.cmf")


@pytest.mark.slow
def test_compiled_layers_match_eager_values_and_gradients(tmp_path):
    """compile_layers is the GPU fast path; eager is its reference (here on the CPU)."""
    m, ids, _ = _compare(tiny_qwen3(), tmp_path, T=13)
    eager = load_model(m.source)
    m.compile_layers()
    h_e, _ = eager.forward_hidden(ids)
    h_c, _ = m.forward_hidden(ids)
    assert torch.allclose(h_c, h_e, atol=1e-5, rtol=1e-5)
    h_e.square().sum().backward()
    h_c.square().sum().backward()
    for (n, pe), (_, pc) in zip(eager.named_parameters(), m.named_parameters()):
        assert torch.allclose(pc.grad, pe.grad, atol=1e-4, rtol=1e-4), n


def test_compiled_layers_of_many_widths_share_two_graphs_a_grad_mode():
    """A fold of global scope leaves every layer its own MLP width: the compiled bodies take
    the MLP weights as inputs, so the graphs do not grow with the widths (static shapes: one
    per width and grad mode, 10 here), and the values and gradients are eager's."""
    import types

    from torch._dynamo.testing import CompileCounterWithBackend

    from cortiq.arch import Arch
    from cortiq.model.decoder import _WeightsIn
    from tests.serve.serve_helpers import random_model

    a = Arch(arch_name="llama", vocab_size=259, hidden_size=32, num_layers=6, intermediate_sizes=[40, 56, 24, 72, 56, 88],
             num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=256)
    m, eager = random_model(a, seed=3), random_model(a, seed=3)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    m.compile_layers(backend=counter)
    assert all(isinstance(layer.compiled, _WeightsIn) for layer in m.layers)
    ids = torch.randint(0, 259, (2, 11))
    for model in (m, eager):
        h, _ = model.forward_hidden(ids)
        h.square().sum().backward()
        with torch.no_grad():
            model.forward_hidden(ids)
    h_c, h_e = m.forward_hidden(ids)[0], eager.forward_hidden(ids)[0]
    assert torch.allclose(h_c, h_e, atol=1e-6, rtol=1e-6)
    for (n, pe), (_, pc) in zip(eager.named_parameters(), m.named_parameters()):
        if pe.grad is not None:
            assert torch.allclose(pc.grad, pe.grad, atol=1e-5, rtol=1e-5), n
    assert counter.frame_count <= 4
    # a projection with a forward of its own (QAT's fake quantization) is called, not bypassed
    mlp = m.layers[0].mlp
    assert mlp.bare_linears()
    mlp.up_proj.forward = types.MethodType(lambda self, x: 2 * F.linear(x, self.weight), mlp.up_proj)
    assert not mlp.bare_linears()
    torch._dynamo.reset()
    m.compile_layers(backend="aot_eager")
    assert not isinstance(m.layers[0].compiled, _WeightsIn) and isinstance(m.layers[1].compiled, _WeightsIn)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_bf16_on_cuda_matches_f32_on_the_cpu(tmp_path):
    """The GPU path (compiled layers under bf16 autocast) against the f32 CPU model, to bf16 precision."""
    m, ids, ref = _compare(tiny_qwen3_next(), tmp_path, T=70)
    g = load_model(m.source, device="cuda").compile_layers()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        got = g(ids.cuda()).float().cpu()
    err = (got - ref).norm() / ref.norm()
    assert err < 2e-2, float(err)
