"""Every bench script runs: `python -m bench.GROUP.NAME --cpu --tiny` (the GPU run's own code at tiny sizes),
each in its own process as the GPU call runs it, and writes the JSON rows it is expected to write.

A bench that breaks (an import, a renamed library function, a wrong argument) fails here, not on the
next GPU call. A new bench/**/*.py must get a row below or be named a module (not a script).

The benches start together when the first row asks, as many at once as this process has cores (each
bench's torch runs one thread), longest first; each row waits for its own and checks it. Each runs
in a folder of its own (HOME, TMPDIR, its --work), so two runs of the suite never share one."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: bench/**/*.py that are no bench: the packages, the shared helpers, bench.run's stage code, a tool with
#: tests of its own (bench.mtp.draft_carry: tests/bench/test_draft_carry.py), and the script bench.quality.peer
#: runs in llm-compressor's own venv (`make peer`), which the suite does not install
MODULES = {"common", "heal.stages", "mtp.draft_carry", "quality.peer_gptq"}


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


def check_draft_data(d):
    assert [r["row"] for r in d["rows"]] == ["defaults", "asked, 4096 windows"]
    for r in d["rows"]:
        kinds = {(a["kind"], a["dtype"]) for a in r["measures"]}
        assert kinds == {("chat", "float32"), ("text", "float32")}
        assert all(1 <= a["offline_tokens_a_round"] <= 4 for a in r["measures"]) and r["steps"] > 0


def check_draft_vocab(d):
    # each prompt kind at each head size; the whole head covers every token, a narrower one no more
    assert [(r["kind"], r["head_rows"]) for r in d["rows"]] == [(k, n) for k in ("chat", "text") for n in (259, 200, 64)]
    for k in ("chat", "text"):
        cov = [r["covered"] for r in d["rows"] if r["kind"] == k]
        assert cov[0] == 1.0 and cov == sorted(cov, reverse=True)
    assert all(1 <= r[m] <= 1 + d["draft"] for r in d["rows"] for m in ("chain", "tree"))


def check_pipeline(d):
    _no_error(d["pipeline"])
    _no_error(d["memory"])
    stages = {r["stage"].split()[0].lower() for r in d["pipeline"]}
    assert {"source", "data", "compress", "heal", "score", "mtp", "re-encode"} <= stages, stages
    assert d["memory"] and d["masks"] and not d["skipped"]


def check_profile_step(d):
    assert set(d["ms"]) == {"step", "trunk fwd+bwd", "head/top-k KL fwd+bwd", "clip/Adam", "rest"}
    assert d["ms"]["step"] > 0


def check_attention(d):
    rows = _rows(d)
    _no_error(rows)
    # every form of the call computes the engine's attention: in f32 they agree with SDPA to rounding
    assert {r["variant"] for r in rows} >= {"SDPA as called", "bool mask", "math", "matmul-softmax-matmul"}
    assert all(r["max_err"] < 1e-4 for r in rows), rows


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
    assert d["complete"] is True  # (each level rewrites the file as it ends, complete: false)
    assert {r["mode"] for r in _rows(d)} == {"plain", "speculative", "auto-tree"}
    assert all(r["tokens"] > 0 for r in _rows(d))
    # the plain step alone (whole cache against its key-length bucket) and the acceptance table
    assert d["step_ms"] and d["acceptance"], {k: d.get(k) for k in ("step_ms", "acceptance")}
    assert all(a["engine_tree_tokens_a_round"] >= 1 and a["offline_tree_tokens_a_round"] >= 1 for a in d["acceptance"])
    # the static trees' table: its chain and its tree of --branches first guesses are the measure's own figures
    for a in d["acceptance"]:
        t = a["offline_trees"]
        assert len(t) == 9 and t["1"] == a["offline_tokens_a_round"]
        assert t[str(d["branches"])] == a["offline_tree_tokens_a_round"]
    # the speculative server's steps beside the plain one: the plain steps that keep the draft's chain and
    # skip it (--spec-auto's), and a round per depth
    steps = {(r["step"], r["batch"]) for r in d["step_ms"] if r["how"] == "key-length bucket"}
    want = ["plain", "plain, draft kept", "plain, chain skipped"] + [f"{how} {k}" for k in range(1, d["draft"] + 1)
                                             for how in ("round, depth", f"tree of {d['branches']}, depth")]
    assert {(w, b) for w in want for b in {r["batch"] for r in d["step_ms"]}} == steps, sorted(steps)


def check_step_cost(d):
    # a chain and a tree round of each depth timed at each slot count, against the plain server's step, and
    # again with the draft picking among the first --draft-vocab tokens
    n = d["draft_vocab"]
    names = [f"{how}{head}, depth {k}" for k in (1, 2, 3) for how in ("round", "tree of 4") for head in ("", f" (head {n})")]
    assert {(r["step"], r["batch"]) for r in d["step_ms"] if r["step"] in names} == {(n, b) for n in names for b in (1, 2)}
    assert {r["step"] for r in d["step_ms"]} == set(names) | {"plain", "plain, draft kept", "plain, chain skipped",
                                                             f"plain (head {n}), draft kept"}
    # the default acceptance: the 135M final table's chain and tree servers, per prompt kind
    assert set(d["accepted"]) == {"chat", "text"} and all(a["depth"] == 3 and a["chain"] > 1 for a in d["accepted"].values())
    assert [(r["batch"], r["kind"]) for r in d["speedups"]] == [(1, "chat"), (1, "text"), (2, "chat"), (2, "text")]
    for r in d["speedups"]:
        assert set(r["rounds"]) == set(names) and all(v["speedup"] > 0 and 1 <= v["tokens"] <= 4 for v in r["rounds"].values())


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


def check_scale(d):
    rows = d["rows"]
    # a row per stage, each run (the serve rows too: the load generator runs on the CPU) and timed
    assert [r["stage"] for r in rows] == ["source", "data", "compress", "heal", "mtp-init", "mtp-heal", "recode-q4",
                                          "export-hf", "export-gguf", "serve-plain", "serve-speculative"]
    assert all(r["status"] == "PASS" and r["seconds"] > 0 for r in rows), [(r["stage"], r.get("error")) for r in rows]
    # heal's cached stages are rows of their own: the teacher pass and the training, timed
    heal = next(r for r in rows if r["stage"] == "heal")
    assert {"targets", "train"} <= {p["stage"] for p in heal["parts"]} and all(p["seconds"] >= 0 for p in heal["parts"])
    assert all(lv["tok_s"] > 0 for r in rows if r["stage"].startswith("serve") for lv in r["levels"])


def check_device_check(d):
    rows = _rows(d)
    assert not [r for r in rows if r["status"] == "FAIL"], [r for r in rows if r["status"] == "FAIL"]
    names = [r["command"] for r in rows]
    for want in ("data build", "compress --use-gptq", "heal --train-from 1", "nll", "mtp heal",
                 "generate --speculative", "generate --speculative --draft-vocab", "serve", "serve --speculative", "export --to hf", "export --to hf q8 / symmetric q4",
                 "export --to gguf", "demo"):
        assert any(n.startswith(want) for n in names), (want, names)
    assert sum(r["status"] == "PASS" for r in rows) >= 14


def check_serve_isolation(d):
    rows = {r["row"]: r for r in d["rows"]}
    assert list(rows) == ["alone", "refused", "tokenized"] and all(r["median_s"] > 0 for r in rows.values())
    # the large prompts: refused unread under the default bound, tokenized (then too long for the context) above it
    assert rows["refused"]["large_statuses"] == rows["tokenized"]["large_statuses"] == [400]


def check_excess(d):
    (m,) = d["models"]
    # the quartiles and the shapes each split every token once: their tokens and shares of the excess add up
    for kind in ("source NLL quartile", "shape"):
        part = [r for r in m["rows"] if r["part"].startswith(kind)]
        assert sum(r["tokens"] for r in part) == d["tokens"]
        assert math.isclose(sum(r["share_excess"] for r in part), 1.0, rel_tol=1e-6)
        assert math.isclose(sum(r["excess"] * r["tokens"] for r in part) / d["tokens"], m["excess"], rel_tol=1e-5, abs_tol=1e-6)


def check_knowledge(d):
    for r in d["rows"]:
        # facts kept on both parts, for the pruned and the healed model, each within what the source knows
        for part in ("dev", "held"):
            for m in ("pruned", "healed"):
                f = r["facts"][part][m]
                assert 0 <= f["kept"] <= f["source_known"] <= f["facts"]
        assert set(r["nll"]["healed"]) == set(d["source_nll"]) and all(math.isfinite(v) for v in r["nll"]["healed"].values())
        # the dev part by kind adds up to its counts
        for m in ("pruned", "healed"):
            by = r["dev_kinds"][m].values()
            assert [sum(k for k, _ in by), sum(n for _, n in by)] == [r["facts"]["dev"][m]["kept"],
                                                                     r["facts"]["dev"][m]["source_known"]]
    # the curve's row keeps half of the neurons: its model is the smaller
    base, half = d["rows"]
    assert half["row"]["keep"] == 0.5 and sum(half["widths"]) < sum(base["widths"])
    assert half["bytes"]["healed"] < base["bytes"]["healed"] < base["bytes"]["source"]


def check_noise(d):
    # no noise: the source itself, its NLL to the last digit; noise: another NLL (a random model may gain); the
    # fact counts within the source's (the tiny random model knows no facts: the real figures are QUALITY's)
    zero, *noisy = d["rows"]
    assert zero["alpha"] == 0 and zero["pydoc_excess"] == 0.0
    assert all(c["kept"] == c["source_known"] and c["sure_kept"] == c["source_sure"] for c in zero["facts"].values())
    assert [(r["alpha"], r["seed"]) for r in noisy] == [(0.5, 0), (1.0, 0)] and all(r["pydoc_excess"] != 0.0 for r in noisy)
    for r in d["rows"]:
        for c in r["facts"].values():
            assert 0 <= c["sure_kept"] <= c["source_sure"] <= c["source_known"] and c["kept"] <= c["source_known"]


def check_sizes(d):
    src, comp, q8, q4, q4s = d["rows"]
    assert comp["parameters"] < src["parameters"] and q8["parameters"] == q4["parameters"] == comp["parameters"]
    for fmt in ("CMF", "HF f16", "GGUF"):  # uniform widths: smaller in every format
        assert comp["bytes"][fmt] < src["bytes"][fmt]
    # 4 bits below 8 where the format keeps them; q4's exact export is 16-bit (its blocks keep a min)
    assert q4["bytes"]["CMF"] < q8["bytes"]["CMF"] < comp["bytes"]["CMF"]
    assert q4["bytes"]["GGUF"] < q8["bytes"]["GGUF"] < comp["bytes"]["GGUF"]
    assert q4["bytes"]["HF quantized (all)"] < q8["bytes"]["HF quantized (exact)"] < comp["bytes"]["HF f16"]
    assert q4["bytes"]["HF quantized (exact)"] == q4["bytes"]["HF f16"]
    # the symmetric grid's blocks go as int4 exactly: what `--quantized all` re-derives, without re-deriving
    exact = q4s["bytes"]["HF quantized (exact)"]
    assert exact < q8["bytes"]["HF quantized (exact)"] and abs(exact - q4["bytes"]["HF quantized (all)"]) < 0.01 * exact


def check_hf_run(d):
    rows = d["rows"]
    assert list(rows) == ["f16", "q8", "q4 symmetric"]
    for codec, r in rows.items():  # transformers runs each export as cortiq runs the CMF file
        assert abs(r["nll_transformers"] - r["nll_cortiq"]) < 0.01, (codec, r)
        n = r["layout"]["packed"] + r["layout"]["dense"]
        assert r["layout"] == ({"packed": 0, "dense": n} if codec == "f16" else {"packed": n, "dense": 0}), (codec, r)
    assert rows["q4 symmetric"]["decoder_bytes"] <= 0.32 * rows["f16"]["decoder_bytes"]
    assert rows["q4 symmetric"]["decoder_bytes"] < rows["q8"]["decoder_bytes"] < rows["f16"]["decoder_bytes"]


def check_peer(d):
    rows = d["rows"]
    # without llm-compressor (the smoke row names no venv of it): cortiq's rows alone, and the note that says so
    assert list(rows) == ["f16", "cortiq q8 rtn (default)", "cortiq q4 awq (default)", "cortiq q4 gptq",
                          "cortiq q4 awq, every down_proj q4"], list(rows)
    assert d["peer_skipped"].startswith("llm-compressor rows skipped: no ") and "make peer" in d["peer_skipped"]
    assert all(math.isfinite(v) for r in rows.values() for v in r["nll"].values())
    assert all(set(r["nll"]) == {"own", "unseen", "pydoc", "code", "legal"} for r in rows.values())
    lin = {k: r["linear_bytes"] for k, r in rows.items()}
    assert lin["cortiq q4 awq, every down_proj q4"] < lin["cortiq q4 awq (default)"] < lin["cortiq q8 rtn (default)"] < lin["f16"]


#: script → (extra arguments after --cpu --tiny, the JSON it writes, the check of that JSON), the longest
#: first: the order the benches start in, so that the last to start are short ones. "{work}" is the row's
#: own folder (the benches that take --work default to a fixed folder under /tmp)
BENCHES = {
    # the rows that run heal's other target kinds and memory plans, and compress's two other rankings,
    # run the same command with one option changed: left out here to keep the suite short (the H200
    # check runs them all). --in-process: each command row through cortiq.cli.main in the check's own
    # process, the row's code and the command's the same, without a torch start a row
    "device_check": (["--work", "{work}", "--in-process",
                      "--skip", "heal --target,heal --memory,compress --no-learn-masks,compress --fold-repair"],
                     "device_check.json", check_device_check),
    "heal.relaunch": (["--work", "{work}"], "relaunch.json", check_relaunch),
    "heal.dist": (["--work", "{work}"], "dist.json", check_dist),
    # one prompt kind, two client levels: plain, speculative and auto over chain and tree rounds (the code
    # of the auto and tree modes too), the transformers row, the same code
    "serve.serve": (["--kinds", "chat", "--clients", "2", "--no-hf", "--modes", "plain,speculative,auto-tree"],
                    "serve.json", check_serve),
    # every stage in the check's own process (a torch start a stage costs more than the tiny model's work)
    "scale": (["--work", "{work}", "--in-process"], "scale.json", check_scale),
    # (a second row of one script: NAME+WHAT) the round's cost table alone, on a random tiny geometry
    "serve.serve+cost": (["--step-cost", "tiny", "--clients", "1,2", "--draft-vocab", "100"], "step_cost.json",
                         check_step_cost),
    "quality.codecs": ([], "codecs.json", check_codecs),
    # one target kind at one budget: the same code as every row
    "quality.quality": (["--kinds", "sampled", "--budgets", "0.004", "--default-budget", "0"], "quality.json", check_quality),
    "pipeline.pipeline": (["--work", "{work}"], "pipeline.json", check_pipeline),
    "heal.memory": ([], "memory.json", check_memory),
    "serve.decode": ([], "decode.json", check_decode),
    "mtp.mtp": (["--no-compare-raw"], "mtp.json", check_mtp),
    # the defaults and the row of more windows and asked requests (capped to 200 windows on the CPU)
    "mtp.draft_data": (["--work", "{work}", "--rows", "defaults|asked, 4096 windows"], "draft_data.json", check_draft_data),
    "run": ([], "bench.json", check_run),
    "mtp.selfgen": ([], "selfgen.json", check_selfgen),
    "mtp.draft_vocab": ([], "draft_vocab.json", check_draft_vocab),
    "pipeline.compress": ([], "compress_bench.json", check_compress),
    "quality.llamacpp": ([], "llamacpp.json", check_llamacpp),
    "heal.profile_step": ([], "profile_step.json", check_profile_step),
    "serve.attention": ([], "attention.json", check_attention),
    "heal.variants": ([], "variants.json", check_variants),
    "pipeline.data_build": ([], "data_build.json", check_data_build),
    "quality.excess": ([], "excess.json", check_excess),
    "serve.isolation": ([], "serve-isolation.json", check_serve_isolation),
    # the defaults row and one of the curve, side by side in two processes on one cache (merged in order);
    # the knowledge rows need a model that lists entities, which a tiny random one does not
    "quality.knowledge": (["--rows", "defaults,keep 0.5", "--jobs", "2"], "knowledge.json", check_knowledge),
    "quality.sizes": ([], "sizes.json", check_sizes),
    # the source unchanged, then two large noises
    "quality.noise": (["--alphas", "0,0.5,1", "--seeds", "1"], "noise.json", check_noise),
    "quality.hf_run": ([], "hf_run.json", check_hf_run),
    # llm-compressor is not installed by `make install`: the row runs cortiq's side, the peer's rows skipped
    "quality.peer": (["--peer-python", "{work}/no-llm-compressor/python"], "peer.json", check_peer),
}

#: benches run at once: one a core this process may use (pytest-xdist's workers share them out)
SLOTS = max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


class Benches:
    """The benches of the rows this session runs, started in the background SLOTS at a time in BENCHES'
    order, each in a folder of its own under `root`; `result(name)` waits for one. `close()` stops what
    still runs (an interrupted session leaves no bench behind)."""

    def __init__(self, names: list[str], root: Path):
        self.procs: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()  # close() against a bench starting
        self.closed = False
        self.pool = ThreadPoolExecutor(SLOTS, thread_name_prefix="bench")
        self.root = root
        self.runs = {n: self.pool.submit(self._run, n, root / n) for n in names}

    def _run(self, name: str, d: Path):
        args, result, _ = BENCHES[name]
        out = d / "out"
        for sub in ("home", "tmp", "work"):
            (d / sub).mkdir(parents=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(d / "home"), "TMPDIR": str(d / "tmp"),
               "OUT": str(out), "CORTIQ_HOME": str(d / "cortiq-home"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", f"bench.{name.split('+')[0]}", "--cpu", "--tiny", "--out", str(out),
               *(a.replace("{work}", str(d / "work")) for a in args)]
        with self.lock:
            if self.closed:
                raise RuntimeError("the session ended before this bench started")
            # a session of its own: the whole tree (servers, torchrun's ranks) is stopped with it
            t0 = time.monotonic()
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)
            self.procs[name] = p
        try:
            stdout, stderr = p.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            self._stop(p)
            stdout, stderr = p.communicate()
            stderr += "\n(the smoke test stopped it after 900 s)"
        return p.returncode, stdout, stderr, out / result, time.monotonic() - t0

    @staticmethod
    def _stop(p: subprocess.Popen) -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def result(self, name: str):
        if name not in self.runs:  # a row not known at the start (under pytest-xdist): its bench starts now
            self.runs[name] = self.pool.submit(self._run, name, self.root / name)
        return self.runs[name].result()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            running = [p for p in self.procs.values() if p.poll() is None]
        self.pool.shutdown(wait=False, cancel_futures=True)
        for p in running:
            self._stop(p)


@pytest.fixture(scope="module")
def benches(request, tmp_path_factory):
    # the rows this session runs (an xdist worker holds every row collected, and runs those it is sent)
    names = set() if os.environ.get("PYTEST_XDIST_WORKER") else {
        item.callspec.params["name"] for item in request.session.items
        if item.module is request.module and getattr(item, "originalname", "") == "test_bench_smoke"}
    b = Benches([n for n in BENCHES if n in names], tmp_path_factory.mktemp("benches"))
    yield b
    b.close()


def test_every_bench_has_a_smoke_row():
    scripts = {".".join(p.relative_to(ROOT / "bench").with_suffix("").parts)
               for p in (ROOT / "bench").rglob("*.py") if p.name != "__init__.py"}
    assert scripts - MODULES == {n.split("+")[0] for n in BENCHES}, \
        "a bench/**/*.py without a smoke row (or a row without its script)"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_smoke(name, benches):
    rc, stdout, stderr, result, seconds = benches.result(name)
    assert rc == 0, f"bench.{name} exit {rc} after {seconds:.0f} s:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert re.search(r"\|\s*-{3,}\s*\|", stdout), f"bench.{name} printed no table:\n{stdout[-2000:]}"
    BENCHES[name][2](json.loads(result.read_text()))


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


def test_a_device_check_row_that_exits_is_a_failed_row_and_the_rows_go_on(tmp_path):
    """bench.serve.serve's Server ends with SystemExit when the server does not start: on the H200 (2026-12-04)
    that ended the whole check at the serve row, with no table. A row's exit is its FAIL, the next row runs;
    a signal stops the check, the row recorded as stopped (main then writes the rows done)."""
    import types

    from bench import device_check

    a = types.SimpleNamespace(tiny=True, cpu=True, work=str(tmp_path), fresh=False, only="", skip="")
    c = device_check.Check(a)

    def exits():
        raise SystemExit("bench.serve.serve: the server did not start:\ncortiq: /x/mtp.cmf: no such file")

    def stopped():
        raise KeyboardInterrupt  # what SIGTERM (a call's time limit) becomes in the check

    c.row("serve", exits)
    c.row("next", lambda: "42")
    with pytest.raises(KeyboardInterrupt):
        c.row("heal", stopped)
    assert [(r["command"], r["status"], r["figure"]) for r in c.rows] == [
        ("serve", "FAIL", "SystemExit: cortiq: /x/mtp.cmf: no such file"), ("next", "PASS", "42"),
        ("heal", "STOPPED", "stopped by a signal")]
    # a command run in this process that cortiq ended on a signal (its exit 130) stops the check the same way
    a.in_process = True
    c.in_process = lambda args: (130, "", "cortiq: interrupted")
    with pytest.raises(KeyboardInterrupt):
        c.cortiq("heal", "x.cmf")
    c.in_process = lambda args: (1, "", "cortiq: x.cmf: no such file")
    with pytest.raises(device_check.Failed, match="exit 1: cortiq: x.cmf: no such file"):
        c.cortiq("heal", "x.cmf")


def test_knowledge_kept_by_kind_counts_each_kind_of_the_facts_the_source_knows():
    import numpy as np

    from bench.quality.knowledge import kept_by_kind
    from cortiq.facts.probe import Fact, FactScores

    kinds = ["capital", "capital", "capital", "animal", "animal", "opposite"]
    facts = [Fact(k, f"p{i}", f"a{i}") for i, k in enumerate(kinds)]

    def sc(known):
        return FactScores(np.array(known, bool), np.zeros(len(known)), np.zeros(len(known), np.int64))

    run = {"facts": facts, "scores": {"source": sc([1, 1, 0, 1, 1, 0]), "healed": sc([1, 0, 1, 0, 0, 1])}}
    # the source knows 2 capitals and 2 animals; the healed model keeps one capital (its other known facts
    # are ones the source does not know); a kind the source knows none of is not listed
    assert kept_by_kind(run) == {"healed": {"capital": [1, 2], "animal": [0, 2]}}


def test_knowledge_per_fact_gives_the_source_confidence_and_each_model_known_bits():
    import numpy as np

    from bench.quality.knowledge import per_fact
    from cortiq.facts.probe import FactScores

    def sc(known, lp):
        return FactScores(np.array(known, bool), np.array(lp, float), np.zeros(len(known), np.int64))

    run = {"scores": {"source": sc([1, 0, 1], [-0.123456, -3.0, -0.5]), "healed": sc([0, 1, 1], [-9.0, -1.0, -0.6])}}
    assert per_fact(run) == {"source_logprob": [-0.1235, -3.0, -0.5], "source": "101", "healed": "011"}


def test_knowledge_by_confidence_buckets_kept_facts_by_the_source_probability():
    import math

    from bench.quality.knowledge import by_confidence

    # probabilities 0.3, 0.6, 0.9, 0.99, 1.0 (the last in the top bucket, not past it) and one fact the
    # source does not know, which the healed model does
    lp = [math.log(x) for x in (0.3, 0.6, 0.9, 0.99, 1.0, 0.1)]
    row = {"label": "r", "per_fact": {"held": {"source_logprob": lp, "source": "111110", "healed": "101011"}}}
    assert by_confidence([row]).splitlines()[-1] == "| r | 1/1 | 0/1 | 1/1 | 1/2 | 1 |"


def test_knowledge_row_labels_can_be_named_in_rows():
    # --rows splits on commas: a label holding one could never be chosen
    from bench.quality.knowledge import ROWS
    assert [k for k in ROWS if "," in k] == []
