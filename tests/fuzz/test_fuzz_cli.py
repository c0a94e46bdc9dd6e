"""Hostile model files through the command line: every corrupted CMF file and HF folder is
refused by inspect / verify / recode / nll / convert / generate / data build with one line,
a non-zero exit, no traceback, nothing written, in bounded memory and time (each case in a
forked process under an address-space cap and a timeout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz_gen import ALL, CMF_CASES, HF_CASES, INJECT, TEXT, model_tensors, mutated, split, write_hf, write_valid_cmf
from fuzz_runner import Cortiq, assert_clean_failure, assert_ok_or_clean, leftovers

HYP = settings(max_examples=12, deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module")
def cortiq():
    c = Cortiq()
    yield c
    c.close()


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    d = tmp_path_factory.mktemp("valid")
    path = write_valid_cmf(d / "m.cmf")
    (d / "text.txt").write_text(TEXT)
    return path.read_bytes(), d / "text.txt"


def _argv(cmd: str, model: Path, text: Path, out: Path) -> list:
    return {"inspect": ["inspect", model], "verify": ["verify", model],
            "recode": ["recode", model, out, "--codec", "q8"],
            "nll": ["nll", model, text, "--device", "cpu", "--window", "16"]}[cmd]


def test_the_valid_file_passes_everything(cortiq, valid, tmp_path):
    # the control: each refusal below is caused by its mutation, not by the set-up
    raw, text = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    for cmd in ALL:
        r = cortiq.run(_argv(cmd, tmp_path / "m.cmf", text, tmp_path / "out.cmf"), tmp_path)
        assert r.rc == 0 and r.stderr == "", str(r)
    assert (tmp_path / "out.cmf").exists()


@pytest.mark.parametrize("case", sorted(CMF_CASES))
def test_corrupted_cmf(case, cortiq, valid, tmp_path):
    raw, text = valid
    _, must_fail, match = CMF_CASES[case]
    bad = tmp_path / "bad.cmf"
    bad.write_bytes(mutated(raw, case))
    for cmd in ALL:
        out = tmp_path / "out.cmf"
        r = cortiq.run(_argv(cmd, bad, text, out), tmp_path)
        if cmd in must_fail:
            assert_clean_failure(r, match, out=out if cmd == "recode" else None)
        else:
            assert_ok_or_clean(r, out=out if cmd == "recode" else None)
        out.unlink(missing_ok=True)


def test_skipping_the_checks_is_explicit(cortiq, valid, tmp_path):
    raw, text = valid
    bad, nan = tmp_path / "bad.cmf", tmp_path / "nan.cmf"
    bad.write_bytes(mutated(raw, "flipped data byte"))
    nan.write_bytes(mutated(raw, "NaN weight"))
    r = cortiq.run(["recode", bad, tmp_path / "o1.cmf", "--codec", "f16", "--no-verify"], tmp_path)
    assert r.rc == 0, str(r)
    r = cortiq.run(["recode", nan, tmp_path / "o2.cmf", "--codec", "f32", "--allow-nonfinite"], tmp_path)
    assert r.rc == 0, str(r)
    # what --allow-nonfinite copied still fails verify: the NaN is reported, not laundered
    assert_clean_failure(cortiq.run(["verify", tmp_path / "o2.cmf"], tmp_path), r"hold NaN or Inf values: model.norm.weight")


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_not_a_regular_file(kind, cortiq, valid, tmp_path):
    _, text = valid
    p = tmp_path / "m.cmf"
    os.mkfifo(p) if kind == "fifo" else p.mkdir()
    for cmd in ALL:
        r = cortiq.run(_argv(cmd, p, text, tmp_path / "out.cmf"), tmp_path, timeout=10)
        assert_clean_failure(r, "not a regular file" if kind == "fifo" else "is a directory", out=tmp_path / "out.cmf")


@HYP
@given(cut=st.floats(0.0, 0.999))
def test_truncated_anywhere(cut, cortiq, valid, tmp_path_factory):
    raw, text = valid
    d = tmp_path_factory.mktemp("cut")
    bad = d / "bad.cmf"
    bad.write_bytes(raw[: int(len(raw) * cut)])
    for cmd in ("verify", "recode"):
        r = cortiq.run(_argv(cmd, bad, text, d / "out.cmf"), d)
        assert_clean_failure(r, r"truncated|not a CMF file|header runs past", out=d / "out.cmf")


def _json_values():
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                     st.text(max_size=8))
    return st.recursive(leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                        max_leaves=8)


@HYP
@given(where=st.sampled_from(["doc", "arch", "tokenizer"]), key=st.data(), value=_json_values())
def test_any_value_anywhere(where, key, value, cortiq, valid, tmp_path_factory):
    """Any JSON value under any key of the document, the arch or the tokenizer: refused with one
    line, or accepted and then read without a crash."""
    raw, text = valid
    header, data = split(raw)
    doc = json.loads(header["__metadata__"]["cmf"])
    target = {"doc": doc, "arch": doc["arch"], "tokenizer": doc["tokenizer"]}[where]
    k = key.draw(st.sampled_from(sorted(target)))
    target[k] = value
    header["__metadata__"]["cmf"] = json.dumps(doc)
    from fuzz_gen import join

    d = tmp_path_factory.mktemp("swap")
    bad = d / "bad.cmf"
    bad.write_bytes(join(header, data))
    for cmd in ("inspect", "nll"):
        assert_ok_or_clean(cortiq.run(_argv(cmd, bad, text, d / "out.cmf"), d))


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_corrupted_hf_folder(case, cortiq, tmp_path):
    sharded, mutate, match = HF_CASES[case]
    src = write_hf(tmp_path / "hf", sharded=sharded)
    mutate(src, tmp_path / "outside")
    out = tmp_path / "out.cmf"
    r = cortiq.run(["convert", src, out], tmp_path)
    assert_clean_failure(r, match, out=out)
    assert not (tmp_path / "INJECTED").exists() and not (src / "INJECTED").exists()


@pytest.mark.parametrize("sharded", [False, True])
def test_the_valid_hf_folder_converts(sharded, cortiq, tmp_path):
    src = write_hf(tmp_path / "hf", sharded=sharded)
    r = cortiq.run(["convert", src, tmp_path / "out.cmf"], tmp_path)
    assert r.rc == 0, str(r)


def test_a_hugging_face_cache_snapshot_converts(cortiq, tmp_path):
    # the cache's files are symlinks to ../../blobs: they leave the snapshot, not the cached repository
    repo = tmp_path / "models--org--tiny"
    snap = write_hf(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    for p in list(snap.iterdir()):
        p.rename(repo / "blobs" / p.name)
        p.symlink_to(Path("../../blobs") / p.name)
    r = cortiq.run(["convert", snap, tmp_path / "out.cmf"], tmp_path)
    assert r.rc == 0, str(r)


def test_generate_chat_does_not_run_the_template(cortiq, tmp_path):
    m = write_valid_cmf(tmp_path / "m.cmf", template=INJECT)
    r = cortiq.run(["generate", m, "hi", "--chat", "--device", "cpu", "--max-new", "2"], tmp_path)
    assert_clean_failure(r, r"m.cmf: the chat template failed: SecurityError")
    assert not (tmp_path / "INJECTED").exists()


def test_data_build_does_not_run_the_template(cortiq, tmp_path):
    m = write_valid_cmf(tmp_path / "m.cmf", template=INJECT)
    src = tmp_path / "chats.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    out = tmp_path / "td"
    r = cortiq.run(["data", "build", src, "--tokenizer", m, "--out", out], tmp_path)
    assert_clean_failure(r, r"SecurityError", out=out)
    assert not (tmp_path / "INJECTED").exists()


def test_data_build_out_names_a_file(cortiq, valid, tmp_path):
    raw, text = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    out = tmp_path / "taken.txt"
    out.write_text("mine")
    r = cortiq.run(["data", "build", text, "--tokenizer", tmp_path / "m.cmf", "--out", out], tmp_path)
    assert_clean_failure(r, r"taken.txt exists \(a file, not a directory\); pass --force to overwrite")
    assert out.read_text() == "mine" and not leftovers(tmp_path)
    # nor a directory of other things, which replacing would delete
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "keep.txt").write_text("mine")
    r = cortiq.run(["data", "build", text, "--tokenizer", tmp_path / "m.cmf", "--out", tmp_path / "docs"], tmp_path)
    assert_clean_failure(r, r"docs exists \(a directory that is not tdata: no meta.json of a tdata build\); pass --force")
    assert (tmp_path / "docs" / "keep.txt").read_text() == "mine"
    r = cortiq.run(["data", "build", text, "--tokenizer", tmp_path / "m.cmf", "--out", tmp_path / "docs", "--force",
                    "--fractions", "1,0,0"], tmp_path)
    assert r.rc == 0, str(r)
    assert (tmp_path / "docs" / "meta.json").is_file() and not (tmp_path / "docs" / "keep.txt").exists()


def test_nll_refuses_a_non_finite_result(cortiq, valid, tmp_path):
    # finite weights whose product overflows: logits of ±Inf, a NaN log-softmax
    _, text = valid
    ts = model_tensors()
    ts["model.embed_tokens.weight"] *= 1e10
    ts["model.norm.weight"] *= 1e30
    m = write_valid_cmf(tmp_path / "m.cmf", tensors=ts)
    r = cortiq.run(["nll", m, text, "--device", "cpu", "--window", "16"], tmp_path)
    assert_clean_failure(r, r"the NLL is nan.*the model is damaged")


@pytest.mark.parametrize("extra, match", [
    (["--device", "nonsense"], r"nll: device .nonsense. is not a torch device"),
    (["--device", "cuda:x"], r"nll: device .cuda:x. is not a torch device"),
    (["--batch-tokens", "0"], r"nll settings: batch_tokens 0 must be >= 1"),
    (["--window", "1"], r"nll settings: window 1 must be >= 2: a window.s first token is never scored"),
])
def test_bad_arguments(extra, match, cortiq, valid, tmp_path):
    raw, text = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    r = cortiq.run(["nll", tmp_path / "m.cmf", text] + extra, tmp_path)
    assert_clean_failure(r, match)


def test_binary_text_and_a_pipe_as_data(cortiq, valid, tmp_path):
    raw, _ = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00" * 100)
    assert_clean_failure(cortiq.run(["nll", tmp_path / "m.cmf", tmp_path / "bin.txt", "--device", "cpu"], tmp_path),
                         r"bin.txt: not UTF-8 text")
    os.mkfifo(tmp_path / "fifo")
    assert_clean_failure(cortiq.run(["nll", tmp_path / "m.cmf", tmp_path / "fifo", "--device", "cpu"], tmp_path,
                                    timeout=10), r"fifo: not a regular file or a directory")


# ── an output that is an input ──────────────────────────────────────────

#: command → its argv given the input model M, a text file T and the output O
WRITERS = {
    "recode": lambda m, t, o: ["recode", m, o, "--codec", "q8"],
    "convert": lambda m, t, o: ["convert", m, o],
    "export hf": lambda m, t, o: ["export", m, "--to", "hf", o],
    "export gguf": lambda m, t, o: ["export", m, "--to", "gguf", o],
    "compress": lambda m, t, o: ["compress", m, "--data", "td", "--out", o],
    "heal": lambda m, t, o: ["heal", m, "--teacher", m, "--data", "td", "--out", o],
    "mtp heal": lambda m, t, o: ["mtp", "heal", m, "--data", "td@64", "--out", o],
    "mtp init": lambda m, t, o: ["mtp", "init", m, "--out", o],
    "data build": lambda m, t, o: ["data", "build", t, "--tokenizer", m, "--out", o],
}


def _spelled(spelling: str, target: Path) -> Path:
    """Another name of `target`: itself, through `..`, a symlink or a hard link."""
    d = target.parent
    if spelling == "same":
        return target
    if spelling == "dotdot":
        (d / "sub").mkdir(exist_ok=True)
        return d / "sub" / ".." / target.name
    alias = d / ("alias" + target.suffix)
    alias.unlink(missing_ok=True)
    alias.symlink_to(target.name) if spelling == "symlink" else os.link(target, alias)
    return alias


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("spelling", ["same", "dotdot", "symlink", "hardlink"])
@pytest.mark.parametrize("cmd", sorted(WRITERS))
def test_an_output_that_is_the_input_is_refused(cmd, spelling, force, cortiq, valid, tmp_path):
    raw, text = valid
    m = tmp_path / "m.cmf"
    m.write_bytes(raw)
    t = tmp_path / "t.txt"
    t.write_text(TEXT)
    target = t if cmd == "data build" else m
    out = _spelled(spelling, target)
    r = cortiq.run(WRITERS[cmd](m, t, out) + force, tmp_path)  # --force overwrites no input
    assert_clean_failure(r, r"the output is the input")
    assert m.read_bytes() == raw and t.read_text() == TEXT and not leftovers(tmp_path)


#: what each writer says of an existing file that is not its kind of output
UNRELATED = {"data build": "a file, not a directory", "export hf": "a file", "export gguf": "a file"}
#: writers whose --force run is cut short here (by a missing tdata, after the output check):
#: the old output must then be intact
SLOW = ("compress", "heal", "mtp heal")


@pytest.mark.parametrize("cmd", sorted(WRITERS))
def test_an_existing_unrelated_output_needs_force(cmd, cortiq, built, tmp_path):
    m = built / "m.cmf"
    src = m
    if cmd == "convert":  # a source convert reads: the model as GGUF
        src = tmp_path / "m.gguf"
        assert cortiq.run(["export", m, "--to", "gguf", src], tmp_path).rc == 0
    out = tmp_path / ("out" if cmd in ("data build", "export hf") else "out.x")
    out.write_text("mine")
    argv = WRITERS[cmd](src, built / "t.txt", out)
    argv = [str(built / "td") if a == "td" else str(built / "td") + "@64" if a == "td@64" else str(a) for a in argv]
    argv += ["--fractions", "1,0,0"] if cmd == "data build" else []
    r = cortiq.run(argv, tmp_path)
    assert_clean_failure(r)
    what = UNRELATED.get(cmd, "not a CMF model")
    assert r.stderr.strip() == f"cortiq: {out} exists ({what}); pass --force to overwrite"
    assert out.read_text() == "mine"
    if cmd in SLOW:
        argv = [str(tmp_path / "no-td") + a[len(str(built / "td")):] if a.startswith(str(built / "td")) else a
                for a in argv]
        r = cortiq.run(argv + ["--force"], tmp_path)
        # past the output rule, then failed (the model has no draft for mtp heal): the old output stays
        assert_clean_failure(r, r"no-td|carries no MTP draft")
        assert out.read_text() == "mine" and not leftovers(tmp_path)
        return
    r = cortiq.run(argv + ["--force"], tmp_path)
    assert r.rc == 0, str(r)
    if cmd in ("data build", "export hf"):
        assert out.is_dir() and (out / ("meta.json" if cmd == "data build" else "config.json")).is_file()
    elif cmd == "export gguf":
        assert out.read_bytes()[:4] == b"GGUF"
    else:
        assert cortiq.run(["verify", out], tmp_path).rc == 0
    assert not leftovers(tmp_path) and not list(tmp_path.glob("*.replaced"))
    # its own kind of output is replaced without --force (a command run again); an export is not
    r = cortiq.run(argv, tmp_path)
    if cmd.startswith("export"):
        assert_clean_failure(r)
        assert r.stderr.strip() == (f"cortiq: {out} exists (a directory that is not empty); pass --force to overwrite"
                                    if cmd == "export hf" else f"cortiq: {out} exists (a file); pass --force to overwrite")
    else:
        assert r.rc == 0, str(r)


def test_a_failed_forced_export_leaves_the_old_output(cortiq, valid, tmp_path):
    raw, _ = valid
    bad = tmp_path / "bad.cmf"
    bad.write_bytes(mutated(raw, "NaN weight"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    assert_clean_failure(cortiq.run(["export", bad, "--to", "hf", tmp_path / "hf", "--force"], tmp_path),
                         CMF_CASES["NaN weight"][2])
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine" and not leftovers(tmp_path)


def test_a_directory_is_not_replaced_by_a_model_file(cortiq, valid, tmp_path):
    raw, _ = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    (tmp_path / "d.cmf").mkdir()
    r = cortiq.run(["recode", tmp_path / "m.cmf", tmp_path / "d.cmf", "--codec", "q8", "--force"], tmp_path)
    assert_clean_failure(r)
    assert r.stderr.strip() == f"cortiq: {tmp_path / 'd.cmf'}: is a directory; give a file name for the output"


def test_data_build_into_a_folder_holding_its_source(cortiq, valid, tmp_path):
    raw, _ = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    (tmp_path / "td").mkdir()
    (tmp_path / "td" / "t.txt").write_text(TEXT)
    r = cortiq.run(["data", "build", tmp_path / "td" / "t.txt", "--tokenizer", tmp_path / "m.cmf", "--out",
                    tmp_path / "td"], tmp_path)
    assert_clean_failure(r, r"td: the output folder holds the input .*t.txt")
    assert (tmp_path / "td" / "t.txt").read_text() == TEXT


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("case", ["NaN weight", "name climbs out", "name is absolute", "name unknown",
                                  "shape not the arch's", "bad tokenizer json", "trailing bytes"])
def test_export_writes_only_what_loads(case, fmt, cortiq, valid, tmp_path):
    raw, _ = valid
    bad = tmp_path / "bad.cmf"
    bad.write_bytes(mutated(raw, case))
    out = tmp_path / ("out" if fmt == "hf" else "out.gguf")
    assert_clean_failure(cortiq.run(["export", bad, "--to", fmt, out], tmp_path), CMF_CASES[case][2], out=out)


def test_the_valid_file_exports(cortiq, valid, tmp_path):
    raw, _ = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    for fmt, out in (("hf", tmp_path / "hf"), ("gguf", tmp_path / "m.gguf")):
        r = cortiq.run(["export", tmp_path / "m.cmf", "--to", fmt, out], tmp_path)
        assert r.rc == 0, str(r)


# ── bounds, checked before any work ─────────────────────────────────────

@pytest.fixture(scope="module")
def built(cortiq, valid, tmp_path_factory):
    """The valid model and a tdata directory built from its text."""
    raw, _ = valid
    d = tmp_path_factory.mktemp("built")
    (d / "m.cmf").write_bytes(raw)
    (d / "t.txt").write_text("\n\n".join(f"{TEXT} {i}" for i in range(40)))
    r = cortiq.run(["data", "build", d / "t.txt", "--tokenizer", d / "m.cmf", "--out", d / "td",
                    "--record-tokens", "64"], d)
    assert r.rc == 0, str(r)
    return d


def test_more_ranks_than_cores_is_refused(cortiq, built, tmp_path):
    r = cortiq.run(["heal", built / "m.cmf", "--teacher", built / "m.cmf", "--data", built / "td", "--out",
                    tmp_path / "h.cmf", "--device", "cpu", "--gpus", "99", "--window", "16", "--batch", "2"], tmp_path)
    assert_clean_failure(r, r"gpus 99: no CUDA device here, and the CPU ranks \(gloo\) are at most one per core: "
                            r"this machine has \d+", out=tmp_path / "h.cmf")


@pytest.mark.parametrize("spec, bad", [("td@-5", "-5"), ("td@lots", "lots")])
def test_mtp_heal_blames_the_token_count(spec, bad, cortiq, built, tmp_path):
    r = cortiq.run(["mtp", "heal", built / "m.cmf", "--data", spec, "--out", tmp_path / "o.cmf"], built)
    assert_clean_failure(r, rf"data spec '{spec}': the token count '{bad}' is not a positive integer",
                         out=tmp_path / "o.cmf")


def test_serve_refuses_a_context_past_the_model(cortiq, valid, tmp_path):
    raw, _ = valid
    (tmp_path / "m.cmf").write_bytes(raw)
    r = cortiq.run(["serve", tmp_path / "m.cmf", "--device", "cpu", "--max-len", "100000000", "--port", "0"], tmp_path)
    assert_clean_failure(r, r"m.cmf: --max-len 100000000 is past the model's context of 64 tokens")


def test_serve_refuses_a_kv_cache_past_the_memory(cortiq, tmp_path):
    ts = model_tensors()
    from fuzz_gen import ARCH

    import dataclasses

    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    long = dataclasses.replace(ARCH, max_position_embeddings=1 << 26)
    m = write_cmf(tmp_path / "m.cmf", new_doc(long, tokenizer_doc(byte_tokenizer_json(), [256])),
                  specs_from_tensors(ts.items(), "f32"))
    r = cortiq.run(["serve", m, "--device", "cpu", "--max-len", str(1 << 26), "--max-batch", "256", "--port", "0"],
                   tmp_path)
    assert_clean_failure(r, r"serve: the KV cache of 256 slots x 67108864 tokens needs [\d.]+ GB, cpu has [\d.]+ GB "
                            r"free: lower --max-len or --max-batch")


# ── data and settings ───────────────────────────────────────────────────

def _build(cortiq, d: Path, src, *extra):
    return cortiq.run(["data", "build", src, "--tokenizer", d / "m.cmf", "--out", d / "out", *extra], d)


@pytest.mark.parametrize("fractions", ["nan,0.5,0.5", "inf,0,0", "0.5,nan,0.5"])
def test_fractions_that_are_not_numbers(fractions, cortiq, built):
    assert_clean_failure(_build(cortiq, built, built / "t.txt", "--fractions", fractions),
                         r"split fractions must be three non-negative numbers summing to 1", out=built / "out")


@pytest.mark.parametrize("rid", [{"a": 1}, [1], True, 1.5])
def test_a_jsonl_id_that_is_not_a_name(rid, cortiq, built):
    src = built / "ids.jsonl"
    src.write_text(json.dumps({"id": rid, "text": "hello there"}) + "\n")
    assert_clean_failure(_build(cortiq, built, src), r"ids.jsonl:1: 'id' must be a string or an integer, not",
                         out=built / "out")


def test_a_fifo_source_is_not_a_regular_file(cortiq, built, tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    assert_clean_failure(_build(cortiq, built, tmp_path / "pipe.txt"), r"pipe.txt: not a regular file",
                         out=built / "out")


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_a_huge_line_is_refused_while_read(kind, cortiq, built, tmp_path):
    """20 MB on one line, far past max_tokens: refused in bounded time and memory (the case's
    cap), not tokenized whole first."""
    word = "abcdefghij" * 2_000_000
    src = tmp_path / f"huge.{kind}"
    src.write_text(word if kind == "txt" else json.dumps({"text": word}) + "\n")
    r = _build(cortiq, built, src, "--max-tokens", "1024", "--record-tokens", "512")
    assert_clean_failure(r, r"more than max_tokens 1024 tokens" if kind == "txt" else
                         r"huge.jsonl:1: a line of more than \d+ characters: its record would be over max_tokens",
                         out=built / "out")


# ── a full disk ─────────────────────────────────────────────────────────

@pytest.fixture
def full_disk(tmp_path):
    """A 4 KiB tmpfs (root only; skipped elsewhere): every write of a model fills it."""
    import subprocess

    d = tmp_path / "full"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


@pytest.mark.parametrize("cmd", ["export hf", "export gguf", "recode", "data build", "heal"])
def test_a_full_disk_names_the_file(cmd, cortiq, built, full_disk):
    m, out = built / "m.cmf", full_disk / ("out" if cmd in ("export hf", "data build") else "out.x")
    argv = {"export hf": ["export", m, "--to", "hf", out], "export gguf": ["export", m, "--to", "gguf", out],
            "recode": ["recode", m, out, "--codec", "f32"],
            "data build": ["data", "build", built / "t.txt", "--tokenizer", m, "--out", out, "--record-tokens", "64"],
            "heal": ["heal", m, "--teacher", m, "--data", built / "td", "--out", out, "--work", built / "work",
                     "--device", "cpu", "--window", "16", "--batch", "2", "--epochs", "0.2", "--topk", "4", "--no-score", "--quiet",
                     "--retain-sources", "none"]}[cmd]
    r = cortiq.run(argv, built, timeout=60)
    assert_clean_failure(r, rf"{out}(\.partial/\S+)?: no space left on device while writing", out=out)
    assert list(full_disk.iterdir()) == []
