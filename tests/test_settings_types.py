"""Parameter files: read within limits, every setting type-checked and absurd plans refused
before anything runs (each with one line naming the file and the key)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cortiq.errors import CortiqError
from cortiq.settings import MAX_PARAM_BYTES, MAX_PARAM_VALUES, load_settings

ROOT = Path(__file__).resolve().parents[1]

#: a billion laughs: 9 levels of 9 aliases each; 10 lines that expand to 9**7 strings under `name`
BOMB = "".join(
    [f"a0: &a0 [{', '.join(['lol'] * 9)}]\n"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 7)]
) + "name: *a6\n"


@pytest.mark.parametrize("yaml_text, message", [
    # ints are ints, floats finite, booleans real, strings strings, tables tables
    ("heal:\n  window: 2.5\n", "heal.window must be a whole number, not 2.5"),
    ("heal:\n  window: true\n", "heal.window must be a whole number, not True"),
    ("compress:\n  masks:\n    max_steps: '40'\n", "compress.masks.max_steps must be a whole number, not '40'"),
    ("heal:\n  epochs: .inf\n", "heal.epochs must be a finite number, not inf"),
    ("mtp:\n  lr: .nan\n", "mtp.lr must be a finite number or null, not nan"),
    ("heal:\n  lr: 1e-4\n", "heal.lr must be a number (YAML reads 1e-4 as text: write it with a point, 1.0e-4)"),
    ("mtp_enabled: 'no'\n", "mtp_enabled must be true or false, not 'no'"),
    ("heal:\n  compile: 1\n", "heal.compile must be true or false, not 1"),
    ("compress:\n  masks: fast\n", "compress.masks must be a mapping of settings, not 'fast'"),
    ("heal: fast\n", "heal must be a mapping, not 'fast'"),
    ("run: fast\n", "run must be a mapping, not 'fast'"),
    ("name: [a, b]\n", "name must be a string, not ['a', 'b']"),
    ("name: 12\n", "name must be a string, not 12"),
    # keys, groups and YAML itself
    ("heal:\n  lrr: 0.1\n", "unknown key heal.lrr (did you mean heal.lr?)"),
    ("compress:\n  masks:\n    keep_fra: 0.5\n", "unknown key compress.masks.keep_fra (did you mean compress.keep_frac?)"),
    # one share of neurons: the groups' own keep_frac is set by compress.keep_frac
    ("compress:\n  fold:\n    keep_frac: 0.5\n", "compress.fold.keep_frac is not set on its own: write compress.keep_frac"),
    ("compress:\n  keep_frac: 0.5\n  masks: {keep_frac: 0.5}\n", "compress.masks.keep_frac is not set on its own"),
    ("sorce: x.cmf\n", "unknown key sorce (did you mean source?)"),
    ("run:\n  retrys: 2\n", "unknown key run.retrys (did you mean run.retries?)"),
    ("run:\n  retries: -1\n", "run.retries -1 must be >= 0"),
    ("codecs: [q8, q3]\n", "q3"),
    ("data:\n  sources: []\n", "data.sources must be a non-empty list"),
    ("heal: 3\n", "heal must be a mapping"),
    ("- a\n- b\n", "a parameter set must be a mapping of groups"),
    ("heal: [\n", "not YAML"),
    ("name: ''\n", "name must be 1 to 200 characters, not 0"),
    ("source: [x.cmf]\n", "source must be a string, not ['x.cmf']"),
    ("run:\n  experiment: \"a\\nb\"\n", "run.experiment must be a string without control characters"),
    ("data:\n  category: 3\n", "data.category must be a string or null, not 3"),
    ("data:\n  fractions: [0.5, 0.5]\n", "data.fractions must be a list of 3, not [0.5, 0.5]"),
    ("data:\n  fractions: [0.5, 0.25, x]\n", "data.fractions[2] must be a number, not 'x'"),
    ("codecs: q8\n", "codecs must be a list, not 'q8'"),
    ("codecs: [q8, 4]\n", "codecs[1] must be a string, not 4"),
    ("score_tokens: 10000000000000000000\n", "score_tokens must be a whole number of at most"),
    # device strings parsed
    ("heal:\n  device: gpu\n", "heal.device 'gpu' is not a device"),
    ("mtp:\n  device: 'cuda:x'\n", "mtp.device 'cuda:x' is not a device"),
    # plans of absurd work, refused with the reason
    ("heal:\n  window: 1\n", "heal.window 1 is outside [8, 1048576]: a window is one model pass"),
    ("score_window: 2\n", "score_window 2 is outside [8, 1048576]"),
    ("compress:\n  masks:\n    window: 4\n", "compress.masks.window 4 is outside [8, 1048576]"),
    ("mtp:\n  epochs: 100000\n", "mtp.epochs 100000 is outside [0, 1000]"),
    ("heal:\n  topk: 1000000\n", "heal.topk 1000000 is outside [1, 65536]"),
])
def test_a_setting_of_the_wrong_kind_is_refused_naming_the_key(tmp_path, yaml_text, message):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml_text)
    with pytest.raises(CortiqError) as e:
        load_settings(p)
    assert str(e.value).startswith(f"{p}: ")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_well_typed_values_pass_and_are_normalised(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("mtp_enabled: no\nheal:\n  lr: 1\n  device: 'cuda:1'\n  window: 8\nmtp:\n  epochs: 0\n"
                 "data:\n  fractions: [1, 0, 0]\n  category: null\n")
    s = load_settings(p)
    assert s.mtp_enabled is False  # YAML's unquoted `no` is a real boolean
    h = s.heal
    assert h.lr == 1.0 and isinstance(h.lr, float) and h.device == "cuda:1" and h.window == 8
    assert s.data.fractions == (1.0, 0.0, 0.0)
    # a mapping (a deployment's parameters) is checked the same way
    with pytest.raises(CortiqError, match="settings: heal.window must be a whole number, not 2.5"):
        load_settings({"heal": {"window": 2.5}})


def test_alias_bomb_fails_with_one_line(tmp_path):
    p = tmp_path / "laughs.yaml"
    p.write_text(BOMB)
    assert len(BOMB) < 1000
    with pytest.raises(CortiqError) as e:
        load_settings(p)
    assert str(e.value) == (f"{p}: expands to more than {MAX_PARAM_VALUES} values with its aliases resolved "
                            "(nested YAML aliases); a parameter set is a few dozen")


def test_a_few_aliases_are_fine(tmp_path):
    p = tmp_path / "anchors.yaml"
    p.write_text("heal: &h {window: 64, batch: 2}\ncompress:\n  masks: *h\n")
    s = load_settings(p)
    assert s.compress.masks.window == s.heal.window == 64


@pytest.mark.parametrize("content, message", [
    ("a: &a [*a]\n", "an alias refers to itself"),
    ("[" * 100 + "]" * 100 + "\n", "nested deeper than 32 levels"),
    ("[" * 50000 + "]" * 50000 + "\n", "nested deeper than 32 levels"),
    (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a text file (not UTF-8)"),
    ("name: a\x00b\n", "not a text file (NUL bytes)"),
    ("x" * (MAX_PARAM_BYTES + 1), f"bytes; a parameter file is at most {MAX_PARAM_BYTES} bytes"),
    ("heal: [\n", "not YAML (line 2"),
    ("!!python/object/apply:os.system ['true']\n", "not YAML"),
])
def test_files_that_are_not_parameter_sets(tmp_path, content, message):
    p = tmp_path / "bad.yaml"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    with pytest.raises(CortiqError) as e:
        load_settings(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value)


def test_a_fifo_is_refused_without_reading_it(tmp_path):
    p = tmp_path / "params.yaml"
    os.mkfifo(p)
    with pytest.raises(CortiqError, match="not a regular file"):
        load_settings(p)


def test_cortiq_run_refuses_the_bomb_in_one_line_within_a_memory_cap(tmp_path):
    """The whole CLI path, in a process capped at 2 GB: one line, exit 1, no traceback."""
    p = tmp_path / "laughs.yaml"
    p.write_text(BOMB)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30));"
            "from cortiq.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CORTIQ_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-c", code, "run", "compress", "--params", str(p)], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"cortiq: {p}: expands to more than {MAX_PARAM_VALUES} values with "
                                             "its aliases resolved (nested YAML aliases); a parameter set is a few dozen"]
    assert not (tmp_path / "home").exists()  # nothing started, nothing written
