"""The student step's memory savings: checkpointed layers give the plain
values and gradients (eager and compiled), micro-batches give the one-batch
step, 8-bit Adam moments train and resume, and `memory: auto` decides from the
estimate."""

import importlib.util
import sys

import pytest
import torch

from cortiq.errors import CortiqError
from cortiq.heal import memory as mem
from cortiq.heal.settings import HealSettings
from cortiq.heal.train import StudentTail, batch_loss, fit, step_backward

from heal_models import arch
from heal_toy import ToyLM, toy_split

CPU = torch.device("cpu")
HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None


def _grads(tail):
    return {n: p.grad.detach().clone() for n, p in tail.named() if p.grad is not None}


def _zero(tail):
    for _, p in tail.named():
        p.grad = None


def _causal_tail(train_from=1):
    from cortiq.model import CausalLM

    torch.manual_seed(0)
    model = CausalLM(arch(layers=3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return StudentTail(model, train_from, ffn_only=False, drop_prefix=False)


def _targets(V, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    tid = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])  # distinct ids per row
    tp = torch.rand(n, k, generator=g) * (torch.rand(n, 1, generator=g) > 0.2)  # some rows weigh nothing
    return tid, tp / tp.sum(1, keepdim=True).clamp_min(1e-9)


@pytest.mark.parametrize("cdt", [torch.float32, torch.bfloat16])
def test_checkpointed_layers_give_the_plain_values_and_gradients(cdt):
    tail = _causal_tail()
    B, T, k = 3, 11, 5
    V = tail.model.head_weight.shape[0]
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    tid, tp = _targets(V, B * T, k)
    out, saved = {}, {}
    for ck in (False, True):
        tail.checkpoint = ck
        _zero(tail)
        n = [0]

        def pack(t, n=n):
            n[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = batch_loss(tail, ids, None, tid, tp, 7, CPU, cdt)
        loss.backward()
        out[ck], saved[ck] = (loss.detach(), _grads(tail)), n[0]
    assert saved[True] < saved[False] / 2  # the layers' activations were not kept
    assert len(out[True][1]) == sum(len(ps) for ps in tail.params.values())
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=0)
    for n, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], g, rtol=1e-6, atol=1e-7, msg=n)


def test_checkpointed_compiled_layers_give_the_plain_gradients():
    # the layers compiled (dynamo + AOT autograd, no C++ build) under the checkpoint's saved-tensor hooks
    torch._dynamo.reset()
    tail = StudentTail(ToyLM(hidden=16, seed=1), 1, ffn_only=False, drop_prefix=False)
    teacher = ToyLM(hidden=16, seed=0)
    data = toy_split(teacher, 4, 9, 4, 5, seed=2)
    ids, h0, tid, tp, tot = data.batch(0, CPU)
    _zero(tail)
    batch_loss(tail, ids, h0, tid, tp, 6, CPU, torch.float32).backward()
    plain = _grads(tail)
    for layer in tail.model.layers:
        layer.compile(backend="aot_eager", dynamic=False)
    tail.checkpoint = True
    _zero(tail)
    batch_loss(tail, ids, h0, tid, tp, 6, CPU, torch.float32).backward()
    got = _grads(tail)
    assert set(got) == set(plain)
    for n, g in plain.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()


@pytest.mark.parametrize("micro", [1, 3, 5])
def test_micro_batches_accumulate_the_one_batch_gradient(micro):
    # 5 windows whose row weights differ: each part must be scaled by the whole step's weight
    teacher, student = ToyLM(seed=0), ToyLM(seed=1)
    tail = StudentTail(student, 0, ffn_only=False, drop_prefix=False)
    data = toy_split(teacher, 5, 7, 5, 4, seed=4)
    batch = data.batch(0, CPU)
    loss1 = step_backward(tail, batch, 0, 6, CPU, torch.float32, None)
    one = _grads(tail)
    _zero(tail)
    lossm = step_backward(tail, batch, micro, 6, CPU, torch.float32, None)
    got = _grads(tail)
    torch.testing.assert_close(lossm, loss1, rtol=1e-6, atol=1e-7)
    ids, h0, tid, tp, tot = batch
    torch.testing.assert_close(loss1, batch_loss(tail, ids, h0, tid, tp, 6, CPU, torch.float32).detach() / tot)
    for n, g in one.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7, msg=n)


def _setup(hidden=16, train_from=0):
    teacher, student = ToyLM(hidden=hidden, seed=0), ToyLM(hidden=hidden, seed=1)
    tail = StudentTail(student, train_from, ffn_only=False, drop_prefix=False)
    return tail, toy_split(teacher, 24, 8, 4, 5, seed=2), toy_split(teacher, 6, 8, 4, 5, seed=3, train=False)


def _settings(**kw):
    base = dict(epochs=2.0, lr=3e-2, warm=0.1, batch=4, window=8, eval_every=3, checkpoint_every=4, topk=5)
    base.update(kw)
    return HealSettings(**base)


def test_a_lean_run_without_8bit_moments_trains_as_the_plain_one(tmp_path):
    tail, tr, va = _setup()
    plain = fit(tail, tr, va, _settings(memory="plain"), tmp_path / "a", CPU, torch.float32, progress=False)
    w_plain = tail.state()
    tail2, tr2, va2 = _setup()
    lean = fit(tail2, tr2, va2, _settings(memory="checkpoint+micro", micro_batch=3), tmp_path / "b", CPU,
               torch.float32, progress=False)
    assert (plain["memory"], lean["memory"]) == ("plain", "checkpoint+micro")
    torch.testing.assert_close(torch.tensor([h["loss"] for h in lean["history"]]),
                               torch.tensor([h["loss"] for h in plain["history"]]), rtol=1e-5, atol=1e-6)
    for n, w in w_plain.items():
        torch.testing.assert_close(tail2.state()[n], w, rtol=1e-4, atol=1e-5, msg=n)


# ── auto: the estimate against the free memory ──

#: Qwen3-1.7B trained whole at 4 windows of 2048, head chunks of 8192 rows
QWEN17 = mem.StepShape(trained=1_409_000_000, tokens=8192, windows=4, hidden=2048, inter=6144, layers=28,
                       vocab=151936, chunk=8192)


def test_each_saving_lowers_the_estimate_and_lean_halves_it():
    plain = mem.step_bytes(QWEN17, (), 1)
    for part in mem.LEAN:
        assert mem.step_bytes(QWEN17, (part,), 1) < plain, part
    assert mem.step_bytes(QWEN17, mem.LEAN, 1) < plain / 2
    # micro-batches of all the windows are one batch
    assert mem.step_bytes(QWEN17, ("micro",), 4) == plain


def test_auto_is_plain_when_it_fits_and_lean_when_not(capsys):
    need = mem.step_bytes(QWEN17, (), 1)
    assert mem.choose("auto", None, QWEN17, 1, None, True) == ()  # a CPU
    assert mem.choose("auto", None, QWEN17, 1, int(need / mem.FIT_SHARE) + 1, True) == ()
    assert mem.choose("auto", None, QWEN17, 1, int(need / mem.FIT_SHARE) - 1, True) == ("checkpoint", "micro", "adam8")
    assert capsys.readouterr().err == ""
    assert mem.choose("auto", None, QWEN17, 1, 20 << 30, False) == ("checkpoint", "micro")
    assert "torchao does not load here" in capsys.readouterr().err
    # torchao is asked about only when lean is chosen (importing it takes seconds)
    asked = []
    assert mem.choose("auto", None, QWEN17, 1, 10 * need, lambda: asked.append(1) or True) == () and not asked
    assert mem.choose("auto", None, QWEN17, 1, 1, lambda: asked.append(1) or True) == mem.LEAN and asked == [1]
    # what the settings name is what runs, whatever the memory
    assert mem.choose("adam8", ("adam8",), QWEN17, 1, 1, True) == ("adam8",)
    assert mem.choose("plain", (), QWEN17, 1, 1, True) == ()


def test_memory_settings_parse_and_refuse_unknown_names():
    assert HealSettings(memory="lean").memory_parts() == ("checkpoint", "micro", "adam8")
    assert HealSettings(memory="adam8+checkpoint").memory_parts() == ("checkpoint", "adam8")
    assert HealSettings(memory="plain").memory_parts() == ()
    assert HealSettings().memory_parts() is None
    assert HealSettings(batch=16).micro_windows() == 4 and HealSettings(batch=3, micro_batch=5).micro_windows() == 3
    with pytest.raises(CortiqError, match=r"heal settings: memory 'checkpoint\+fast' is not auto, plain, lean"):
        HealSettings(memory="checkpoint+fast")
    with pytest.raises(CortiqError, match="micro_batch -1 must be >= 0"):
        HealSettings(micro_batch=-1)


def test_8bit_moments_absent_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(CortiqError, match=r"memory adam8 needs torchao \(pip install 'cortiq\[lean\]'\)"):
        mem.make_optimizer([{"params": [torch.nn.Parameter(torch.zeros(3))]}], 1e-3, CPU, adam8=True)


# ── 8-bit Adam moments (torchao) ──

needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao (the lean extra) is not installed")


@needs_torchao
def test_8bit_moments_follow_adam():
    torch.manual_seed(0)
    w0 = torch.randn(64, 128)  # ≥ 4096 entries: quantized blockwise (smaller tensors keep f32 moments)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    lr = 1e-2
    oa = mem.make_optimizer([{"params": [a], "layer": 0}], lr, CPU, adam8=False)
    ob = mem.make_optimizer([{"params": [b], "layer": 0}], lr, CPU, adam8=True)
    assert ob.param_groups[0]["weight_decay"] == 0.0
    for i in range(4):
        g = torch.randn(64, 128, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        mem.set_lr(oa.param_groups[0], lr * (i + 1) / 4)
        mem.set_lr(ob.param_groups[0], lr * (i + 1) / 4)
        oa.step()
        ob.step()
    assert type(ob.state[b]["exp_avg"]).__name__ == "OptimState8bit"
    moved = (a - w0).abs()
    assert moved.mean() > 0.01  # it trained ...
    assert ((b - a).abs().mean() / moved.mean()) < 0.05  # ... as Adam did, within the moments' quantization


@needs_torchao
def test_a_killed_8bit_run_resumes_to_identical_weights(tmp_path):
    from test_train import _Kill, _KillAt

    s = _settings(memory="adam8", epochs=3.0)
    tail, tr, va = _setup(hidden=64)
    ref = fit(tail, tr, va, s, tmp_path / "a", CPU, torch.float32, key="k", progress=False)
    assert ref["memory"] == "adam8"
    ref_w = tail.state()
    tail2, tr2, va2 = _setup(hidden=64)
    with pytest.raises(_Kill):  # after step 9, past the checkpoint at step 8
        fit(tail2, tr2, va2, s, tmp_path / "b", CPU, torch.float32, key="k", logger=_KillAt(9), progress=False)
    ck = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert ck["optim_kind"] == "adam8"
    quantized = [v for st in ck["optim"]["state"].values() for v in st.values() if isinstance(v, dict)]
    assert quantized and all(type(t) is torch.Tensor for q in quantized for t in q["q8"].values())
    tail3, tr3, va3 = _setup(hidden=64)
    rep = fit(tail3, tr3, va3, s, tmp_path / "b", CPU, torch.float32, key="k", progress=False)
    for n, w in ref_w.items():
        assert torch.equal(w, tail3.state()[n]), n
    assert [h["loss"] for h in rep["history"]] == [h["loss"] for h in ref["history"]]


@needs_torchao
def test_a_resume_under_another_optimizer_restarts_only_the_moments(tmp_path, capsys):
    from test_train import _Kill, _KillAt

    tail, tr, va = _setup(hidden=64)
    with pytest.raises(_Kill):
        fit(tail, tr, va, _settings(memory="adam8"), tmp_path, CPU, torch.float32, key="k", logger=_KillAt(5),
            progress=False)
    tail2, tr2, va2 = _setup(hidden=64)
    rep = fit(tail2, tr2, va2, _settings(memory="plain"), tmp_path, CPU, torch.float32, key="k", progress=False)
    assert "adam8 moments do not fit this run's adam optimizer" in capsys.readouterr().err
    assert rep["metrics"]["steps"] == 12 and [h["step"] for h in rep["history"]] == list(range(1, 13))


# ── on the GPU: compiled (inductor) layers, bf16 autocast ──


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checkpointed_compiled_step_on_cuda_equals_the_plain_one():
    dev = torch.device("cuda")
    tail = _causal_tail(train_from=0)
    tail.model.to(dev).compile_layers()
    B, T, k = 2, 64, 8
    V = tail.model.head_weight.shape[0]
    ids = torch.randint(0, V, (B, T), device=dev)
    tid, tp = (t.to(dev) for t in _targets(V, B * T, k))
    out = {}
    for ck in (False, True):
        tail.checkpoint = ck
        _zero(tail)
        loss = batch_loss(tail, ids, None, tid, tp, 37, dev, torch.bfloat16)
        loss.backward()
        out[ck] = (loss.detach(), _grads(tail))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-3, atol=1e-3)
    for n, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], g, rtol=2e-2, atol=1e-4, msg=n)
