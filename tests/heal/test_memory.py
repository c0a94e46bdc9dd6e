"""The student step's memory savings: checkpointed layers give the plain
values and gradients (eager and compiled), micro-batches give the one-batch
step, 8-bit Adam moments train and resume, and `memory: auto` decides from the
estimate."""

import importlib.util
import re
import shutil
import sys

import pytest
import torch

from cortiq.errors import CortiqError
from cortiq.heal import memory as mem
from cortiq.heal.settings import MEMORY_PARTS, HealSettings
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


def _causal_tail(train_from=1, layers=3):
    from cortiq.model import CausalLM

    torch.manual_seed(0)
    model = CausalLM(arch(layers=layers))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return StudentTail(model, train_from, ffn_only=False, drop_prefix=False)


def _targets(V, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    tid = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n)])  # distinct ids per row
    tp = torch.rand(n, k, generator=g) * (torch.rand(n, 1, generator=g) > 0.2)  # some rows weigh nothing
    return tid, tp / tp.sum(1, keepdim=True).clamp_min(1e-9)


def _checkpointed_step(tail, ck, ids, tid, tp, chunk, cdt):
    """(loss, gradients, how many tensors the forward saved for the backward) with `ck` layers recomputed."""
    tail.checkpointed = ck
    _zero(tail)
    n = [0]

    def pack(t):
        n[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = batch_loss(tail, ids, None, tid, tp, chunk, CPU, cdt)
    loss.backward()
    return loss.detach(), _grads(tail), n[0]


@pytest.mark.parametrize("cdt", [torch.float32, torch.bfloat16])
def test_checkpointed_layers_give_the_plain_values_and_gradients(cdt):
    # 3 trained layers over a frozen one, 3 windows of 11 tokens, head chunks of 7 rows:
    # 0, 1, 2 and all 3 of the lowest trained layers recomputed in the backward
    tail = _causal_tail(train_from=1, layers=4)
    L = len(tail.params)
    B, T, k = 3, 11, 5
    V = tail.model.head_weight.shape[0]
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    tid, tp = _targets(V, B * T, k)
    out, saved = {}, {}
    for ck in range(L + 1):
        *out[ck], saved[ck] = _checkpointed_step(tail, ck, ids, tid, tp, 7, cdt)
    # each recomputed layer keeps its input instead of its activations: fewer saved with each
    assert all(saved[c] < saved[c - 1] - 5 for c in range(1, L + 1)), saved
    assert len(out[0][1]) == sum(len(ps) for ps in tail.params.values())
    for ck in range(1, L + 1):
        assert set(out[ck][1]) == set(out[0][1])
        torch.testing.assert_close(out[ck][0], out[0][0], rtol=0, atol=0)
        for n, g in out[0][1].items():
            torch.testing.assert_close(out[ck][1][n], g, rtol=1e-6, atol=1e-7, msg=f"{ck} layers: {n}")


@pytest.mark.parametrize("backend,cdt", [
    ("aot_eager", torch.float32),
    pytest.param("inductor", torch.bfloat16, marks=pytest.mark.skipif(
        shutil.which("g++") is None and shutil.which("c++") is None, reason="inductor on a CPU needs a C++ compiler"))])
def test_checkpointed_compiled_layers_give_the_plain_gradients(backend, cdt):
    # the layers' bodies compiled as compile_layers does, the checkpoint around them: fewer tensors
    # saved, and the gradients are the plain ones. Inductor under bf16 autocast is the case that
    # matters: with the checkpoint inside the compiled region instead (the module's call compiled),
    # its recompute gave gradients 22% off here on a CPU, ~8% off on an H200
    torch._dynamo.reset()
    tail = _causal_tail(train_from=1, layers=3)
    V = tail.model.head_weight.shape[0]
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    tid, tp = _targets(V, 2 * 16, 5)
    tail.model.compile_layers(backend=backend)
    out, saved = {}, {}
    for ck in (0, len(tail.params)):
        _, out[ck], saved[ck] = _checkpointed_step(tail, ck, ids, tid, tp, 7, cdt)
    plain, got = out[0], out[len(tail.params)]
    assert saved[len(tail.params)] < saved[0] - 5, saved
    assert set(got) == set(plain)
    for n, g in plain.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)
    torch._dynamo.reset()


def test_a_layer_that_cannot_recompute_is_refused():
    tail = StudentTail(ToyLM(seed=1), 1, ffn_only=False, drop_prefix=False)
    tail.model.layers[2] = torch.nn.Linear(16, 16)  # no `recompute`: it would keep its activations
    tail.checkpointed = 1  # layer 1 (a toy block) can
    with pytest.raises(CortiqError, match=r"^heal: Linear layers cannot recompute their activations; use memory "):
        tail.checkpointed = 2


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


def test_auto_under_a_device_budget_checkpoints_the_fewest_layers_and_trains_as_plain(tmp_path, capsys):
    # on a CPU a budget makes auto plan (without one it is plain): room for the step with
    # one of the three trained layers recomputed, not for the plain step
    tail, tr, va = _setup()
    plain = fit(tail, tr, va, _settings(memory="plain"), tmp_path / "a", CPU, torch.float32, progress=False)
    w_plain = tail.state()
    tail2, tr2, va2 = _setup()
    s = _settings()
    sh = mem.shape_of(tail2, s.batch, s.window, s.head_chunk, s.target_kind)
    there = sum(t.numel() * t.element_size() for t in tail2.model.parameters())
    ck = [mem.step_bytes(sh, ("checkpoint",), 1, k) for k in range(4)]
    assert ck[0] > ck[1] > ck[2]
    gb = (there + (ck[0] + ck[1]) / 2) / mem.GiB
    auto = fit(tail2, tr2, va2, _settings(device_mem_gb=gb), tmp_path / "b", CPU, torch.float32, progress=False)
    assert auto["memory"] == "checkpoint:1/3"
    assert "heal memory auto: checkpoint of the lowest 1 of 3 trained layers" in capsys.readouterr().err
    torch.testing.assert_close(torch.tensor([h["loss"] for h in auto["history"]]),
                               torch.tensor([h["loss"] for h in plain["history"]]), rtol=1e-5, atol=1e-6)
    for n, w in w_plain.items():
        torch.testing.assert_close(tail2.state()[n], w, rtol=1e-4, atol=1e-5, msg=n)
    # the same run named explicitly, 2 of the 3 layers
    tail3, tr3, va3 = _setup()
    rep = fit(tail3, tr3, va3, _settings(memory="checkpoint", checkpoint_layers=2), tmp_path / "c", CPU,
              torch.float32, progress=False)
    assert rep["memory"] == "checkpoint:2/3" and tail3.checkpointed == 2
    assert [h["loss"] for h in rep["history"]] == pytest.approx([h["loss"] for h in plain["history"]], rel=1e-5)


# ── auto: the estimate against the free memory or a budget ──

#: Qwen3-1.7B trained whole at 4 windows of 2048, head chunks of 8192 rows
QWEN17 = mem.StepShape(trained=1_409_000_000, tokens=8192, windows=4, hidden=2048, inter=6144, layers=28,
                       vocab=151936, chunk=8192)


def test_each_saving_lowers_the_estimate_and_lean_halves_it():
    plain = mem.step_bytes(QWEN17, (), 1)
    for part in MEMORY_PARTS:
        assert mem.step_bytes(QWEN17, (part,), 1) < plain, part
    assert mem.step_bytes(QWEN17, MEMORY_PARTS, 1) < plain / 2
    # micro-batches of all the windows are one batch
    assert mem.step_bytes(QWEN17, ("micro",), 4) == plain
    # k checkpointed layers: 0 is plain, all of them is what None means; each one lowers it until
    # the backward's recompute bounds it, then each adds its kept input (4 B a token and hidden unit)
    ck = [mem.step_bytes(QWEN17, ("checkpoint",), 1, k) for k in range(QWEN17.layers + 1)]
    assert ck[0] == plain and ck[-1] == mem.step_bytes(QWEN17, ("checkpoint",), 1)
    low = ck.index(min(ck))
    assert 20 < low < QWEN17.layers and all(b < a for a, b in zip(ck[: low + 1], ck[1 : low + 1]))
    assert all(b - a == 4 * QWEN17.tokens * QWEN17.hidden for a, b in zip(ck[low + 1 :], ck[low + 2 :]))
    assert mem.step_bytes(QWEN17, ("checkpoint",), 1, 99) == ck[-1]


def test_the_estimate_of_partial_checkpointing_is_its_two_moments():
    # a hand count of the forward's end and the lowest layer's recompute, in bytes
    sh = mem.StepShape(trained=1000, tokens=6, windows=2, hidden=4, inter=10, layers=5, vocab=7, chunk=4)
    full, kept, rows = 6 * (24 * 4 + 8 * 10), 6 * 4 * 4, 8 * 6 * 4
    head = 4 * 4 * 7 + 2 * 7 * 4 + rows
    for k in range(6):
        fwd = (5 - k) * full + k * kept + head
        bwd = 4000 + k * kept + (full if k else 0) + rows
        assert mem.step_bytes(sh, ("checkpoint",), 1, k) == 8000 + max(fwd, bwd), k
    # micro-batches of one window: half the tokens, and the first one's gradients held through the second
    assert mem.step_bytes(sh, ("micro",), 1) == 8000 + 4000 + 5 * 3 * (24 * 4 + 8 * 10) + (4 * 3 * 7 + 56 + 8 * 3 * 4)


def test_auto_is_plain_when_it_fits_else_the_fewest_checkpointed_layers_that_fit(capsys):
    need = mem.step_bytes(QWEN17, (), 1)
    L = QWEN17.layers
    assert mem.choose_memory("auto", None, QWEN17, 1, None, True) == mem.MemoryPlan((), 0, L)  # a CPU without a budget
    assert mem.choose_memory("auto", None, QWEN17, 1, need, True) == mem.MemoryPlan((), 0, L)
    assert "cortiq: heal memory auto: plain: its estimate" in capsys.readouterr().err
    ck = [mem.step_bytes(QWEN17, ("checkpoint",), 1, k) for k in range(L + 1)]
    low = ck.index(min(ck))  # past it more layers only add their inputs
    for k in (1, 9, low):
        assert mem.choose_memory("auto", None, QWEN17, 1, ck[k], True) == mem.MemoryPlan(("checkpoint",), k, L)
        if k < low:  # a byte less needs one layer more
            assert mem.choose_memory("auto", None, QWEN17, 1, ck[k] - 1, True) == mem.MemoryPlan(("checkpoint",), k + 1, L)
    err = capsys.readouterr().err
    assert f"checkpoint of the lowest 9 of {L} trained layers: plain's estimate" in err
    assert "expected 1.09x the plain step's time" in err
    # checkpoint_layers fixes how many under auto too: a plan that does not fit with them is not taken
    fixed = mem.choose_memory("auto", None, QWEN17, 1, mem.step_bytes(QWEN17, ("checkpoint",), 1, 20), True, layers=9)
    assert fixed.layers in (0, 9) and fixed != mem.MemoryPlan(("checkpoint",), 9, L)
    assert mem.choose_memory("auto", None, QWEN17, 1, mem.step_bytes(QWEN17, ("checkpoint",), 1, 9), True,
                      layers=9) == mem.MemoryPlan(("checkpoint",), 9, L)
    capsys.readouterr()
    # nothing fits: lean, all layers checkpointed, said so
    assert mem.choose_memory("auto", None, QWEN17, 1, 1, True) == mem.MemoryPlan(MEMORY_PARTS, L, L)
    assert "no plan's estimate fits" in capsys.readouterr().err
    assert mem.choose_memory("auto", None, QWEN17, 1, 1, False) == mem.MemoryPlan(("checkpoint", "micro"), L, L)
    assert "torchao does not load here" in capsys.readouterr().err
    # what the settings name is what runs, whatever the memory
    assert mem.choose_memory("adam8", ("adam8",), QWEN17, 1, 1, True) == mem.MemoryPlan(("adam8",), 0, L)
    assert mem.choose_memory("plain", (), QWEN17, 1, 1, True) == mem.MemoryPlan((), 0, L)
    assert mem.choose_memory("checkpoint", ("checkpoint",), QWEN17, 1, None, True) == mem.MemoryPlan(("checkpoint",), L, L)
    assert mem.choose_memory("checkpoint", ("checkpoint",), QWEN17, 1, 1, True, layers=5) == mem.MemoryPlan(("checkpoint",), 5, L)
    assert mem.choose_memory("lean", MEMORY_PARTS, QWEN17, 1, 1, True, layers=99) == mem.MemoryPlan(MEMORY_PARTS, L, L)
    assert capsys.readouterr().err == ""
    assert str(mem.MemoryPlan(("checkpoint", "micro"), 5, L)) == f"checkpoint:5/{L}+micro"
    assert str(mem.MemoryPlan(("checkpoint", "micro"), L, L)) == "checkpoint+micro" and str(mem.MemoryPlan((), 0, L)) == "plain"


def test_a_tighter_allowance_never_picks_a_cheaper_plan():
    import dataclasses

    L = QWEN17.layers
    for sh in (QWEN17, dataclasses.replace(QWEN17, chunk=1024), dataclasses.replace(QWEN17, head_entry=12)):
        plain = mem.step_bytes(sh, (), 1)
        lean = mem.step_bytes(sh, MEMORY_PARTS, 1, L)
        allows = torch.linspace(lean * 0.9, plain * 1.05, 400).tolist()
        for avail in (True, False):
            plans = [mem.choose_memory("auto", None, sh, 1, a, avail) for a in allows]
            costs = [p.cost() for p in plans]
            assert all(b <= a + 1e-12 for a, b in zip(costs, costs[1:])), (sh, avail)  # looser: never dearer
            for a, p in zip(allows, plans):
                if mem.step_bytes(sh, p.parts, 1, p.layers) <= a:
                    # no fitting plan costs less (every combination, every layer count)
                    for mask in range(8):
                        ps = tuple(x for i, x in enumerate(MEMORY_PARTS) if mask >> i & 1)
                        if "adam8" in ps and not avail:
                            continue
                        for k in (range(1, L + 1) if "checkpoint" in ps else (0,)):
                            q = mem.MemoryPlan(ps, k, L)
                            if mem.step_bytes(sh, ps, 1, k) <= a:
                                assert q.cost() >= p.cost() - 1e-12, (a, p, q)
                    if "checkpoint" in p and p.layers > 1:  # the fewest layers that fit
                        assert mem.step_bytes(sh, p.parts, 1, p.layers - 1) > a
            assert plans[0].parts == (MEMORY_PARTS if avail else ("checkpoint", "micro"))
            assert plans[-1] == mem.MemoryPlan((), 0, L)
            assert any(p.parts == ("checkpoint",) and 1 < p.layers < L for p in plans)


def test_torchao_is_asked_about_only_when_a_plan_with_8bit_moments_would_be_chosen(capsys):
    need = mem.step_bytes(QWEN17, (), 1)
    asked = []
    assert mem.choose_memory("auto", None, QWEN17, 1, 10 * need, lambda: asked.append(1) or True).parts == () and not asked
    ck = mem.step_bytes(QWEN17, ("checkpoint",), 1)
    assert mem.choose_memory("auto", None, QWEN17, 1, ck, lambda: asked.append(1) or True).parts == ("checkpoint",)
    assert not asked
    # below checkpoint of every layer: checkpoint + 8-bit moments costs less than checkpoint + micro-batches
    tight = mem.step_bytes(QWEN17, ("checkpoint", "adam8"), 1)
    assert mem.choose_memory("auto", None, QWEN17, 1, tight, lambda: asked.append(1) or True).parts == ("checkpoint", "adam8")
    assert asked == [1]
    got = mem.choose_memory("auto", None, QWEN17, 1, tight, lambda: asked.append(1) or False)
    assert "adam8" not in got and asked == [1, 1]
    assert "torchao does not load here" in capsys.readouterr().err


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
    assert HealSettings(memory="micro+checkpoint", checkpoint_layers=3).checkpoint_layers == 3
    assert HealSettings(checkpoint_layers=3).memory == "auto" and HealSettings(memory="lean", checkpoint_layers=1)
    for memory in ("plain", "micro+adam8"):
        with pytest.raises(CortiqError, match=rf"heal settings: checkpoint_layers 3 needs a memory plan with "
                                              rf"checkpoint \(auto, lean or one naming checkpoint\), not '{re.escape(memory)}'"):
            HealSettings(memory=memory, checkpoint_layers=3)
    with pytest.raises(CortiqError, match="checkpoint_layers -1 must be >= 0"):
        HealSettings(checkpoint_layers=-1)
    with pytest.raises(CortiqError, match="device_mem_gb -0.5 must be >= 0"):
        HealSettings(device_mem_gb=-0.5)


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
        tail.checkpointed = len(tail.params) if ck else 0
        _zero(tail)
        loss = batch_loss(tail, ids, None, tid, tp, 37, dev, torch.bfloat16)
        loss.backward()
        out[ck] = (loss.detach(), _grads(tail))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-3, atol=1e-3)
    for n, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], g, rtol=2e-2, atol=1e-4, msg=n)
