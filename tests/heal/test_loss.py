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


@pytest.mark.parametrize("ahead", [False, True])
def test_under_autocast_every_head_product_runs_in_the_autocast_dtype(ahead):
    """Backward runs outside autocast: the fused loss must keep the forward's
    compute dtype there too (f32 master rows and head, bf16 products). With the
    gradient made ahead, the forward holds every product and the backward none."""
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
    fwd = Products()
    with fwd, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = topk_kl(hidden, w, ids, probs, chunk=8, grad_ahead=ahead)
    rec = Products()
    with rec:
        loss.backward()
    assert set(fwd.dtypes) == {torch.bfloat16}
    # per chunk of 8 of 37 rows: the logits, and ahead dL/dhidden and dL/dW too
    assert len(fwd.dtypes) == 5 * (3 if ahead else 1)
    assert (not rec.dtypes) if ahead else (rec.dtypes and set(rec.dtypes) == {torch.bfloat16})
    assert hidden.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    # the same loss and gradients as the reference on bf16-rounded inputs, to bf16 precision
    h2 = hidden.detach().bfloat16().float().requires_grad_()
    w2 = w.detach().bfloat16().float().requires_grad_()
    ref = topk_kl_reference(h2, w2, ids, probs)
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(w.grad, w2.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("need", ["hidden", "head", "both"])
@pytest.mark.parametrize("chunk", [1, 10, 37, 64])
def test_both_paths_match_the_reference_for_each_needed_gradient(ahead, need, chunk):
    hidden, w, ids, probs = _case(n=37, h=19, v=101, k=7, seed=3)
    # a "sampled" row lists an id more than once (a drawn id and unused slots, or two entries)
    ids[5, 4:] = ids[5, 3]
    ids[6, 1] = ids[6, 0]
    h1, w1 = hidden.clone().requires_grad_(need != "head"), w.clone().requires_grad_(need != "hidden")
    h2, w2 = hidden.clone().requires_grad_(need != "head"), w.clone().requires_grad_(need != "hidden")
    fast = topk_kl(h1, w1, ids, probs, chunk=chunk, grad_ahead=ahead)
    ref = topk_kl_reference(h2, w2, ids, probs)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    (fast * -0.7).backward()
    (ref * -0.7).backward()
    for a, b in ((h1, h2), (w1, w2)):
        assert (a.grad is None) == (b.grad is None)
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-10)


def test_no_gradient_is_made_under_no_grad():
    from cortiq.heal import loss as L

    hidden, w, ids, probs = _case()
    h = hidden.clone().requires_grad_()
    made = []
    real = L._chunk_terms

    def spy(z, ids_, p, mass, want_dz):
        made.append(want_dz)
        return real(z, ids_, p, mass, want_dz)

    L._chunk_terms = spy
    try:
        with torch.no_grad():
            v = topk_kl(h, w, ids, probs, chunk=10)
        topk_kl(h, w, ids, probs, chunk=10)
    finally:
        L._chunk_terms = real
    assert made == [False] * 4 + [True] * 4
    torch.testing.assert_close(v, topk_kl_reference(hidden, w, ids, probs))


def test_the_compiled_chunk_terms_trace_to_the_eager_ones():
    # what CUDA runs is `_chunk_terms` through dynamo and AOT autograd; here without code generation
    from cortiq.heal.loss import _chunk_terms, _compile_terms

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    z = (torch.randn(13, 97, generator=g) * 3).bfloat16()
    ids = torch.stack([torch.randperm(97, generator=g)[:6] for _ in range(13)])
    p = torch.rand(13, 6, generator=g)
    mass = p.sum(1)
    comp = _compile_terms(backend="aot_eager")
    for rows in (13, 7, 11):  # the second size runs the symbolic graph, the third reuses it
        args = (z[:rows], ids[:rows], p[:rows], mass[:rows], True)
        l1, d1 = comp(*args)
        l2, d2 = _chunk_terms(*args)
        torch.testing.assert_close(l1, l2)
        assert d1.dtype == torch.bfloat16
        torch.testing.assert_close(d1, d2)
    torch._dynamo.reset()


def test_the_compiled_chunk_terms_do_not_compile_again_for_each_chunk_size():
    # mtp heal's batches score different row counts, so the last chunk's size changes from batch to
    # batch: a graph per size recompiled ~1.6 s each until dynamo's limit (static shapes did)
    from torch._dynamo.testing import CompileCounter

    from cortiq.heal.loss import _compile_terms

    torch._dynamo.reset()
    count = CompileCounter()
    comp = _compile_terms(backend=count)
    g = torch.Generator().manual_seed(6)
    for rows in (64, 41, 23, 64, 9, 57, 30):
        z = torch.randn(rows, 50, generator=g)
        p = torch.rand(rows, 4, generator=g)
        comp(z, torch.randint(0, 50, (rows, 4), generator=g), p, p.sum(1), True)
    assert count.frame_count == 2  # the first size's static graph, then one symbolic in the rows
    torch._dynamo.reset()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_ahead_path_matches_the_recomputing_one():
    g = torch.Generator().manual_seed(7)
    n, h, v, k = 3001, 64, 5003, 32
    hidden = torch.randn(n, h, generator=g).cuda()
    w = (torch.randn(v, h, generator=g) * 0.2).cuda()
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)]).cuda()
    probs = torch.softmax(torch.randn(n, k, generator=g), -1).cuda()
    out = {}
    for ahead in (False, True):
        hh = hidden.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = topk_kl(hh, w, ids, probs, chunk=1000, grad_ahead=ahead)
        loss.backward()
        out[ahead] = (loss.detach(), hh.grad)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(out[True][1], out[False][1], rtol=2e-2, atol=1e-4)
