"""bench.quality.noise: the perturbed copy changes the MLP matrices alone, by noise of the asked scale,
and leaves the source as it was."""

import torch

from bench.common import tiny_cmf
from bench.quality.noise import perturbed
from cortiq.model import load_model


def test_noise_touches_the_mlp_matrices_alone_at_the_asked_scale(tmp_path):
    src = load_model(tiny_cmf(tmp_path / "m.cmf", layers=3, hidden=96, inter=200), dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in src.named_parameters()}
    m = perturbed(src, 0.1, seed=3)
    for n, p in m.named_parameters():
        assert torch.equal(dict(src.named_parameters())[n], before[n])  # the source is untouched
        d = p.detach() - before[n]
        if ".mlp." in n:
            ratio = float(d.std() / before[n].pow(2).mean().sqrt())
            assert abs(ratio - 0.1) < 0.01, (n, ratio)
        else:
            assert torch.equal(d, torch.zeros_like(d)), n
    # one seed draws alike twice, another seed differently
    again, other = perturbed(src, 0.1, seed=3), perturbed(src, 0.1, seed=4)
    w = lambda x: x.layers[1].mlp.up_proj.weight  # noqa: E731
    assert torch.equal(w(again), w(m)) and not torch.equal(w(other), w(m))
