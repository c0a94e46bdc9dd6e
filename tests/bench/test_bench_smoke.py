"""Every bench script runs: `python -m bench.NAME --cpu --tiny` (the GPU run's own code at tiny sizes),
each in its own process as the GPU call runs it, and writes the JSON rows it is expected to write.

A bench that breaks (an import, a renamed library function, a wrong argument) fails here, not on the
next GPU call. A new bench/*.py must get a row below or be named a module (not a script)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: bench/*.py that are imported, not run: the shared helpers and bench.run's stage code
MODULES = {"__init__", "common", "stages"}


def _rows(doc, key="rows"):
    return doc[key]


#: an error a row may report on this machine: the 8-bit Adam plans need torchao, an optional extra
EXCUSED = () if importlib.util.find_spec("torchao") else ("needs torchao",)


def _no_error(rows):
    bad = [r for r in rows if isinstance(r, dict) and r.get("error") and not any(e in r["error"] for e in EXCUSED)]
    assert not bad, bad


def check_run(d):
    rows = _rows(d)
    assert {(r["geom"], r["who"]) for r in rows} == {("tiny", "baseline"), ("tiny", "cortiq"), ("tiny-hybrid", "cortiq")}
    _no_error(rows)
    assert all(r["step_tok_s"] > 0 and r["epoch_tok_s"] > 0 for r in rows if r["who"] == "cortiq")


def check_compress(d):
    assert d["masks"]["gpu_steps"] == 6 and 0 <= d["masks"]["graph_vs_eager"]["overlap"] <= 1
    assert {"overlap_bf16", "overlap_f32", "grams", "repair", "gptq"} <= set(d)
    # the CPU standing in for CUDA computes the same thing: the agreement columns must be exact
    assert d["grams"]["max_rel"] < 1e-6 and d["repair"]["max_rel"] < 1e-6 and d["gptq"]["codes_equal"] == 1.0


def check_data_build(d):
    build, win = _rows(d)
    assert build["tokens"] > 15_000 and win["records"] > 0 and win["tok_s"] > 0


def check_decode(d):
    rows = _rows(d)
    who = {r["who"] for r in rows}
    assert {"reference", "engine"} <= who and any(w.startswith("spec") for w in who), who
    assert all(r["tok_s"] > 0 for r in rows) and d["accept"]


def check_dist(d):
    rows = _rows(d)
    _no_error(rows)
    heal = [r for r in rows if r["part"].startswith("heal")]
    assert [r["gpus"] for r in heal] == [1, 2] and all(r["evals"] for r in heal)
    assert any(r["part"].startswith("fsdp step") for r in rows)


def check_memory(d):
    _no_error(d["heal"])
    assert d["masks"] and sum("error" not in r for r in d["heal"]) >= 8  # baseline, plain x3, checkpoint, micro, partial, auto


def check_mtp(d):
    assert d["real"] and all(r["rounds"] > 0 for r in d["real"])


def check_pipeline(d):
    _no_error(d["pipeline"])
    _no_error(d["memory"])
    stages = {r["stage"].split()[0].lower() for r in d["pipeline"]}
    assert {"source", "data", "compress", "heal", "score", "mtp", "re-encode"} <= stages, stages
    assert d["memory"] and d["masks"] and not d["skipped"]


def check_profile_step(d):
    assert set(d["ms"]) == {"step", "trunk fwd+bwd", "head/top-k KL fwd+bwd", "clip/Adam", "rest"}
    assert d["ms"]["step"] > 0


def check_quality(d):
    assert d["rows"] and all("gap" in r for r in d["rows"])


def check_relaunch(d):
    one, two = _rows(d)
    assert (one["gpus"], two["gpus"]) == (1, 2) and one["train_digest"] == two["train_digest"]
    assert d["failure"]["error"] and d["failure"]["incomplete"]


def check_selfgen(d):
    names = [r["row"] for r in _rows(d)]
    assert sum(n.startswith("selfgen") for n in names) == 2, names
    assert {"old continue_batch", "new, same prompts (greedy)", "old generate_answers",
            "new, same requests (batched)"} <= set(names), names
    assert all(r["tokens"] > 0 and r["tok_s"] > 0 for r in _rows(d)) and d["samples"]


def check_serve(d):
    assert {r["mode"] for r in _rows(d)} == {"plain", "speculative", "auto"} and all(r["tokens"] > 0 for r in _rows(d))
    # the plain step alone (whole cache against its key-length bucket) and the acceptance table
    assert d["step_ms"] and d["acceptance"], {k: d.get(k) for k in ("step_ms", "acceptance")}


def check_codecs(d):
    # every codec row, each scored on every text, finite
    assert {"f16", "q8 rtn", "q4 rtn", "q4 gptq", "q4 qat-kd"} <= set(d["nll"]), sorted(d["nll"])
    assert all(math.isfinite(v) for row in d["nll"].values() for v in row.values())


def check_llamacpp(d):
    # the cortiq side always runs; llama.cpp's only where $LLAMA_BIN names a build (it takes ~10 min to build)
    (r,) = _rows(d)
    assert r["chunks"] == 4 and r["scored"] == 4 * 31 and math.isfinite(r["cortiq_nll"]) and r["cortiq_greedy"]
    if "delta" in r:
        assert r["tokens_equal"] and math.isfinite(r["delta"]) and r["greedy_tokens"] > 0
    else:
        assert r["llama"].startswith("skipped")


def check_variants(d):
    assert {"step_plain", "step_micro2", "step_micro4", "step_ckpt"} <= set(d)
    assert all(isinstance(d[k], dict) for k in ("step_plain", "step_micro2", "step_micro4", "step_ckpt"))


def check_device_check(d):
    rows = _rows(d)
    assert not [r for r in rows if r["status"] == "FAIL"], [r for r in rows if r["status"] == "FAIL"]
    names = [r["command"] for r in rows]
    for want in ("data build", "compress --use-gptq", "heal --train-from 1", "nll", "mtp heal",
                 "generate --speculative", "serve", "export --to hf", "export --to gguf", "demo"):
        assert any(n.startswith(want) for n in names), (want, names)
    assert sum(r["status"] == "PASS" for r in rows) >= 14


#: script → (extra arguments after --cpu --tiny, the JSON it writes, the check of that JSON)
BENCHES = {
    "run": ([], "bench.json", check_run),
    "compress": ([], "compress_bench.json", check_compress),
    "data_build": ([], "data_build.json", check_data_build),
    "decode": ([], "decode.json", check_decode),
    "dist": ([], "dist.json", check_dist),
    "memory": ([], "memory.json", check_memory),
    "mtp": (["--no-compare-raw"], "mtp.json", check_mtp),
    "pipeline": ([], "pipeline.json", check_pipeline),
    "profile_step": ([], "profile_step.json", check_profile_step),
    # one target kind at one budget: the same code as every row
    "quality": (["--kinds", "sampled", "--budgets", "0.004", "--default-budget", "0"], "quality.json", check_quality),
    "relaunch": ([], "relaunch.json", check_relaunch),
    "selfgen": ([], "selfgen.json", check_selfgen),
    # one prompt kind, two client levels: every mode's server, the transformers row, the same code
    "serve": (["--kinds", "chat", "--clients", "2", "--no-hf"], "serve.json", check_serve),
    "variants": ([], "variants.json", check_variants),
    # the rows that run heal's other target kinds and memory plans, and compress's two other rankings,
    # run the same command with one option changed: left out here to keep the suite short (the H200
    # check runs them all)
    "device_check": (["--skip", "heal --target,heal --memory,compress --no-learn-masks,compress --fold-repair"],
                     "device_check.json", check_device_check),
    "codecs": ([], "codecs.json", check_codecs),
    "llamacpp": ([], "llamacpp.json", check_llamacpp),
}


def test_every_bench_has_a_smoke_row():
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py")}
    assert scripts - MODULES == set(BENCHES), "a bench/*.py without a smoke row (or a row without its script)"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_smoke(name, tmp_path):
    args, result, check = BENCHES[name]
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path / "home"), "OUT": str(out),
           "CORTIQ_HOME": str(tmp_path / "cortiq-home"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", f"bench.{name}", "--cpu", "--tiny", "--out", str(out), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, f"bench.{name} exit {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert re.search(r"\|\s*-{3,}\s*\|", p.stdout), f"bench.{name} printed no table:\n{p.stdout[-2000:]}"
    check(json.loads((out / result).read_text()))


def test_the_device_check_finds_the_flow_commands_in_an_uninstalled_tree(tmp_path, monkeypatch):
    """On the GPU machine cortiq runs from the tree, with no entry points: the demo row gives its child
    the metadata pyproject.toml declares, first on the child's path, where importlib finds the commands."""
    import importlib.metadata as im
    import types

    import tomllib

    from bench import device_check

    monkeypatch.setattr(im, "entry_points", lambda **kw: [])
    extra = device_check.Check.plugin_path(types.SimpleNamespace(work=tmp_path))
    first = extra["PYTHONPATH"].split(os.pathsep)[0]
    (dist,) = im.distributions(path=[first])
    got = sorted((e.name, e.value) for e in dist.entry_points.select(group="cortiq.commands"))
    want = tomllib.loads((device_check.ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["cortiq.commands"]
    assert dist.metadata["Name"] == "cortiq" and got == sorted(want.items())
