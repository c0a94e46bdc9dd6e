"""Knowledge retain data: what the source model knows, written by the source itself.

A fold removes the MLP neurons its calibration text does not use, and the MLPs
hold a model's facts as key-value memories: text that never asks for a fact
ranks that fact's neurons low, and a heal on such text never brings them back,
while the NLL of ordinary text barely moves. This source puts knowledge-bearing
text into the mix, data-free:

1. entities: the source lists them itself, one sampled list per opening
   ("A list of countries of the world:\\n1."), for each bundled category
   (countries, writers, novels, elements, animals, ...); each list line's name
   is parsed out and kept once;
2. prompts: each entity fills its category's relation templates ("The capital
   of {X} is", "{X} was written by") and an open lead ("{X} is");
3. answers: the source completes each prompt greedily, up to a sentence's end:
   its own top answer, right or wrong, is what the student must keep.

Only the templates and the list openings are bundled; every entity and every
answer comes from the source. A prompt or a row that contains a prompt of the
fact probe (cortiq.facts) is dropped, so the probe stays held out.

Each record is its prompt (not scored) and the completion (scored), split
train/val/test by a hash of the record id; its test records join the panel.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import numpy as np

from ..errors import CortiqError
from ..settings_meta import check, setting
from .settings import DEFAULT_SLOTS, split_fractions

#: a category: the opening its lists are sampled from, and the prompts each entity fills
#: (`{X}`). Relations of common knowledge; the lead `{X} is` is added to every category.
CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "country": ("countries of the world", ("The capital of {X} is", "The official language of {X} is",
                                           "The currency of {X} is the", "{X} is a country located in")),
    "city": ("major cities of the world", ("{X} is a city in the country of", "{X} is located on the continent of")),
    "writer": ("famous writers and novelists", ("{X} is best known for writing", "{X} was born in the country of")),
    "book": ("famous novels and books", ("{X} is a novel written by", "The book {X} was written by")),
    "scientist": ("famous scientists", ("{X} is famous for discovering", "{X} was a scientist from")),
    "invention": ("important inventions in history", ("{X} was invented by", "{X} was first invented in the year")),
    "element": ("chemical elements", ("The chemical symbol of {X} is", "The atomic number of {X} is")),
    "compound": ("common chemical compounds", ("The chemical formula for {X} is",)),
    "planet": ("planets and moons of the solar system", ("{X} is the planet or moon that",)),
    "animal": ("animals", ("A baby {X} is called a", "{X} live in", "{X} eat")),
    "painter": ("famous painters and composers", ("{X} is best known for the work", "{X} was born in the country of")),
    "event": ("important events in world history", ("{X} took place in the year", "{X} happened in the country of")),
    "leader": ("famous kings, queens and presidents", ("{X} was the leader of", "{X} ruled in the century")),
    "river": ("rivers, mountains and deserts of the world", ("{X} is located in", "{X} is on the continent of")),
    "word": ("English adjectives", ("The opposite of {X} is", "A word that means the same as {X} is")),
    "food": ("foods and drinks", ("{X} is made from", "{X} comes from the country of")),
    "sport": ("sports and games", ("{X} is played with", "The number of players on a {X} team is")),
    "body": ("parts of the human body", ("The {X} is the organ that", "The human body has")),
    "science": ("units and laws of physics", ("{X} is a unit of", "{X} was named after")),
    "language": ("languages of the world", ("{X} is spoken mainly in", "{X} is written in the alphabet")),
    "landmark": ("famous buildings and landmarks", ("{X} is located in the city of", "{X} was built in the year")),
    "object": ("everyday things and their colors", ("The color of {X} is", "{X} is usually made of")),
    "calendar": ("the months of the year and the days of the week", ("The month after {X} is",
                                                                     "The day after {X} is")),
    "shape": ("geometric shapes", ("The number of sides of a {X} is", "A {X} has")),
    "job": ("jobs and professions", ("A {X} works in a", "A {X} uses a")),
}

LEAD = "{X} is"

#: how a list opening is worded (one list is sampled per opening and per seed)
LIST_OPENING = "A list of {what}:\n1."

#: a list line: an optional number, then the name up to a separator
_LINE = re.compile(r"^\s*(?:\d+[.)]\s*)?([^\n:(\[,;–—-]+)")
_NAME = re.compile(r"^[A-Za-zÀ-ÿ][A-Za-zÀ-ÿ0-9'’. &-]*$")


@dataclass
class KnowledgeSettings:
    """The source's own knowledge as retain data (cortiq.data.knowledge)."""

    seed: int = setting(0, "seed of the list sampling and the split")
    lists: int = setting(6, "lists sampled per category (each names up to about list_tokens / 4 entities)", lo=1,
                         hi=1024)
    list_tokens: int = setting(192, "tokens a sampled list runs to", lo=8, hi=4096)
    #: the lists are samples, so that each opening gives other entities; the answers are greedy
    temperature: float = setting(0.8, "sampling temperature of the lists (the answers are greedy)", gt=0)
    entities: int = setting(64, "most entities kept per category", lo=1, hi=1 << 16)
    answer_tokens: int = setting(24, "most tokens of a template's answer (a newline ends it sooner)", lo=1, hi=4096)
    lead_tokens: int = setting(48, "most tokens of a lead's answer ('{X} is ...')", lo=1, hi=4096)
    fractions: tuple[float, float, float] = setting((0.9, 0.05, 0.05), "split fractions of the records (by a hash "
                                                    "of the record id)", metavar="TRAIN,VAL,TEST")
    slots: int = setting(DEFAULT_SLOTS, "rows decoded at once (engine slots)", lo=1, hi=1 << 16)
    device: str = setting("auto", "auto (CUDA when present), cpu, cuda, cuda:N", how=True)

    def __post_init__(self):
        self.fractions = split_fractions(self.fractions, "knowledge settings")
        check(self, "knowledge settings")


def parse_entities(text: str) -> list[str]:
    """The names of a numbered list the model wrote ("France\\n2. Germany - ..."), each once,
    in order: the text of each line before a separator, 1 to 5 words of letters."""
    out, seen = [], set()
    for line in text.split("\n"):
        m = _LINE.match(line)
        if not m:
            continue
        name = m.group(1).strip().strip(".*\"'")
        if not name or not _NAME.match(name) or len(name.split()) > 5 or len(name) < 2:
            continue
        key = name.lower()
        if key not in seen:
            seen.add(key)
            out.append(name)
    return out


def fill(entities: dict[str, list[str]]) -> list[tuple[str, str, bool]]:
    """(category, prompt, whether it is the lead) for every entity and every template of its
    category, and its lead."""
    return [(cat, t.replace("{X}", e), t == LEAD) for cat, names in entities.items()
            for e in names for t in (*CATEGORIES[cat][1], LEAD)]


def first_line(text: str) -> str:
    """An answer up to its line's end: the model's sentence, not what it rambles on to."""
    return text.split("\n", 1)[0]


# ── the stage ────────────────────────────────────────────────────────────

#: the knowledge stage's name, which its tdata's meta names as what generated it
STAGE_NAME = "knowledge"


def _entities(m, tok, eos, s: KnowledgeSettings, progress: bool) -> dict[str, list[str]]:
    from .selfgen import generate_rows

    cats = list(CATEGORIES)
    openings = [tok.encode(LIST_OPENING.format(what=CATEGORIES[c][0]), add_special_tokens=False).ids
                for c in cats for _ in range(s.lists)]
    rows = generate_rows(m, openings, s.list_tokens, temperature=s.temperature, eos_ids=eos, slots=s.slots,
                         seed=s.seed, progress=progress, desc="knowledge lists")
    texts = tok.decode_batch([r.tolist() for r in rows], skip_special_tokens=True)
    out: dict[str, list[str]] = {c: [] for c in cats}
    for i, t in enumerate(texts):
        c = cats[i // s.lists]
        names = out[c]
        for e in parse_entities(t):
            if len(names) < s.entities and e.lower() not in {n.lower() for n in names}:
                names.append(e)
    return out


def write_knowledge_tdata(out, digest: str, model, settings: KnowledgeSettings, progress: bool = True) -> dict:
    """The knowledge stage's output at `out`: the model's answers to relation prompts about the
    entities it lists, as tdata named by `digest` (cortiq.data.stages declares the stage)."""
    from ..cmf import open_cmf
    from ..devices import resolve_compute, resolve_device
    from ..facts import holds_probe_fact, probe_prompts
    from ..model import load_model
    from ..tokenizer import from_doc
    from .selfgen import generate_rows
    from .tdata import STAGE, VERSION as TDATA_VERSION, Record, assign_splits, tokenizer_digest, write_tdata

    s = settings
    f = open_cmf(model)
    doc = f.tokenizer or {}
    if not doc.get("json"):
        raise CortiqError(f"{f.path}: carries no tokenizer; its knowledge cannot be made into data")
    tok = from_doc(doc, str(f.path))
    eos = list(doc.get("eos_ids") or [f.eos_id])
    dev = resolve_device(s.device, "knowledge")
    m = load_model(f, dtype=resolve_compute("auto", dev), device=dev)
    ents = _entities(m, tok, eos, s, progress)
    held = probe_prompts()
    prompts = [x for x in fill(ents) if not holds_probe_fact(x[1], held)]
    if not prompts:
        raise CortiqError(f"{f.path}: the model listed no entity the knowledge templates could take")
    p_ids = [e.ids for e in tok.encode_batch([p for _, p, _ in prompts], add_special_tokens=False)]
    budgets = [s.lead_tokens if lead else s.answer_tokens for _, _, lead in prompts]
    new = generate_rows(m, p_ids, budgets, temperature=0.0, eos_ids=eos, slots=s.slots, seed=s.seed,
                        progress=progress, desc="knowledge answers")
    answers = [first_line(t) for t in tok.decode_batch([g.tolist() for g in new], skip_special_tokens=True)]
    keep = [i for i, a in enumerate(answers) if a.strip() and not holds_probe_fact(prompts[i][1] + a, held)]
    a_ids = [e.ids for e in tok.encode_batch([answers[i] for i in keep], add_special_tokens=False)]
    rids = [f"knowledge:{i}" for i in keep]
    splits = assign_splits(rids, [None] * len(keep), s.fractions)
    records = [Record(r, sp, f"knowledge-{prompts[i][0]}",
                      np.asarray(p_ids[i] + a, dtype=np.uint32), len(p_ids[i]))
               for r, sp, i, a in zip(rids, splits, keep, a_ids) if a]
    meta = {"stage": STAGE, "version": TDATA_VERSION, "digest": digest, "settings": dataclasses.asdict(s),
            "inputs": {"model": str(model), "generated_by": STAGE_NAME},
            "tokenizer_digest": tokenizer_digest(doc["json"]), "vocab_size": f.arch.vocab_size, "eos_id": f.eos_id,
            "bos_id": doc.get("bos_id")}
    td = write_tdata(out, records, meta)
    return {"metrics": {"records": float(len(td)), "entities": float(sum(len(v) for v in ents.values())),
                        "prompts": float(len(prompts)), "tokens": float(sum(len(r.ids) - r.first for r in records))}}
