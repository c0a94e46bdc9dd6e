"""The fused chunked top-k KL against the plain full-logits computation: values and gradients."""

import pytest
import torch

from cortiq.heal.loss import topk_kl, topk_kl_reference


def _case(n=37, h=24, v=131, k=5, seed=0, zero_rows=(3, 17, 36)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.3
    # distinct ids per row, as a teacher's top-k
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    probs = torch.softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1)
    probs[:, -1] = 0.0  # a zero entry: 0·log 0 must be 0
    weight = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    weight[list(zero_rows)] = 0.0
    return hidden, w, ids, probs * weight[:, None]


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_values_and_gradients_match_reference(chunk):
    hidden, w, ids, probs = _case()
    h1, w1 = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), w.clone().requires_grad_()
    fast = topk_kl(h1, w1, ids, probs, chunk=chunk)
    ref = topk_kl_reference(h2, w2, ids, probs)
    torch.testing.assert_close(fast.double(), ref.double(), rtol=1e-6, atol=1e-6)
    (fast * 1.7).backward()
    (ref * 1.7).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_zero_weight_rows_contribute_nothing():
    hidden, w, ids, probs = _case()
    h = hidden.clone().requires_grad_()
    topk_kl(h, w, ids, probs, chunk=8).backward()
    assert torch.all(h.grad[[3, 17, 36]] == 0)
    assert torch.all(h.grad[[0, 1, 2]].abs().sum(1) > 0)


def test_one_hot_target_is_the_nll():
    hidden, w, ids, _ = _case(k=1, zero_rows=())
    fast = topk_kl(hidden, w, ids, torch.ones(ids.shape, dtype=torch.float64), chunk=10)
    nll = torch.nn.functional.cross_entropy(hidden @ w.t(), ids[:, 0], reduction="sum")
    torch.testing.assert_close(fast.double(), nll, rtol=1e-6, atol=1e-6)


def test_kl_is_zero_when_student_matches_a_full_target():
    # with k = V and p = the student's own softmax, the KL vanishes
    hidden, w, _, _ = _case(v=19, zero_rows=())
    p = torch.softmax(hidden @ w.t(), -1)
    ids = torch.arange(19).expand(hidden.shape[0], 19)
    assert abs(float(topk_kl(hidden, w, ids, p, chunk=7))) < 1e-9


def test_float32_only_head_gradient_skipped_when_frozen():
    hidden, w, ids, probs = _case()
    h = hidden.float().requires_grad_()
    out = topk_kl(h, w.float(), ids, probs.float(), chunk=9)
    out.backward()
    ref_h = hidden.float().requires_grad_()
    topk_kl_reference(ref_h, w.float(), ids, probs.float()).backward()
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-4, atol=1e-5)


def test_shape_mismatch_is_an_error():
    hidden, w, ids, probs = _case()
    with pytest.raises(ValueError):
        topk_kl(hidden, w, ids[:-1], probs[:-1])


def test_under_autocast_every_head_product_runs_in_the_autocast_dtype():
    """Backward runs outside autocast: the fused loss must keep the forward's
    compute dtype there too (f32 master rows and head, bf16 products)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.dtypes.append(args[-2].dtype)
            return func(*args, **(kwargs or {}))

    hidden, w, ids, probs = _case()
    hidden, w, probs = hidden.float().requires_grad_(), w.float().requires_grad_(), probs.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = topk_kl(hidden, w, ids, probs, chunk=8)
    rec = Products()
    with rec:
        loss.backward()
    assert rec.dtypes and set(rec.dtypes) == {torch.bfloat16}
    assert hidden.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    # the same loss and gradients as the reference on bf16-rounded inputs, to bf16 precision
    h2 = hidden.detach().bfloat16().float().requires_grad_()
    w2 = w.detach().bfloat16().float().requires_grad_()
    ref = topk_kl_reference(h2, w2, ids, probs)
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(w.grad, w2.grad, rtol=5e-2, atol=5e-2)
