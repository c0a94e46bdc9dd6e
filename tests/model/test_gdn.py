"""Gated DeltaNet: the chunked form (and fla on CUDA) against the plain recurrence."""

import pytest
import torch

from cortiq.model.gdn import gated_delta_rule_chunked, gated_delta_rule_ref, l2norm


def _inputs(B, T, H, Dk, Dv, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, T, H, Dk, generator=g, dtype=dtype))
    k = l2norm(torch.randn(B, T, H, Dk, generator=g, dtype=dtype))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    # log decays over a realistic range (some near 0, some strong) and β in (0, 1)
    gl = -torch.rand(B, T, H, generator=g, dtype=dtype) * 2.0
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    s0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=dtype) * 0.3
    return [x.requires_grad_() for x in (q, k, v, gl, beta, s0)]


@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (100, 64), (100, 16), (64, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_matches_recurrence_values_and_grads(T, chunk, with_state):
    xs = _inputs(2, T, 3, 8, 5, seed=T + chunk)
    q, k, v, g, beta, s0 = xs
    init = s0 if with_state else None
    o_ref, s_ref = gated_delta_rule_ref(q, k, v, g, beta, init)
    o_ch, s_ch = gated_delta_rule_chunked(q, k, v, g, beta, chunk=chunk, initial_state=init)
    # the kernels compute in f32; compare at f32 precision
    assert torch.allclose(o_ch.double(), o_ref.double(), atol=1e-5, rtol=1e-4)
    assert torch.allclose(s_ch.double(), s_ref.double(), atol=1e-5, rtol=1e-4)
    w_o = torch.randn_like(o_ref)
    w_s = torch.randn_like(s_ref)
    params = [q, k, v, g, beta] + ([s0] if with_state else [])
    gr = torch.autograd.grad((o_ref * w_o).sum() + (s_ref * w_s).sum(), params)
    gc = torch.autograd.grad((o_ch * w_o).sum() + (s_ch * w_s).sum(), params)
    for a, b in zip(gr, gc):
        assert torch.allclose(a.double(), b.double(), atol=1e-4, rtol=1e-3)


def test_chunked_in_pieces_equals_whole():
    # a state carried across calls (prefill then continuation) changes nothing
    q, k, v, g, beta, _ = (x.detach() for x in _inputs(1, 50, 2, 8, 8, seed=3))
    o, s = gated_delta_rule_chunked(q, k, v, g, beta, chunk=16)
    o1, s1 = gated_delta_rule_chunked(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], chunk=16)
    o2, s2 = gated_delta_rule_ref(q[:, 23:], k[:, 23:], v[:, 23:], g[:, 23:], beta[:, 23:], initial_state=s1)
    assert torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-5)
    assert torch.allclose(s2, s, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_kernel_matches_recurrence():
    from cortiq.model.gdn import _fla_kernel, gated_delta_rule

    if _fla_kernel() is None:
        pytest.skip("flash-linear-attention not importable")
    q, k, v, g, beta, s0 = (x.detach().float().cuda() for x in _inputs(2, 100, 4, 64, 64, seed=7))
    o_ref, s_ref = gated_delta_rule_ref(q, k, v, g, beta, s0)
    o, s = gated_delta_rule(q, k, v, g, beta, initial_state=s0)
    assert torch.allclose(o, o_ref, atol=2e-3, rtol=2e-3)
    assert torch.allclose(s, s_ref, atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_chunked_path_on_cuda_matches_the_reference_with_gradients():
    """Training on Hopper takes the torch chunked path (fla's backward is refused there): values and gradients."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the check is of the algorithm, in f32
    ins = [x.detach().float().cuda().requires_grad_() for x in _inputs(2, 77, 3, 32, 48, seed=11)]
    ref = [x.detach().clone().requires_grad_() for x in ins]
    o, s = gated_delta_rule_chunked(*ins[:5], chunk=32, initial_state=ins[5])
    o_r, s_r = gated_delta_rule_ref(*ref[:5], initial_state=ref[5])
    torch.testing.assert_close(o, o_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_r, rtol=1e-4, atol=1e-4)
    (o.square().sum() + s.sum()).backward()
    (o_r.square().sum() + s_r.sum()).backward()
    for a, b in zip(ins, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-3, atol=1e-3)
