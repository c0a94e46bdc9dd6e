"""The device resolver every stage shares, the compress settings' device and
compute dtype, and the batched GPTQ against one layer at a time."""

import pytest
import torch

from cortiq import codecs
from cortiq.compress.gptq_solver import gptq_quantize, gptq_quantize_layers
from cortiq.compress.settings import CompressSettings
from cortiq.devices import resolve_compute, resolve_device
from cortiq.errors import CortiqError


def test_resolve_device_and_compute():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(CortiqError, match=r"^compress: device 'gpu0' is not a torch device$"):
        resolve_device("gpu0", "compress")
    if not torch.cuda.is_available():
        with pytest.raises(CortiqError, match="^heal settings: device 'cuda:1' asked for but CUDA is not available$"):
            resolve_device("cuda:1", "heal settings")
    else:
        n = torch.cuda.device_count()
        with pytest.raises(CortiqError, match=f"only {n} CUDA device"):
            resolve_device(f"cuda:{n}")
    assert resolve_compute("auto", torch.device("cpu")) == torch.float32
    assert resolve_compute("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_compute("f16", torch.device("cpu")) == torch.float16
    with pytest.raises(CortiqError, match="compute dtype 'f8'"):
        resolve_compute("f8", torch.device("cpu"))


def test_a_ranks_device_goes_through_the_shared_resolver():
    from cortiq.devices import rank_device

    for who in ("heal settings", "mtp settings"):
        assert rank_device("cpu", who) == torch.device("cpu")
        with pytest.raises(CortiqError, match=f"^{who}: device 'gpu0' is not a torch device$"):
            rank_device("gpu0", who)


def test_compress_settings_check_the_compute_dtype():
    assert CompressSettings().device == "auto"
    with pytest.raises(CortiqError, match="^compress settings: compute_dtype 'f16' is not one of auto, f32, bf16$"):
        CompressSettings(compute_dtype="f16")


def _stack(n=3, out=19, inp=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    Ws, Hs = [], []
    for _ in range(n):
        mix = torch.randn(inp, inp, generator=g) / inp**0.5 + torch.eye(inp)
        X = torch.randn(200, inp, generator=g) @ mix * torch.linspace(0.2, 3.0, inp)
        X[:, 7] = 0.0  # a dead input in every layer
        Ws.append(torch.randn(out, inp, generator=g) * 0.05)
        Hs.append((X.T @ X).double())
    return torch.stack(Ws), torch.stack(Hs)


@pytest.mark.parametrize("codec", ["q4", "q8", "q4_64"])
@pytest.mark.parametrize("act_order", [False, True])
def test_stacked_layers_equal_one_layer_at_a_time(codec, act_order):
    W, H = _stack()
    H[1] *= 50.0  # layers of different scales share the loop
    many = gptq_quantize_layers(W, H, codec, block=64, act_order=act_order)
    c = codecs.get(codec)
    for l in range(len(W)):
        one = gptq_quantize(W[l], H[l], codec, block=64, act_order=act_order)
        assert many[l].method == one.method == "gptq"
        assert torch.equal(many[l].stored, one.stored)
        assert torch.equal(many[l].weight, one.weight)
        assert many[l].damp == pytest.approx(one.damp, rel=1e-12)
        assert torch.equal(c.decode(many[l].stored, tuple(W[l].shape)), many[l].weight)


def test_stacked_rtn_fallback_and_errors():
    W = torch.randn(2, 4, 40)
    r = gptq_quantize_layers(W, torch.eye(40).expand(2, 40, 40), "q4")
    assert [x.method for x in r] == ["rtn", "rtn"]
    assert torch.equal(r[1].stored, codecs.get("q4").encode(W[1]))
    with pytest.raises(CortiqError, match="does not match"):
        gptq_quantize_layers(torch.randn(2, 4, 64), torch.eye(64).expand(3, 64, 64), "q4")
    H = torch.eye(64).repeat(2, 1, 1)
    H[1] = 0.0  # one layer never fired: the whole stack is refused, by name of the problem
    with pytest.raises(CortiqError, match="all zero"):
        gptq_quantize_layers(torch.randn(2, 4, 64), H, "q4")
