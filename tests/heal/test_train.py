"""The training loop on a toy decoder: it heals, resumes to identical weights,
the prefix cache changes nothing, Genesis and ffn_only train what they say."""

import pytest
import torch

from cortiq.errors import CortiqError
from cortiq.heal.settings import HealSettings
from cortiq.heal.train import StudentTail, fit

from heal_toy import KillAt as _KillAt, Killed as _Kill, ToyLM, toy_split

CPU = torch.device("cpu")


def _setup(train_from=0, ffn_only=False, drop=False, n_train=24, n_val=6, seed_student=1, prefix=False):
    teacher = ToyLM(seed=0)
    student = ToyLM(seed=seed_student)
    tail = StudentTail(student, train_from, ffn_only, drop_prefix=False)
    pre = (tail,) if prefix else None
    tr = toy_split(teacher, n_train, 8, 4, 5, seed=2, prefix_of=pre)
    va = toy_split(teacher, n_val, 8, 4, 5, seed=3, train=False, prefix_of=pre)
    if drop:
        tail = StudentTail(student, train_from, ffn_only, drop_prefix=True)
    return tail, tr, va


def _settings(**kw):
    base = dict(epochs=2.0, lr=3e-2, warm=0.1, batch=4, window=8, eval_every=3, checkpoint_every=4, topk=5)
    base.update(kw)
    return HealSettings(**base)


def test_training_lowers_heldout_kl_and_restores_the_best(tmp_path):
    tail, tr, va = _setup()
    rep = fit(tail, tr, va, _settings(), tmp_path, CPU, torch.float32, progress=False)
    m = rep["metrics"]
    assert m["steps"] == 12
    assert m["heldout_best"] < 0.8 * m["heldout_start"]
    best = min(e["heldout"] for e in rep["evals"])
    assert m["heldout_best"] == best
    assert m["best_step"] == next(e["step"] for e in rep["evals"] if e["heldout"] == best)


@pytest.mark.parametrize("genesis,average", [(False, 0.0), (True, 0.0), (False, 0.8)])
def test_killed_run_resumes_to_identical_weights(tmp_path, genesis, average):
    s = _settings(genesis=genesis, epochs=3.0, average=average)
    tail, tr, va = _setup()
    ref = fit(tail, tr, va, s, tmp_path / "a", CPU, torch.float32, key="k", progress=False)
    ref_w = tail.state()

    tail2, tr2, va2 = _setup()
    with pytest.raises(_Kill):  # killed after step 9, past the checkpoint at step 8 (and an epoch boundary at 6)
        fit(tail2, tr2, va2, s, tmp_path / "b", CPU, torch.float32, key="k", logger=_KillAt(9), progress=False)
    tail3, tr3, va3 = _setup()  # a new process: fresh student
    rep = fit(tail3, tr3, va3, s, tmp_path / "b", CPU, torch.float32, key="k", progress=False)
    for n, w in ref_w.items():
        assert torch.equal(w, tail3.state()[n]), n
    assert rep["metrics"]["best_step"] == ref["metrics"]["best_step"]
    assert [h["loss"] for h in rep["history"]] == [h["loss"] for h in ref["history"]]


class _Trajectory:
    """A logger that keeps the trained weights after each update (logged after the update)."""

    def __init__(self, tail):
        self.tail, self.states = tail, []

    def log_metrics(self, metrics, step=None):
        if "loss" in metrics:
            self.states.append(self.tail.state())

    def log_params(self, p):
        pass


def test_the_average_is_what_the_evaluations_score_and_the_heal_keeps(tmp_path):
    decay = 0.6
    runs = {}
    for average in (0.0, decay):
        tail, tr, va = _setup()
        start = tail.state()
        traj = _Trajectory(tail)
        rep = fit(tail, tr, va, _settings(average=average, eval_every=1, patience=0), tmp_path / str(average), CPU,
                  torch.float32, logger=traj, progress=False)
        runs[average] = (rep, traj.states, start, tail.state())
    (plain, plain_path, _, _), (avg, path, start, kept) = runs[0.0], runs[decay]
    # the average changes what is scored, never the training itself
    assert [h["loss"] for h in avg["history"]] == [h["loss"] for h in plain["history"]]
    for a, b in zip(path, plain_path):
        for n in a:
            assert torch.equal(a[n], b[n]), n
    # the kept weights: the average of the path at the best step, computed here from the weights after each update
    best = avg["metrics"]["best_step"]
    assert 0 < best and avg["evals"] != plain["evals"]
    mean = {n: w.clone() for n, w in start.items()}
    for done, state in enumerate(path[:best]):
        d = min(decay, (1 + done) / (10 + done))  # short at first: 0.1, 0.18, ...
        for n in mean:
            mean[n] = d * mean[n] + (1 - d) * state[n]
    for n, w in kept.items():
        torch.testing.assert_close(w, mean[n], rtol=1e-5, atol=1e-6, msg=n)


def test_stale_checkpoint_of_other_settings_is_ignored(tmp_path):
    tail, tr, va = _setup()
    fit(tail, tr, va, _settings(), tmp_path, CPU, torch.float32, key="one", progress=False)
    tail2, tr2, va2 = _setup()
    rep = fit(tail2, tr2, va2, _settings(), tmp_path, CPU, torch.float32, key="two", progress=False)
    assert len(rep["history"]) == 12  # started over


def test_prefix_cache_gives_the_same_losses(tmp_path):
    s = _settings(train_from=1)
    tail, tr, va = _setup(train_from=1)
    plain = fit(tail, tr, va, s, tmp_path / "a", CPU, torch.float32, progress=False)
    tail2, tr2, va2 = _setup(train_from=1, prefix=True, drop=True)
    assert tr2.h0 is not None
    cached = fit(tail2, tr2, va2, s, tmp_path / "b", CPU, torch.float32, progress=False)
    a = torch.tensor([h["loss"] for h in plain["history"]])
    b = torch.tensor([h["loss"] for h in cached["history"]])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor([e["heldout"] for e in plain["evals"]]),
                               torch.tensor([e["heldout"] for e in cached["evals"]]), rtol=1e-5, atol=1e-6)


def test_frozen_layers_and_ffn_only(tmp_path):
    tail, tr, va = _setup(train_from=1, ffn_only=True)
    before = {n: p.detach().clone() for n, p in tail.model.named_parameters()}
    fit(tail, tr, va, _settings(train_from=1, ffn_only=True, eval_every=100), tmp_path, CPU, torch.float32, progress=False)
    for n, p in tail.model.named_parameters():
        moved = not torch.equal(before[n], p.detach())
        assert moved == (n.startswith("model.layers.") and int(n.split(".")[2]) >= 1 and ".mlp." in n), n


def test_genesis_first_epoch_trains_only_the_top(tmp_path):
    # 3 layers: epoch 0 trains layer 2 only (ceil(12/64·3) = 1), epoch 1 layers 1..2 (ceil(24/64·3) = 2)
    tail, tr, va = _setup()
    before = tail.state()
    s = _settings(genesis=True, epochs=1.0, eval_every=100)
    fit(tail, tr, va, s, tmp_path, CPU, torch.float32, progress=False)
    after = tail.state()
    for n in before:
        assert torch.equal(before[n], after[n]) == (not n.startswith("model.layers.2.")), n


def test_non_finite_steps_abort_after_twenty(tmp_path):
    tail, tr, va = _setup()
    bad = tr.tprobs.parts[0]
    bad.setflags(write=True) if bad.flags.owndata else None
    tr.tprobs.parts[0] = bad.copy()
    tr.tprobs.parts[0][...] = float("nan")
    with pytest.raises(CortiqError, match="20 non-finite steps"):
        fit(tail, tr, va, _settings(epochs=10.0), tmp_path, CPU, torch.float32, progress=False)


def test_a_non_finite_step_skipped_on_the_device_equals_the_host_skip(tmp_path, monkeypatch):
    # window 0's targets are NaN: the step of its batch is skipped once an epoch. The fused Adam
    # is launched before the host reads the loss (found_inf skips it on the device); the host
    # path reads first and does not call it. Same weights, same Adam state, same steps
    from cortiq.heal import train as T

    def run(on_device: bool, sub: str):
        monkeypatch.setattr(T, "skips_on_device", lambda opt: on_device)
        tail, tr, va = _setup()
        part = tr.tprobs.parts[0].copy()
        part[0] = float("nan")
        tr.tprobs.parts[0] = part
        rep = fit(tail, tr, va, _settings(epochs=3.0), tmp_path / sub, CPU, torch.float32, key="k", progress=False)
        return rep, tail.state()

    dev, dev_w = run(True, "a")
    host, host_w = run(False, "b")
    # 18 updates; a skipped batch does not count, so the run reads a fourth epoch's batches too
    assert dev["metrics"]["skipped"] == host["metrics"]["skipped"] == 4
    assert dev["metrics"]["steps"] == host["metrics"]["steps"] == 18
    assert [(h["step"], h["loss"], h["lr"]) for h in dev["history"]] == \
        [(h["step"], h["loss"], h["lr"]) for h in host["history"]]
    for n, w in host_w.items():
        assert torch.equal(dev_w[n], w), n
    # the checkpoints' Adam state too: a step skipped on the device kept its step count
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["optim"]["state"]
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["optim"]["state"]
    for i in b:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a[i][k], b[i][k]), (i, k)


def test_f16_loss_scale_comes_off_the_gradients(tmp_path, monkeypatch):
    # f16 compute scales the loss by F16_SCALE and divides the gradients back: the gradient norms
    # and losses are the unscaled run's (a power of two scales exactly, bar f16 rounding)
    from cortiq.heal import train as T

    runs, big = {}, T.F16_SCALE
    assert big > 1
    for scale in (big, 1.0):
        monkeypatch.setattr(T, "F16_SCALE", scale)
        tail, tr, va = _setup()
        runs[scale] = fit(tail, tr, va, _settings(), tmp_path / str(scale), CPU, torch.float16, progress=False)
    a, b = runs[big]["history"], runs[1.0]["history"]
    assert len(a) == len(b) == 12 and runs[big]["metrics"]["skipped"] == 0
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([h[key] for h in a]), torch.tensor([h[key] for h in b]),
                                   rtol=2e-2, atol=1e-4, msg=key)


def test_fewer_train_windows_than_a_batch(tmp_path):
    tail, tr, va = _setup(n_train=3)
    with pytest.raises(CortiqError, match="fewer than one batch of 4"):
        fit(tail, tr, va, _settings(), tmp_path, CPU, torch.float32, progress=False)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_batch_fetched_ahead_equals_one_read_when_asked(device):
    from cortiq.heal.train import Ahead

    teacher = ToyLM(seed=0)
    tail = StudentTail(ToyLM(seed=1), 1, ffn_only=False, drop_prefix=False)
    data = toy_split(teacher, 12, 8, 4, 5, seed=2, prefix_of=(tail,))
    ahead = Ahead(data, device)
    for b in (2, 0, 1):  # prefetched, then asked for; then one asked for without a prefetch
        ahead.prefetch(b)
        got = ahead.get(b)
        want = data.batch(b, device)
        for x, y in zip(got, want):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    ahead.prefetch(2)
    assert len(ahead.get(1)) == 5 and ahead.pending is None  # a stale prefetch is dropped, not handed out
    ahead.close()


@pytest.mark.skipif(__import__("shutil").which("g++") is None and __import__("shutil").which("c++") is None,
                    reason="inductor on a CPU needs a C++ compiler")
def test_a_cached_prefix_heals_with_compiled_layers_as_eager(tmp_path):
    # the frozen-prefix heal (train_from > 0, the prefix's rows cached) with the decoder layers
    # compiled by inductor, as a CUDA heal runs it: the dropped prefix layers are placeholders that
    # never run, so compiling them must not be tried (it failed on `_Dropped._forward`); the
    # compiled run's losses are the eager run's
    from cortiq.heal.parallel import prepare
    from cortiq.model import CausalLM
    from heal_models import arch

    def setup():
        torch.manual_seed(0)
        teacher, student = CausalLM(arch(layers=3)), CausalLM(arch(layers=3))
        tail = StudentTail(student, 2, False, drop_prefix=False)
        tr = toy_split(teacher, 12, 8, 4, 5, seed=2, prefix_of=(tail,))
        va = toy_split(teacher, 4, 8, 4, 5, seed=3, train=False, prefix_of=(tail,))
        return StudentTail(student, 2, False, drop_prefix=True), tr, va

    s = _settings(train_from=2, epochs=1.0, eval_every=1)
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        tail, tr, va = setup()
        sharding = prepare(tail, s, CPU, torch.float32, compile=compiled)
        assert all(getattr(tail.model.layers[i], "compiled", None) is None for i in range(2))  # placeholders: not compiled
        assert all((tail.model.layers[i].compiled is not None) == compiled for i in range(2, 3))  # the trained layer
        runs[compiled] = fit(tail, tr, va, s, tmp_path / str(compiled), CPU, torch.float32, progress=False, sharding=sharding)
    torch._dynamo.reset()
    eager, comp = runs[False], runs[True]
    assert len(comp["history"]) == len(eager["history"]) == 3
    torch.testing.assert_close(torch.tensor([h["loss"] for h in comp["history"]]),
                               torch.tensor([h["loss"] for h in eager["history"]]), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor([e["heldout"] for e in comp["evals"]]),
                               torch.tensor([e["heldout"] for e in eager["evals"]]), rtol=1e-4, atol=1e-5)


def test_an_average_that_never_moves_is_refused():
    with pytest.raises(CortiqError, match=r"average.*1.*never moves the average off the student"):
        HealSettings(average=1.0)
