"""Retain data: text the smaller model must keep serving, mixed into the user's data.

A compress or heal on the user's text alone ranks neurons by that text and
heals on it, and the model loses what everything else needs. The mix puts a
share of other text into every batch of the masks, the Grams and the heal:

- `retain_tdata` (cortiq.data.stages, with the chain `with_retain`) makes one
  retain source a tdata directory: a bundled corpus (built by the data stage
  with the source model's tokenizer), any tdata directory, or `self` (the
  source model's own generations, the selfgen stage);
- the `mix` stage (`mix_tdata`, here) writes one tdata directory holding the
  user's records (all splits) and each retain source's train and val records;
  its test records stay out, never trained on: they are the general panel a
  report scores;
- `mix_windows` (what `cortiq.data.windowing` does with such a directory) cuts
  each source's records into windows on their own, takes every user window
  once and a seeded sample of each retain source's (repeated when it has too
  few) so the counts per source over an epoch are exact, and interleaves them
  evenly: any run of B consecutive windows holds each source's share of B to
  within one window, so every batch of every stage sees the mix.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import store
from ..errors import CortiqError
from .settings import AUTO, AUTO_CPU, AUTO_GPU, KNOWLEDGE, SELF, RetainSettings
from .tdata import STAGE, VERSION, Record, Tdata, records_table


#: the user's data among the mix's sources
USER = "data"
#: the splits of a retain source that join the mix (its test split is the panel)
MIXED_SPLITS = ("train", "val")


# ── the mix directory ────────────────────────────────────────────────────


def source_name(spec: str) -> str:
    """A retain source's short name in reports: pydoc, shakespeare, self, a tdata directory's name."""
    if spec.startswith("corpus:"):
        return spec.split(":", 1)[1]
    if spec in (SELF, KNOWLEDGE):
        return spec
    return Path(spec).name.removesuffix(".tdata") or spec


def mix_tdata(tdata_dir, retain: list, names: list[str], settings: RetainSettings, out, digest: str) -> dict:
    """Write the mix directory `out`: the user's tdata records, then each retain tdata's
    train and val records (rids prefixed by the source's name); meta `mix` says where
    each source's records start, and the share and seed the windows are drawn with."""
    weight = settings.weight_of()
    unknown = sorted(set(weight) - set(names))
    if unknown:
        raise CortiqError(f"retain settings: a weight for {', '.join(unknown)}, which is not a retain source here "
                          f"(the sources: {', '.join(names) or 'none'})")
    user = Tdata.open(tdata_dir)
    records = user.records()
    starts = [0]
    for path, name in zip(retain, names):
        td = Tdata.open(path)
        if td.meta["tokenizer_digest"] != user.meta["tokenizer_digest"]:
            raise CortiqError(f"{path}: retain data tokenized with another tokenizer than {tdata_dir} "
                              f"({td.meta['tokenizer_digest'][:12]} vs {user.meta['tokenizer_digest'][:12]})")
        starts.append(len(records))
        mine = [r for r in td.records() if r.split in MIXED_SPLITS]
        if not any(r.split == "train" for r in mine):
            raise CortiqError(f"{path}: retain source {name} has no train records")
        records += [Record(f"retain/{name}/{r.rid}", r.split, r.category, r.ids, r.first) for r in mine]
    table = records_table(records)
    meta = {k: user.meta[k] for k in ("tokenizer_digest", "vocab_size", "eos_id", "bos_id")}
    meta.update({"stage": STAGE, "version": VERSION, "digest": digest,
                 "mix": {"names": [USER, *names], "rows": starts, "share": settings.share, "seed": settings.seed,
                         "weights": [weight.get(n, 1.0) for n in names]},
                 "inputs": {"tdata": str(tdata_dir), "retain": [str(p) for p in retain]}})
    with store.stage_dir(Path(out), meta) as part:
        store.write_arrow(part / "tdata.arrow", table)
        meta["counts"] = Tdata(part, meta, table).counts()
    return {"metrics": {f"mix.records.{n}": float(b - a) for n, a, b in
                        zip(meta["mix"]["names"], starts, starts[1:] + [len(records)])}}


# ── retain sources ───────────────────────────────────────────────────────

def resolve_sources(sources: list[str], cuda: bool | None = None) -> list[str]:
    """The sources with `auto` replaced by what it stands for here (AUTO_GPU where the device
    "auto" is CUDA, as the self source's sampling resolves it; else AUTO_CPU), in place, each
    source once. The stages downstream are keyed by the retain tdata they read, so a run on a
    GPU and one on a CPU never share a mix."""
    if AUTO not in sources:
        return list(sources)
    if cuda is None:
        from ..devices import resolve_device

        cuda = resolve_device("auto").type == "cuda"
    out: list[str] = []
    for s in sources:
        for x in (AUTO_GPU if cuda else AUTO_CPU) if s == AUTO else (s,):
            if x not in out:
                out.append(x)
    return out


def folders(sources: list[str]) -> list[str]:
    """The retain sources that name tdata directories (not corpus:NAME, self, knowledge or auto):
    inputs of the command, which no output may replace."""
    return [s for s in sources if s not in (SELF, KNOWLEDGE, AUTO) and not s.startswith("corpus:")]


def check_not_data(tdata_dir, sources: list[str]) -> None:
    """A retain source that is the data itself (its folder under any spelling, or a copy of the
    same build) is refused: its test split would be reported as a general panel of other text
    that was never trained on, when the heal trained on the rest of that very text."""
    mine = Path(tdata_dir)
    own = store.read_meta(mine).get("digest") if store.is_complete(mine) else None
    for s in folders(sources):
        same = store.same_place(Path(s), mine)
        if not same and own is not None and store.is_complete(s):
            same = store.read_meta(s).get("digest") == own
        if same:
            raise CortiqError(f"retain source {s}: it is the data {tdata_dir} itself, whose test split would be "
                              "reported as a general panel never trained on; give a retain source of other text")


def other_sources(tdata_dir, sources: list[str]) -> list[str]:
    """The retain sources less the corpora the user's data is built from (the default, pydoc,
    is the flows' default data too): such a source is not other text, and its records, cut
    another way, would put text of the data's test split into the train windows."""
    check_not_data(tdata_dir, sources)
    sources = resolve_sources(sources)
    built = set(Tdata.open(tdata_dir).meta.get("inputs", {}).get("sources") or ())
    left = [s for s in sources if not (s.startswith("corpus:") and s in built)]
    for s in sources:
        if s not in left:
            print(f"retain: {s} left out: {tdata_dir} is built from it", file=sys.stderr)
    return left
