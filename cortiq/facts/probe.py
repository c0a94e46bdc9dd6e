"""The fact-recall probe: which cloze facts a model knows, and which of its
source's it kept.

A fact is a prompt and its answer ("The capital of France is", "Paris"). The
model knows it when greedy decoding after the prompt writes the answer: every
token of " " + answer is the model's top-1 given the prompt and the answer's
tokens before it (teacher-forced). The whole answer, not its first token alone,
because a tokenizer that splits numbers into digits makes " 1945"'s first token
a bare space, which any year shares.

Perplexity can stay close to the source's while the facts go: a pruned MLP
loses the key-value memories facts live in long before it loses fluency. So
every report scores the facts beside the NLL of held-out text.

The bundled set (facts.tsv beside this file) is for evaluation only. Its two
parts are fixed by a hash of each prompt: `dev` may be looked at while methods
are chosen, `held` gives the figures a method is judged by. No stage trains,
ranks or calibrates on either: `probe_prompts` is what the guards of the
training texts check against.

Scoring is one forward per chunk of facts (right-padded to the chunk's
longest, so no mask is needed under causal attention) and the head only on the
rows that predict an answer token.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import CortiqError

FACTS_FILE = Path(__file__).with_name("facts.tsv")
PARTS = ("dev", "held", "all")


@dataclass(frozen=True)
class Fact:
    kind: str
    prompt: str
    answer: str

    @property
    def part(self) -> str:
        return part_of(self.prompt)


def part_of(prompt: str) -> str:
    """`dev` or `held`, fixed by the prompt's text alone (adding a fact moves no other)."""
    return "held" if hashlib.sha256(prompt.encode()).digest()[0] & 1 else "dev"


def read_facts(path) -> list[Fact]:
    """Facts of a TSV file (kind, prompt, answer; `#` lines are comments). A malformed
    line or a prompt given twice is one clear error naming the file and the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CortiqError(f"{path}: cannot read facts ({e.__class__.__name__}: {e})") from None
    facts, seen = [], {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cols = line.split("\t")
        if len(cols) != 3 or not all(c.strip() for c in cols):
            raise CortiqError(f"{path}:{n}: a fact is three tab-separated fields (kind, prompt, answer)")
        kind, prompt, answer = (c.strip() for c in cols)
        if prompt in seen:
            raise CortiqError(f"{path}:{n}: the prompt {prompt!r} is given twice (first on line {seen[prompt]})")
        seen[prompt] = n
        facts.append(Fact(kind, prompt, answer))
    if not facts:
        raise CortiqError(f"{path}: no facts")
    return facts


@lru_cache(maxsize=1)
def bundled_facts() -> tuple[Fact, ...]:
    return tuple(read_facts(FACTS_FILE))


def load_facts(part: str = "held", path=None) -> list[Fact]:
    """The facts of one part (`dev`, `held`, `all`) of the bundled set, or of a file's."""
    if part not in PARTS:
        raise CortiqError(f"unknown part {part!r} of the fact probe (one of {', '.join(PARTS)})")
    facts = bundled_facts() if path is None else read_facts(path)
    return [f for f in facts if part == "all" or f.part == part]


def normalise(text: str) -> str:
    """Lower case, one space between words: how the guards compare text with the probe."""
    return re.sub(r"\s+", " ", text).strip().lower()


def probe_prompts() -> frozenset[str]:
    """Every bundled prompt, normalised, both parts: what no training text may contain."""
    return frozenset(normalise(f.prompt) for f in bundled_facts())


def holds_probe_fact(text: str, prompts: frozenset[str] | None = None) -> bool:
    """Whether `text` contains one of the probe's prompts (normalised)."""
    prompts = probe_prompts() if prompts is None else prompts
    t = normalise(text)
    return any(p in t for p in prompts)


# ── scoring ──────────────────────────────────────────────────────────────


@dataclass
class Encoded:
    """The facts as token ids: flat ids of every fact back to back, each fact's
    prompt length and answer length."""

    ids: np.ndarray  # [sum of lengths] int64
    prompt_len: np.ndarray  # [N]
    answer_len: np.ndarray  # [N]

    @property
    def lengths(self) -> np.ndarray:
        return self.prompt_len + self.answer_len


def encode_facts(facts: Sequence[Fact], tok) -> Encoded:
    """Prompt and " " + answer tokenized apart (the answer is what greedy decoding
    would write after the prompt). The prompt is raw text with no BOS, as
    `cortiq generate` is given it."""
    if not facts:
        raise CortiqError("no facts to score")
    p_enc = tok.encode_batch([f.prompt for f in facts], add_special_tokens=False)
    a_enc = tok.encode_batch([" " + f.answer for f in facts], add_special_tokens=False)
    pids = [e.ids for e in p_enc]
    aids = [e.ids for e in a_enc]
    empty = [f.answer for f, a in zip(facts, aids) if not a]
    if empty:
        raise CortiqError(f"the answer {empty[0]!r} encodes to no token")
    flat = np.concatenate([np.asarray(p + a, dtype=np.int64) for p, a in zip(pids, aids)])
    return Encoded(flat, np.array([len(p) for p in pids]), np.array([len(a) for a in aids]))


@dataclass
class FactScores:
    """Per fact: known (the whole answer is greedy), the answer's log-prob (summed
    over its tokens) and the model's top-1 token where the answer begins."""

    known: np.ndarray  # [N] bool
    logprob: np.ndarray  # [N] f64
    first_top: np.ndarray  # [N] int64


def _chunks(lengths: np.ndarray, batch_tokens: int) -> list[np.ndarray]:
    """Fact indices sorted by length, cut into chunks whose padded size stays in budget."""
    order = np.argsort(lengths, kind="stable")
    ls = lengths[order]
    out, start = [], 0
    while start < len(order):  # one turn a chunk: a chunk's padded size only grows with its next fact
        padded = np.arange(1, len(order) - start + 1) * ls[start:]
        end = start + max(1, int(np.argmax(padded > batch_tokens)) if (padded > batch_tokens).any() else len(padded))
        out.append(order[start:end])
        start = end
    return out


def _padded(enc: Encoded, sel: np.ndarray, pad_id: int):
    """[B, T] ids of the selected facts, right-padded, and the (row, column) of
    every answer-predicting position with its target, all without a loop over facts."""
    lens = enc.lengths[sel]
    starts = np.concatenate([[0], np.cumsum(enc.lengths)])[sel]
    rows = np.repeat(np.arange(len(sel)), lens)
    cols = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
    ids = np.full((len(sel), int(lens.max())), pad_id, dtype=np.int64)
    ids[rows, cols] = enc.ids[np.repeat(starts, lens) + cols]
    alen = enc.answer_len[sel]
    b = np.repeat(np.arange(len(sel)), alen)
    j = np.arange(alen.sum()) - np.repeat(np.cumsum(alen) - alen, alen)  # answer token index
    t = np.repeat(enc.prompt_len[sel], alen) - 1 + j  # the position that predicts it
    return ids, b, t, ids[b, t + 1]


def score_facts(model, enc: Encoded, batch_tokens: int = 8192, pad_id: int = 0, head_rows: int = 1024) -> FactScores:
    """Score every fact with `model` (a CausalLM): one forward per chunk of facts."""
    import torch

    dev = model.model.embed_tokens.weight.device
    n = len(enc.prompt_len)
    known, logprob, first_top = np.zeros(n, bool), np.zeros(n), np.zeros(n, np.int64)
    with torch.no_grad():
        for sel in _chunks(enc.lengths, batch_tokens):
            ids, b, t, tgt = _padded(enc, sel, pad_id)
            h, _ = model.forward_hidden(torch.from_numpy(ids).to(dev))  # [B, T, H]
            rows = h[torch.from_numpy(b).to(dev), torch.from_numpy(t).to(dev)]  # [R, H]
            lp, top = [], []
            for s in range(0, rows.shape[0], head_rows):
                logp = torch.log_softmax(model.logits(rows[s : s + head_rows]).float(), dim=-1)  # [r, V]
                tg = torch.from_numpy(tgt[s : s + head_rows]).to(dev)
                lp.append(logp.gather(1, tg[:, None]).squeeze(1))
                top.append(logp.argmax(-1))
            lp, top = torch.cat(lp).double().cpu().numpy(), torch.cat(top).cpu().numpy()
            hit = (top == tgt).astype(np.int64)
            first = np.concatenate([[0], np.cumsum(enc.answer_len[sel])[:-1]])
            known[sel] = np.add.reduceat(hit, first) == enc.answer_len[sel]
            logprob[sel] = np.add.reduceat(lp, first)
            first_top[sel] = top[first]
    return FactScores(known, logprob, first_top)


#: a fact the source is *sure of*: its probability of the whole answer is at least this. Many facts a
#: small model knows it knows by a narrow margin (its greedy answer's probability under one half), and
#: those flip first when the weights change; the share kept of the sure ones tells knowledge lost from
#: near-ties gone either way (bench/QUALITY.md, "How sure the source is of what it knows", and "Facts kept
#: under random noise of the same NLL cost": at a heal's NLL cost, random noise keeps most of both)
SURE_P = 0.5


def compare(scores: FactScores, source: FactScores | None) -> dict:
    """One model's line of a report: facts known, and against the source: the facts
    the source knows, how many of those the model keeps, the mean change of the
    answer's log-prob over them, and the same count over the facts the source is sure of (SURE_P)."""
    out = {"facts": int(len(scores.known)), "known": int(scores.known.sum())}
    if source is not None:
        base = source.known
        out["source_known"] = int(base.sum())
        out["kept"] = int((scores.known & base).sum())
        out["kept_share"] = out["kept"] / out["source_known"] if out["source_known"] else None
        out["mean_logprob_change"] = float((scores.logprob - source.logprob)[base].mean()) if base.any() else None
        sure = base & (source.logprob >= np.log(SURE_P))
        out["source_sure"] = int(sure.sum())
        out["sure_kept"] = int((scores.known & sure).sum())
        out["sure_kept_share"] = out["sure_kept"] / out["source_sure"] if out["source_sure"] else None
    return out


def lost_facts(facts: Sequence[Fact], source: FactScores, model: FactScores, now: Sequence[str], n: int) -> list[dict]:
    """Up to `n` of the facts `source` knows and `model` does not, in the probe's order: each one's
    prompt, answer, and `now`, the text of the token the model's answer now begins with."""
    idx = np.flatnonzero(source.known & ~model.known)[:n]
    return [{"prompt": facts[i].prompt, "answer": facts[i].answer, "now": now[i]} for i in idx]


def first_tokens(scores: FactScores, tok) -> list[str]:
    """Per fact, the text of the model's top-1 token where the answer begins."""
    return [tok.decode([int(t)]) for t in scores.first_top]


def kept_line(name: str, c: dict) -> str:
    """`facts kept: 150 of the source's 180 (83.3 %), ..., mean change of the answer's log-prob -0.41; of the 90
    the source is sure of (answer p >= 0.5): 86 (95.6 %)`."""
    if c.get("kept_share") is None:
        return f"{name}: knows {c['known']} of {c['facts']} facts"
    return (f"{name}: facts kept {c['kept']} of the source's {c['source_known']} ({100 * c['kept_share']:.1f} %), "
            f"knows {c['known']} of {c['facts']}, mean change of the answer's log-prob "
            f"{c['mean_logprob_change']:+.2f}{sure_part(c, digits=1)}")


def sure_part(c: dict, who: str = "", digits: int = 0) -> str:
    """`; of the 90 the source is sure of (answer p >= 0.5): healed 86 (96 %)` of a compare() line (`who`
    names the model), or "" where the source knows none it is sure of or was not compared."""
    if c.get("sure_kept_share") is None:
        return ""
    return (f"; of the {c['source_sure']} the source is sure of (answer p >= {SURE_P:g}): {who}{c['sure_kept']} "
            f"({100 * c['sure_kept_share']:.{digits}f} %)")


def probe_models(models: dict, source: str | None = "source", part: str = "held", facts: Sequence[Fact] | None = None,
          device: str = "auto", batch_tokens: int = 8192, progress: bool = True) -> dict:
    """Score each model ({name: CMF path, CmfFile or loaded CausalLM}; all of one
    tokenizer) on the facts of `part` and compare it with the model named `source`
    (None: no comparison): {name: compare(...)}, plus `per_fact` scores."""
    import sys

    import torch
    from tqdm import tqdm

    from ..cmf import CmfFile, open_cmf
    from ..devices import resolve_device
    from ..model import load_model
    from ..tokenizer import from_doc

    facts = list(load_facts(part) if facts is None else facts)
    first = next(iter(models.values()))
    f = first.source if isinstance(first, torch.nn.Module) else first if isinstance(first, CmfFile) else open_cmf(first)
    enc = encode_facts(facts, from_doc(f.tokenizer, str(f.path)))
    dev = resolve_device(device, "facts")
    scores = {}
    for name, m in tqdm(models.items(), desc=f"facts ({part}, {len(facts)})", unit="model", disable=not progress,
                        file=sys.stderr, leave=False):
        model = m.to(dev) if isinstance(m, torch.nn.Module) else load_model(m, dtype=torch.float32, device=dev)
        scores[name] = score_facts(model, enc, batch_tokens, pad_id=f.eos_id)
        del model
    base = scores.get(source) if source else None
    out = {name: compare(s, None if name == source else base) for name, s in scores.items()}
    return {"part": part, "models": out, "scores": scores, "facts": facts}
