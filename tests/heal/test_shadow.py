"""The moving average kept beside the trained weights (cortiq.heal.shadow): its multi-tensor update
equals its plain form, weight by weight, on tensors of awkward sizes, on the CPU and on CUDA."""

import pytest
import torch

from cortiq.heal.shadow import Average

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_average_s_update_equals_its_plain_form(device):
    g = torch.Generator().manual_seed(1)
    shapes = [(7, 13), (1,), (3, 5, 2), (257,)]
    named = [(str(i), torch.randn(*sh, generator=g).to(device)) for i, sh in enumerate(shapes)]
    fast, plain = Average(named, 0.9), Average([(n, w.clone()) for n, w in named], 0.9)
    for avg in (fast, plain):  # the same move of the weights after the averages took their start
        for w in avg.weights:
            w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(w.numel())).to(device))
    fast.update(30)
    plain.reference(30)
    for x, y, (_, w) in zip(fast.mean, plain.mean, named):
        torch.testing.assert_close(x, y)
        assert not torch.equal(x, w)  # a step toward the weights, not onto them
