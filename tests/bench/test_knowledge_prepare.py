"""bench.quality.knowledge side by side: processes that share one cache make the source and the panel once
(the others wait and get the same, complete sets); each child gets the call's arguments less its own."""

import threading

import cortiq.data
from bench.quality.knowledge import prepare
from cortiq import store


def test_two_sharing_one_cache_build_each_panel_set_once(tmp_path, monkeypatch):
    built, real = [], cortiq.data.build

    def counting(src, model, out, settings):
        built.append(out.name)
        return real(src, model, out, settings)

    monkeypatch.setattr(cortiq.data, "build", counting)
    got, errors = [], []

    def run():
        try:
            got.append(prepare(tmp_path, None, tiny=True))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            errors.append(e)

    # flock locks are per open file: two threads contend as two processes do
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    (src_a, sets_a), (src_b, sets_b) = got
    assert src_a == src_b and sets_a == sets_b
    assert sorted(built) == sorted(p.name for p in sets_a.values())  # each set built once, by one of them
    assert all(store.is_complete(d) for d in sets_a.values())
    assert not list(tmp_path.glob("*.lock"))  # the lock let go


def test_each_child_gets_the_call_s_arguments_less_its_own():
    from bench.quality.knowledge import child_args

    argv = ["--gguf", "m.gguf", "--rows", "defaults,keep 0.5", "--out=o", "--jobs", "3", "--cache=c",
            "--facts-file", "x.tsv", "--cpu"]
    assert child_args(argv) == ["--gguf", "m.gguf", "--facts-file", "x.tsv", "--cpu"]


def test_a_child_that_fails_ends_the_run_with_its_status_and_log(tmp_path):
    import pytest

    from bench.quality.knowledge import side_by_side

    # an option the bench does not know: the child's argparse stops at once with exit 2 (one row: one child
    # of the two asked)
    with pytest.raises(SystemExit, match=r"job-0: exit 2: .*unrecognized arguments: --no-such-option"):
        side_by_side(["--no-such-option"], ["defaults"], 2, tmp_path / "cache", tmp_path / "out")
    assert not (tmp_path / "out" / "job-1").exists()


def test_a_bad_facts_file_is_one_line_before_any_work(tmp_path):
    import pytest

    from bench.quality.knowledge import main

    bad = tmp_path / "facts.tsv"
    bad.write_text("capital\tThe capital of France is\n")
    with pytest.raises(SystemExit, match=r"--facts-file: .*facts.tsv:1: a fact is three tab-separated fields"):
        main(["--cpu", "--tiny", "--out", str(tmp_path / "out"), "--facts-file", str(bad)])
    assert not (tmp_path / "out").exists()


def test_the_children_share_the_cores_out(tmp_path, monkeypatch):
    import subprocess

    import pytest

    from bench.quality.knowledge import side_by_side

    envs = []

    class Child:  # a child that records its environment and fails at once
        def __init__(self, cmd, env, **kw):
            envs.append(env)

        def wait(self):
            return 1

        def poll(self):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Child)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    with pytest.raises(SystemExit, match="exit 1"):
        side_by_side([], ["defaults", "keep 0.5", "keep 0.9"], 4, tmp_path / "cache", tmp_path / "out")
    assert len(envs) == 3  # three rows: three children of the four asked, 16 cores at 5 threads each
    assert {(e["OMP_NUM_THREADS"], e["TORCHINDUCTOR_COMPILE_THREADS"]) for e in envs} == {("5", "5")}
