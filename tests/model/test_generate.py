"""Decoding: the cached paths equal the full forward; speculative equals greedy."""

import pytest
import torch

from cortiq.convert.hf import convert_hf_dir
from cortiq.errors import CortiqError
from cortiq.model import load_model
from cortiq.model.generate import generate, generate_speculative

from model_helpers import _perturb_norms, save_hf, tiny_llama, tiny_qwen3_next


def _model(tmp_path, hf):
    _perturb_norms(hf)
    return load_model(convert_hf_dir(save_hf(hf, tmp_path / "hf"), tmp_path / "m.cmf"))


def _greedy_full(model, prompt, n):
    """Greedy decoding without a cache: the whole sequence forward each step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def _with_mtp(model, seed=1):
    """A random MTP block (the tiny HF models carry none): speculative decoding
    must equal greedy whatever the draft proposes."""
    from cortiq.model.decoder import MTPBlock

    torch.manual_seed(seed)
    model.arch.mtp_layers = 1
    model.model.mtp = MTPBlock(model.arch).eval()
    return model


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_next])
def test_cached_decoding_equals_full_forward(tmp_path, make):
    m = _model(tmp_path, make())
    prompt = [5, 17, 200, 3, 99, 41, 7]
    got = generate(m, prompt, max_new=12).tokens
    assert got == _greedy_full(m, prompt, 12)


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_next])
@pytest.mark.parametrize("draft", [1, 3])
def test_speculative_equals_greedy(tmp_path, make, draft):
    m = _with_mtp(_model(tmp_path, make()))
    prompt = [5, 17, 200, 3, 99, 41, 7]
    greedy = generate(m, prompt, max_new=20).tokens
    spec = generate_speculative(m, prompt, max_new=20, draft=draft)
    assert spec.tokens == greedy
    assert spec.rounds >= 20 // (draft + 1)
    assert 0 <= spec.accepted <= spec.drafted == draft * spec.rounds


def test_speculative_accepts_every_right_draft(tmp_path):
    # zero final norms: every trunk and draft row has all-zero logits, so both
    # always say token 0 — each draft is right and must be accepted
    m = _with_mtp(_model(tmp_path, tiny_llama()))
    with torch.no_grad():
        m.model.norm.weight.zero_()
        m.mtp.norm.weight.zero_()
    spec = generate_speculative(m, [1, 2, 3], max_new=9, draft=2)
    assert spec.tokens == [0] * 9 == generate(m, [1, 2, 3], max_new=9).tokens
    assert spec.rounds == 3 and spec.accepted == spec.drafted == 6
    assert spec.accepted_per_round == 2.0


def test_speculative_without_mtp_is_a_clear_error(tmp_path):
    m = _model(tmp_path, tiny_llama())
    with pytest.raises(CortiqError, match="no"):
        generate_speculative(m, [1, 2], max_new=3)


def test_eos_stops_and_sampling_is_seeded(tmp_path):
    m = _model(tmp_path, tiny_llama())
    g = generate(m, [1, 2, 3], max_new=10).tokens
    stop = generate(m, [1, 2, 3], max_new=10, eos_ids=[g[2]]).tokens
    assert stop == g[: g.index(g[2]) + 1]
    a = generate(m, [1, 2, 3], max_new=10, temperature=1.0, seed=3).tokens
    b = generate(m, [1, 2, 3], max_new=10, temperature=1.0, seed=3).tokens
    assert a == b and len(a) == 10
