"""Tiny models, a small decode driver and a server in a subprocess, shared by the serve tests:
a CMF file with a byte tokenizer, a chat template and an MTP draft, and `cortiq serve` on it
on a free 127.0.0.1 port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from cortiq.arch import FULL, LINEAR, Arch

V = 259  # the byte tokenizer's vocabulary (256 bytes + 3 specials)


def arch(kind: str = "llama", mtp: bool = True, tie: bool = False) -> Arch:
    common = dict(vocab_size=V, hidden_size=32, num_layers=2, intermediate_sizes=[40, 56], num_heads=4,
                  num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  mtp_layers=1 if mtp else 0, max_position_embeddings=256)
    if kind == "llama":
        return Arch(arch_name="llama", **common)
    if kind == "qwen3":  # q/k norms, q/k/v bias, partial rotary, output gate, offset norms
        return Arch(arch_name="qwen3", qk_norm=True, attention_bias=True, partial_rotary_factor=0.5,
                    attn_output_gate=True, norm_style="offset", **common)
    if kind == "hybrid":  # a Gated DeltaNet layer then a full-attention one
        common["num_layers"] = 2
        return Arch(arch_name="qwen3_5", layer_types=[LINEAR, FULL], linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, qk_norm=True,
                    norm_style="offset", **common)
    raise ValueError(kind)


def random_model(a: Arch, seed: int = 0, mix: float = 0.0):
    """A CausalLM with random weights that keep activations O(1). mix > 0: a
    model whose drafts are right in some rounds and wrong in others — the trunk
    is near a bigram map (its layers add mix times their usual output to the
    embedding), the MTP block passes the next token's embedding through plus
    noise, so it guesses the trunk's next-next token often but not always."""
    from cortiq.model import CausalLM

    torch.manual_seed(seed)
    m = CausalLM(a)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_((0.0 if a.norm_style == "offset" else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if "embed" not in n else 1.0))
        if mix:
            for n, p in m.named_parameters():
                if n.endswith(("o_proj.weight", "down_proj.weight", "out_proj.weight")):
                    p.mul_(mix)
            if m.mtp is not None:
                H = a.hidden_size
                m.mtp.eh_proj.weight.mul_(0.3)
                m.mtp.eh_proj.weight[:, :H] += torch.eye(H)
    return m.eval()


def drive(engine, prompts, max_new: int, speculative: bool = False, joins=None):
    """Decode every prompt greedily through `engine`, prompt i joining at step
    joins[i] (default: all at once), or once a slot is free, into the lowest free slot and leaving when
    it has max_new tokens -> (tokens per prompt, tokens decided per round per prompt).
    speculative="alternate": speculative rounds and plain steps take turns."""
    joins = joins or [0] * len(prompts)
    out = [[] for _ in prompts]
    rounds = [[] for _ in prompts]
    slot_of, nxt, free = {}, {}, list(range(engine.max_batch))
    done, t = set(), 0
    while len(done) < len(prompts):
        for i, p in enumerate(prompts):
            if joins[i] <= t and i not in slot_of and free:
                s = free.pop(0)
                slot_of[i] = s
                nxt[i] = int(engine.prefill(s, p).argmax())
                out[i].append(nxt[i])
        live = [i for i in slot_of if i not in done and len(out[i]) < max_new]
        for i in list(slot_of):
            if i not in done and len(out[i]) >= max_new:
                done.add(i)
                engine.release(slot_of[i])
                free.append(slot_of[i])
                free.sort()
        if live:
            slots = [slot_of[i] for i in live]
            toks = [nxt[i] for i in live]
            if speculative and (speculative != "alternate" or t % 2 == 0):
                for i, new in zip(live, engine.speculate(slots, toks)):
                    rounds[i].append(len(new))
                    out[i].extend(new)
                    nxt[i] = new[-1]
            else:
                for i, row in zip(live, engine.step(slots, toks)):
                    nxt[i] = int(row.argmax())
                    out[i].append(nxt[i])
        t += 1
        if t > 10 * max_new + max(joins) + 10:
            raise RuntimeError("drive: no progress")
    return [o[:max_new] for o in out], rounds



class Replay:
    """A CPU stand-in for a captured graph: each replay runs the body again, on the buffers as
    they are then (what a replay of the recorded kernels reads)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self):
        self.replays += 1
        self.fn()


def stand_in_graphs(m, slots: int, max_len: int, monkeypatch, **kw):
    """A `DecodeAdapter` whose bucket and staged prefill graphs are 'captured' on a CPU by the same
    calls as on CUDA (`DecodeEngine._capture` without the CUDA graph: 2 warm-ups, then the record)
    and replayed by re-running their bodies: the server's CUDA path, CPU-tested -> (adapter, every
    stand-in graph)."""
    from cortiq.model.decode import DecodeEngine, StagedPrefill
    from cortiq.serve.engine import DecodeAdapter

    graphs = []

    def capture(self, fn, pool=None):
        for _ in range(3):
            fn()
        graphs.append(Replay(fn))
        return graphs[-1]

    monkeypatch.setattr(DecodeEngine, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    eng = DecodeAdapter(m, slots, max_len, graphs=False, **kw)
    eng.eng.graphs = True
    eng.eng._capture_steps(bucketed=True)
    eng.staged = StagedPrefill(eng.eng)
    return eng, graphs

ROOT = Path(__file__).resolve().parents[2]
EOS = 256
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_model(path: Path) -> Path:
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    m = random_model(arch("llama"), seed=5, mix=0.5)
    doc = new_doc(m.arch, tokenizer_doc(byte_tokenizer_json(), [EOS], chat_template=CHATML))
    return write_cmf(path, doc, specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32"))


class Server:
    """`cortiq serve` in a subprocess; `stop()` sends SIGTERM and returns the exit status."""

    def __init__(self, model: Path, log: Path, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = log
        self._err = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "cortiq", "serve", str(model), "--port", "0",
                                      "--device", "cpu", *args], stdout=subprocess.DEVNULL, stderr=self._err,
                                     env=env, cwd=ROOT)
        deadline = time.monotonic() + 180
        while True:
            text = log.read_text()
            if "listening on " in text:
                self.url = text.split("listening on ", 1)[1].split()[0]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"cortiq serve did not start:\n{text}")
            time.sleep(0.1)

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="none", max_retries=0, timeout=120)

    def stop(self, timeout: float = 60) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._err.close()
