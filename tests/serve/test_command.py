"""`cortiq serve` refuses bad input in one line, before it listens."""

import sys

import pytest

from cortiq.cli import main

from serve_helpers import arch, random_model


def test_missing_fastapi_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now raises ImportError
    assert main(["serve", str(tmp_path / "m.cmf")]) == 1
    assert capsys.readouterr().err == "cortiq: cortiq serve needs FastAPI and uvicorn: pip install 'cortiq[serve]'\n"


def test_bad_model_and_settings_are_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope.cmf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cortiq: ") and "nope.cmf" in err and err.count("\n") == 1
    assert main(["serve", str(tmp_path / "nope.cmf"), "--max-batch", "0"]) == 1
    assert capsys.readouterr().err == "cortiq: serve settings: max_batch 0 must be >= 1\n"


def test_speculative_needs_a_draft(tmp_path, capsys):
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    m = random_model(arch("llama", mtp=False))
    path = write_cmf(tmp_path / "nodraft.cmf", new_doc(m.arch, tokenizer_doc(byte_tokenizer_json(), [256])),
                     specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32"))
    assert main(["serve", str(path), "--speculative", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "has no MTP draft block" in err and err.count("\n") == 1


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_port_range(tmp_path, capsys, port):
    assert main(["serve", str(tmp_path / "m.cmf"), "--port", port]) == 1
    assert capsys.readouterr().err == f"cortiq: serve settings: port {port} is outside [0, 65535]\n"


@pytest.mark.parametrize("draft,branches", [(0, 1), (3, 1), (3, 4)])
def test_the_kv_estimate_is_what_the_engine_allocates(draft, branches):
    # serve refuses a cache larger than the device's free memory by this estimate, before allocating
    import torch

    from cortiq.commands.serve import kv_bytes
    from cortiq.serve.engine import DecodeAdapter

    m = random_model(arch("llama"))
    eng = DecodeAdapter(m, 3, 50, draft=draft, branches=branches).eng
    caches = [eng.k_cache, eng.v_cache] + ([eng.mtp_k_cache, eng.mtp_v_cache] if draft else [])
    assert kv_bytes(m.arch, 3, 50, draft, torch.float32, branches) == sum(c.numel() * c.element_size() for c in caches)


def test_draft_branches_auto_is_a_tree_where_one_runs():
    import torch

    from cortiq.serve.settings import ServeSettings

    attn, mixed = arch(), arch("hybrid")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    spec = ServeSettings(speculative=True)
    assert (spec.draft, spec.draft_branches, spec.spec_auto) == (3, 0, True)
    assert spec.branches(attn, cuda) == 4
    assert spec.branches(attn, cpu) == 1  # (a CPU's verify rows cost compute: the chain)
    assert spec.branches(mixed, cuda) == 1  # a Gated DeltaNet state holds one branch
    assert ServeSettings(speculative=True, engine="loop").branches(attn, cuda) == 1
    assert ServeSettings(speculative=True, draft_branches=3).branches(attn, cpu) == 3
    assert ServeSettings(draft_branches=3).branches(attn, cuda) == 1  # no --speculative: no draft at all


# ── start-up refusals: one line, exit status 1, the model's files untouched ──
def _sharded(tmp_path):
    """A tiny model written as several shards -> its files (the first one first)."""
    from cortiq.cmf import new_doc, open_cmf, specs_from_tensors, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    m = random_model(arch("llama"))
    specs = specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32")
    path = write_cmf(tmp_path / "m.cmf", new_doc(m.arch, tokenizer_doc(byte_tokenizer_json(), [256])), specs,
                     shard_bytes=40_000)
    return open_cmf(path).paths


NEEDS_LINE = "cortiq: serve: --{} acts only with --{}\n"
WHY_DRAFT = ("a round's drafts run one after another, and one is kept only where every draft before it was: a deeper "
             "round costs more than it can keep")
WHY_BRANCHES = ("a round verifies branches x draft + 1 rows a request, and the tree's masks grow with their square: "
                "more first guesses cost more than they keep")
#: the output rule's line (store.check_output), the one every writer of a file gives
OVERWRITE = "cortiq: {}: {}; give another output path\n"


@pytest.mark.parametrize("args, line", [
    (["--draft", "5"], NEEDS_LINE.format("draft", "speculative")),
    (["--draft", "3"], NEEDS_LINE.format("draft", "speculative")),  # named, even at its default
    (["--draft-branches", "2"], NEEDS_LINE.format("draft-branches", "speculative")),
    (["--draft-b", "0"], NEEDS_LINE.format("draft-branches", "speculative")),  # an abbreviation names it too
    (["--no-speculative", "--spec-auto"], NEEDS_LINE.format("spec-auto", "speculative")),
    (["--profile-steps", "4"], NEEDS_LINE.format("profile-steps", "profile")),
    (["--draft-vocab", "100"], NEEDS_LINE.format("draft-vocab", "speculative")),
    (["--speculative", "--draft-vocab", "100"], "cortiq: {m}: --draft-vocab 100 needs the draft's token ranking, which "
                                                "`cortiq mtp heal` writes; this model has none (heal its draft, or give "
                                                "--draft-vocab 0)\n"),
    (["--speculative", "--draft", "100000"], f"cortiq: serve settings: draft 100000 is outside [1, 16]: {WHY_DRAFT}\n"),
    (["--speculative", "--draft-branches", "100000"],
     f"cortiq: serve settings: draft_branches 100000 is outside [0, 16]: {WHY_BRANCHES}\n"),
    (["--speculative", "--max-len", "20", "--draft", "4", "--draft-branches", "5"],
     "cortiq: serve: a round of --draft 4 on 5 branches verifies 21 positions, and the context is 20: lower --draft "
     "or --draft-branches\n"),
    (["--profile", "{d}/missing/p.json"], "cortiq: serve: --profile {d}/missing/p.json: the folder {d}/missing does "
                                          "not exist\n"),
    (["--profile", "{d}"], "cortiq: serve: --profile {d}: {d} is a folder\n"),
    (["--profile", "{m}"], OVERWRITE.format("{m}", "the output is the input {m}")),
    (["--profile", "{d}/./m.cmf"], OVERWRITE.format("{m}", "the output is the input {m}")),
    (["--profile", "{m}.partial"], OVERWRITE.format("{m}.partial", "the output is the .partial file of the input {m}")),
    (["--profile", "{m}.lock"], OVERWRITE.format("{m}.lock", "the output is the .lock file of the input {m}")),
    (["--profile", "{s}"], OVERWRITE.format("{s}", "the output is {sn}, a shard of the input {m}")),  # a shard of it
    (["--profile", "{s}.partial"], OVERWRITE.format("{s}.partial", "the output is the .partial file of the input {s}")),
    (["--profile", "{d}/link.cmf"], OVERWRITE.format("{d}/link.cmf", "the output is the input {m}")),  # a link to it
])
def test_start_up_refusals_are_one_line_and_touch_no_file(tmp_path, capsys, args, line):
    import hashlib
    import os

    d = tmp_path / "models"
    d.mkdir()
    paths = _sharded(d)
    assert len(paths) > 2
    os.symlink(paths[0], d / "link.cmf")
    names = {"d": str(d), "m": str(paths[0]), "s": str(paths[1]), "sn": paths[1].name}
    before = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}
    listing = sorted(os.listdir(d))
    assert main(["serve", str(paths[0]), "--device", "cpu", *(a.format(**names) for a in args)]) == 1
    assert capsys.readouterr().err == line.format(**names)
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in paths} == before
    assert sorted(os.listdir(d)) == listing


def test_a_failed_profile_write_names_the_path_and_leaves_no_partial(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from cortiq.commands.serve import write_profile
    from cortiq.errors import CortiqError

    out = tmp_path / "p.json"
    write_text = Path.write_text

    def full(self, text, *a, **kw):  # half the text, then the disk is full
        write_text(self, text[: len(text) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(CortiqError) as e:
        write_profile(str(out), "{}" * 50)
    assert str(e.value) == f"{out}: no space left on device while writing"
    monkeypatch.undo()
    gone = tmp_path / "gone" / "p.json"  # its folder removed while the server ran
    with pytest.raises(CortiqError) as e:
        write_profile(str(gone), "{}")
    assert str(e.value) == f"{gone}: cannot write (No such file or directory)"
    assert list(tmp_path.iterdir()) == []  # no .partial left
    write_profile(str(out), "{}")
    assert out.read_text() == "{}" and list(tmp_path.iterdir()) == [out]


def test_a_failed_trace_write_is_one_line_and_leaves_no_partial(tmp_path, capsys):
    import errno

    from cortiq.serve.scheduler import Scheduler

    class Trace:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                f.write("{")
            raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "p.trace.json"
    Scheduler._export_trace(Trace(), str(out))
    assert capsys.readouterr().err == f"cortiq serve: {out}: no space left on device while writing\n"
    assert list(tmp_path.iterdir()) == []


def test_a_profile_that_cannot_be_written_at_shutdown_is_one_line(served_model, tmp_path):
    """The folder checked at start-up is gone by shutdown: the server still stops cleanly, and the
    command ends with one line naming the profile and exit status 1."""
    from serve_helpers import Server

    folder = tmp_path / "prof"
    folder.mkdir()
    srv = Server(served_model, tmp_path / "serve.log", "--max-batch", "1", "--max-len", "32", "--profile",
                 str(folder / "p.json"))
    folder.rmdir()
    assert srv.stop() == 1
    log = srv.log.read_text()
    assert log.splitlines()[-1] == f"cortiq: {folder / 'p.json'}: cannot write (No such file or directory)"
    assert "Traceback" not in log and not folder.exists()


def test_the_memory_check_counts_a_rounds_buffers(monkeypatch):
    """A deep, wide draft tree's round needs memory the KV cache does not show (its attention
    scores over the cache, its masks): the start-up check counts them."""
    import torch

    import cortiq.devices
    from cortiq.commands.serve import check_kv_room, kv_bytes, round_bytes
    from cortiq.errors import CortiqError

    a = arch("llama")
    assert round_bytes(a, 4, 200, 0) == 0 and 0 < round_bytes(a, 4, 200, 3) < round_bytes(a, 4, 200, 3, 4)
    kv = kv_bytes(a, 4, 200, 16, torch.float32, 16)
    monkeypatch.setattr(cortiq.devices, "free_memory", lambda dev: kv + round_bytes(a, 4, 200, 3, 4))
    check_kv_room(a, 4, 200, 3, torch.float32, torch.device("cpu"), 4)
    with pytest.raises(CortiqError, match="needs"):
        check_kv_room(a, 4, 200, 16, torch.float32, torch.device("cpu"), 16)
    # a narrowed draft head's rows count too (f32: 4 bytes a weight), exactly
    head = 100 * a.hidden_size * 4
    room = kv_bytes(a, 4, 200, 3, torch.float32, 4) + round_bytes(a, 4, 200, 3, 4)
    monkeypatch.setattr(cortiq.devices, "free_memory", lambda dev: room + head)
    check_kv_room(a, 4, 200, 3, torch.float32, torch.device("cpu"), 4, 100)
    with pytest.raises(CortiqError, match="needs"):
        check_kv_room(a, 4, 200, 3, torch.float32, torch.device("cpu"), 4, 101)
