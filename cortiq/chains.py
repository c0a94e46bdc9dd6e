"""A parameter set's chains, as the flows and `cortiq demo` run them: a line per stage or sub-chain.

A chain calls `runner.run(stage, key=None, **params)` for each stage and passes the
outputs' paths on; `runner.results` keeps each run's result under its key. The command
line passes `cortiq.runner.LocalRunner`, the flows their Prefect runner
(`flows.common.Stages`: each stage a cached task): one list of stages, one cache under
the cortiq home's `work/`, whichever runs first.

Each package's own chain sits beside its stages, in its stages.py:
- `compress.stages.compress_chain`: masks → grams (for the repair, an activation ranking or GPTQ) → fold → gptq;
- `heal.stages.heal_chain`: teacher targets → frozen prefix (when the tail trains alone) → train → export;
- `mtp.stages.mtp_chain`: mtp init (a model without a draft) → trunk pass → draft training;
- `quant.stages.quantize_chain`: qgrams → quantize;
- `data.stages.with_retain`: each retain source (data or selfgen) → mix;
- `measure.score_chain`: the score stage for each model on each named text.

Adding a stage: declare it in its package's stages.py and add its line to its chain; the
command line and every flow run it from then on.
"""

from __future__ import annotations

import dataclasses

from .cmf import open_cmf
from .compress.stages import compress_chain
from .convert.stages import SOURCE, source_kind
from .data.stages import DATA, with_retain
from .heal.stages import heal_chain
from .facts.settings import ProbeSettings
from .facts.stages import facts_chain
from .measure import REENCODE, SCORE, ScoreSettings, Text, score_chain, scored_texts
from .mtp.stages import mtp_chain
from .quant.settings import check_window
from .quant.stages import quantize_chain, uses_grams
from .settings import PipelineSettings


@dataclasses.dataclass
class Made:
    """What a parameter set's chain made so far (paths), and the texts it scores on."""

    source: str
    tdata: str
    mixed: str
    panel: dict
    student: str
    healed: str | None = None
    texts: list = dataclasses.field(default_factory=list)


def compress_and_heal(runner, s: PipelineSettings) -> tuple[str, Made]:
    """The whole pipeline: returns (the final model, what was made)."""
    m = student(runner, s)  # source → data → retain mix → masks → grams → fold → gptq
    m.healed = heal_chain(runner, m.source, m.student, m.mixed, s.heal)  # targets → prefix → train → export
    m.texts = score_models(runner, s, m)  # source, pruned and healed on the data, the panel, data.eval_sources
    final = mtp_chain(runner, m.healed, m.tdata, s.mtp) if s.mtp_enabled else m.healed  # mtp init → trunk → mtp
    reencode_chain(runner, final, m.tdata, s.codecs, s.quant, s.heal.qat_codec, m.texts)  # each codec, scored
    return final, m


def student(runner, s: PipelineSettings) -> Made:
    """source → data → retain mix → compress: the opening of every flow that compresses."""
    source, tdata = source_and_data(runner, s)
    check_window(s.quant, open_cmf(source).arch, source)  # the re-encode's bound, before hours of compress and heal
    mixed, panel = with_retain(tdata, source, s.retain, runner.run, None, progress=False)
    return Made(source, tdata, mixed, panel, compress_chain(runner, source, mixed, s.compress))


def healed(runner, s: PipelineSettings) -> Made:
    """`student`, then heal (on the data with the retain sources mixed in) and the scores."""
    m = student(runner, s)
    m.healed = heal_chain(runner, m.source, m.student, m.mixed, s.heal)
    m.texts = score_models(runner, s, m)
    return m


def mtp_only(runner, s: PipelineSettings) -> str:
    """mtp-heal on a parameter set: its source and data, the draft healed, each codec scored on the data."""
    source, tdata = source_and_data(runner, s)
    final = mtp_chain(runner, source, tdata, s.mtp)
    reencode_chain(runner, final, tdata, s.codecs, s.quant, s.heal.qat_codec, [data_text(s, tdata)])
    return final


# ── the sub-chains ───────────────────────────────────────────────────────


def source_and_data(runner, s: PipelineSettings) -> tuple[str, str]:
    """(the source as a CMF: a .cmf where it is, anything else converted once; the tdata of the
    parameter set's sources, tokenized with its tokenizer)."""
    source = s.source if source_kind(s.source) == "cmf" else runner.run(SOURCE, source=s.source)["path"]
    tdata = runner.run(DATA, sources=s.data.sources, model=source, settings=s.data.build_settings())["path"]
    return source, tdata


def score_models(runner, s: PipelineSettings, m: Made) -> list[Text]:
    """Source, pruned and healed scored on the data's test split and each retain source's (the
    general panel) and on the fact probe, then on every record of data.eval_sources when the parameter set names them
    (their data stage runs after the other scores). Returns the texts scored."""
    models = {"source": m.source, "pruned": m.student, "healed": m.healed}
    texts = scored_texts(_score_how(s), data=(m.tdata, DATA_LABEL), panel=m.panel)
    score_chain(runner, models, texts)
    facts_chain(runner, models, ProbeSettings(device=_score_how(s).device))  # facts kept of the source's
    ev = s.data.eval_sources
    if ev:
        etd = runner.run(DATA, "data.eval", sources=ev, model=m.source, settings=s.data.build_settings())["path"]
        more = scored_texts(_score_how(s), eval=("eval", etd, f"held-out text of another source: {', '.join(ev)}"))
        score_chain(runner, models, more)
        texts += more
    return texts


def reencode_chain(runner, model, tdata, codecs, quant, trained_in: str = "none", texts: list[Text] = ()) -> None:
    """The model in each codec (`quant`: QuantSettings; block codecs by GPTQ or AWQ from Grams over
    the data's calibration windows, cached per model, data and settings, else round-to-nearest; a
    model healed against a codec (`trained_in`) is in it already and is copied), each scored on
    every text as `score.reencode.<codec>` (the data's) and `score.panel.<name>.reencode.<codec>`."""
    for codec in codecs:
        if uses_grams(codec, quant) and codec != trained_in:
            enc = quantize_chain(runner, model, tdata, codec, quant, key=f"reencode.{codec}")
        else:
            # a model healed against a codec keeps the blocks it trained on
            grid = {"q4_grid": quant.q4_grid} if codec != trained_in and quant.q4_grid != "asymmetric" else {}
            enc = runner.run(REENCODE, f"reencode.{codec}", model=model, codec=codec, **grid)["path"]
        for t in texts:
            at = "score." if t.kind == "data" else f"score.panel.{t.name}."
            runner.run(SCORE, f"{at}reencode.{codec}", model=enc, tdata=t.tdata, settings=t.settings)


#: how the parameter set's own data is named in its reports
DATA_LABEL = "test split of the parameter set's data (in-domain)"


def _score_how(s: PipelineSettings) -> ScoreSettings:
    return ScoreSettings(split="test", window=s.score_window, max_tokens=s.score_tokens)


def data_text(s: PipelineSettings, tdata: str) -> Text:
    """The parameter set's data's test split, as its reports name it."""
    return scored_texts(_score_how(s), data=(tdata, DATA_LABEL))[0]
