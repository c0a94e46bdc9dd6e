"""Gram capture: the Gram of the down_proj inputs, and several passes equal one."""

import pytest
import torch

from cortiq.compress.grams import capture_model_grams, plan_parts, room_bytes
from cortiq.errors import CortiqError

from compress_helpers import tiny_cmf


def _model(tmp_path, layers=3):
    from cortiq.model import load_model

    return load_model(tiny_cmf(tmp_path / "m.cmf", layers=layers))


def test_gram_is_the_sum_of_outer_products_of_the_mlp_activations(tmp_path):
    model = _model(tmp_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 259, (5, 13), generator=g)
    rows = torch.ones(5, 13, dtype=torch.bool)
    rows[4, 7:] = False  # padding rows do not count
    grams, count, passes = capture_model_grams(model, ids, rows, [0, 2], room=1 << 30, batch=2)
    assert passes == 1 and count == 5 * 13 - 6 and sorted(grams) == [0, 2]
    # the reference: the MLP activation recomputed from layer inputs
    with torch.no_grad():
        _, caught = model.forward_hidden(ids, capture=(1,))
        h = caught[1]  # input of layer 2
        layer = model.layers[2]
        x = layer.post_attention_layernorm(h + layer.self_attn(layer.input_layernorm(h), *model.rope(torch.arange(13))))
        a = torch.nn.functional.silu(layer.mlp.gate_proj(x)) * layer.mlp.up_proj(x)  # [5, 13, I]
        a = a[rows].double()
    assert torch.allclose(grams[2], a.T @ a, rtol=1e-5, atol=1e-6)


def test_multi_pass_equals_single_pass(tmp_path, monkeypatch):
    model = _model(tmp_path, layers=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 259, (7, 9), generator=g)
    rows = torch.ones(7, 9, dtype=torch.bool)
    one, n1, p1 = capture_model_grams(model, ids, rows, [0, 1, 2], room=room_bytes(), batch=3)
    # room for one 48×48 f64 accumulator: three passes, each resuming from the saved residual
    monkeypatch.setenv("CORTIQ_GRAM_ROOM_MB", str(8 * 48 * 48 * 1.5 / (1 << 20)))
    many, n3, p3 = capture_model_grams(model, ids, rows, [0, 1, 2], room=room_bytes(), batch=3)
    assert p1 == 1 and p3 == 3 and n1 == n3
    for l in range(3):
        assert torch.allclose(many[l], one[l], rtol=1e-5, atol=1e-5)


def test_plan_and_errors(tmp_path, monkeypatch):
    assert plan_parts({0: 10, 1: 10, 2: 10}, [2, 0, 1], 8 * 200) == [[0, 1], [2]]
    assert plan_parts({0: 10}, [0], 1) == [[0]]
    monkeypatch.setenv("CORTIQ_GRAM_ROOM_MB", "lots")
    with pytest.raises(CortiqError, match="CORTIQ_GRAM_ROOM_MB"):
        room_bytes()
    monkeypatch.delenv("CORTIQ_GRAM_ROOM_MB")
    model = _model(tmp_path, layers=2)
    with pytest.raises(CortiqError, match=r"layers \[5\] are not in 0..1"):
        capture_model_grams(model, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), [5], 1 << 20)
    with torch.no_grad():
        model.layers[1].mlp.up_proj.weight.zero_()
    with pytest.raises(CortiqError, match="layer 1: the captured activations are all zero"):
        capture_model_grams(model, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool), [1], 1 << 20)
