"""The fact probe as a stage: each model's per-fact scores, cached by the model's digest, so
a report compares pruned and healed with their source without scoring the source twice."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from .. import store
from ..runner import Stage
from .probe import FactScores, compare, sure_part
from .settings import ProbeSettings

#: the file of a facts stage output that holds its per-fact scores
SCORES = "facts.json"


#: how many of the facts a model lost a report names, beside the counts
LOST_SHOWN = 3


def _facts(out, ctx, model, settings: ProbeSettings) -> dict:
    from ..cmf import open_cmf
    from ..tokenizer import from_doc
    from .probe import first_tokens, probe_models

    s = settings
    r = probe_models({"model": model}, source=None, part=s.part, device=s.device, progress=ctx.progress)
    sc = r["scores"]["model"]
    metrics = {"facts": float(len(sc.known)), "known": float(sc.known.sum())}
    now = first_tokens(sc, from_doc(open_cmf(model).tokenizer, str(model)))
    with store.stage_dir(out, {"stage": FACTS.name, "digest": ctx.digest, "metrics": metrics}) as d:
        (d / SCORES).write_text(json.dumps({"part": s.part, "known": sc.known.tolist(), "logprob": sc.logprob.tolist(),
                                            "first_top": sc.first_top.tolist(), "now": now}))
    return {"metrics": metrics}


FACTS = Stage("facts", 2, _facts, ProbeSettings, ("model",),
              doc="which facts of the fact probe a model knows (per fact: known, the answer's log-prob, the "
                  "token its answer begins with)")


def read_scores(path) -> tuple[FactScores, list[str]]:
    """A facts stage output's scores, and per fact the text its answer now begins with."""
    d = json.loads((Path(path) / SCORES).read_text())
    sc = FactScores(np.asarray(d["known"], dtype=bool), np.asarray(d["logprob"], dtype=np.float64),
                    np.asarray(d["first_top"], dtype=np.int64))
    return sc, d["now"]


def facts_chain(runner, models: dict[str, str], settings: ProbeSettings | None = None) -> dict[str, dict]:
    """The facts stage on each model ({label: CMF}; one labelled "source" is the others'
    reference, run as `facts.` + label) -> `facts_from` its results."""
    s = settings or ProbeSettings()
    for label, m in models.items():
        runner.run(FACTS, f"facts.{label}", model=str(m), settings=dataclasses.asdict(s))
    return facts_from(runner.results, tuple(models), s.part)


def facts_from(results: dict, labels: tuple[str, ...] = ("source", "pruned", "healed"), part: str = "held") -> dict:
    """{label: compare(...)} of the facts stages run (results "facts.<label>"), each against the
    source's when it ran, for every label but the source's, with `lost`: the first LOST_SHOWN
    facts the source knows that the model lost (probe.lost_facts); {} when none ran."""
    from .probe import load_facts, lost_facts

    scores = {label: read_scores(results[f"facts.{label}"]["path"]) for label in labels if f"facts.{label}" in results}
    base = scores.get("source")
    facts = load_facts(part) if base is not None else None
    return {label: {"part": part, **compare(sc, None if base is None else base[0]),
                    **({} if base is None else {"lost": lost_facts(facts, base[0], sc, now, LOST_SHOWN)})}
            for label, (sc, now) in scores.items() if label != "source"}


def facts_line(facts: dict[str, dict]) -> str:
    """`facts kept (the fact probe's held part, 201 facts): pruned 34 of the source's 115 (30 %), healed 78 (68 %)`,
    and a second line naming the facts the last model lost, where facts_from listed them."""
    if not facts:
        return ""
    first = next(iter(facts.values()))
    head = f"facts kept (the fact probe's {first['part']} part, {first['facts']} facts): "
    if first.get("source_known") is None:
        return head.replace("facts kept", "facts known") + ", ".join(f"{k} {c['known']}" for k, c in facts.items())
    parts = [f"{label} {c['kept']}" + (f" of the source's {c['source_known']}" if i == 0 else "")
             + (f" ({100 * c['kept_share']:.0f} %)" if c["kept_share"] is not None else "")
             for i, (label, c) in enumerate(facts.items())]
    label, last = list(facts.items())[-1]
    sure = sure_part(last, f"{label} ")
    lost = "; ".join(f"{x['prompt']} {x['answer']} (now {x['now'].strip()!r})" for x in last.get("lost") or ())
    return head + ", ".join(parts) + sure + (f"\n  {label} lost, among others: {lost}" if lost else "")
