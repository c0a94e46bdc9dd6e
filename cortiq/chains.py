"""The pipeline's chains, each written once: the stages in order, run through a runner.

A chain calls `runner.run(stage, key=None, **params)` for each stage and passes the
outputs' paths on; `runner.results` keeps each run's result under its key. The command
line passes `cortiq.runner.LocalRunner` (`cortiq.runner.run` in this process), the
flows their Prefect runner (`flows.common.Stages`: each stage a cached task): one list
of stages, one cache under the cortiq home's `work/`, whichever runs first.

One chain per pipeline, beside its stages:
- `cortiq.compress.compress_chain`: masks → grams (for the repair, an activation ranking or GPTQ) → fold → gptq;
- `cortiq.heal.stages.heal_chain`: teacher targets → frozen prefix (when the tail trains alone) → train → export;
- `cortiq.measure.score_chain`: the score stage for each model on each named text;
- `cortiq.mtp.mtp_chain`: mtp init (a model without a draft) → trunk pass → draft training (→ the draft
  in other codecs);
- `reencode_chain` (here): the model in each codec (GPTQ / AWQ from Grams, else round-to-nearest), scored;
and here a parameter set's chains as the flows and `cortiq demo` run them: `source_and_data`,
`student` (→ compress), `healed` (→ heal → score), `pipeline` (→ mtp heal → re-encode), `mtp_only`.

Adding a stage: declare it beside its function (`cortiq.runner.Stage`) and add its line to
its chain; the command line and every flow run it from then on.
"""

from __future__ import annotations

import dataclasses

from .measure import Text, score_chain


# ── re-encode ──

def reencode_chain(runner, model, tdata, codecs, quant, trained_in: str = "none", texts: list[Text] = ()) -> None:
    """The model in each codec (`quant`: QuantSettings; block codecs by GPTQ or AWQ from Grams over
    the data's calibration windows, cached per model, data and settings, else round-to-nearest; a
    model healed against a codec (`trained_in`) is in it already and is copied), each scored on
    every text as `score.reencode.<codec>` (the data's) and `score.panel.<name>.reencode.<codec>`."""
    from .measure import REENCODE, SCORE
    from .quant import QGRAMS, QUANTIZE, uses_grams

    for codec in codecs:
        if uses_grams(codec, quant) and codec != trained_in:
            grams = runner.run(QGRAMS, f"qgrams.{codec}", model=model, tdata=tdata, codec=codec, settings=quant)["path"]
            enc = runner.run(QUANTIZE, f"reencode.{codec}", model=model, grams=grams, codec=codec, settings=quant)["path"]
        else:
            enc = runner.run(REENCODE, f"reencode.{codec}", model=model, codec=codec)["path"]
        for t in texts:
            at = "score." if t.kind == "data" else f"score.panel.{t.name}."
            runner.run(SCORE, f"{at}reencode.{codec}", model=enc, tdata=t.tdata, settings=t.settings)


# ── a parameter set, as the flows run it ──

def source_and_data(runner, s) -> tuple[str, str]:
    """(the source as a CMF: a .cmf where it is, anything else converted once; the tdata of the
    parameter set's sources, tokenized with its tokenizer)."""
    from .convert import SOURCE, source_kind
    from .data.builder import DATA

    source = s.source if source_kind(s.source) == "cmf" else runner.run(SOURCE, source=s.source)["path"]
    tdata = runner.run(DATA, sources=s.data.sources, model=source, settings=s.data.build_settings())["path"]
    return source, tdata


def _score_settings(s, split: str = "test"):
    from .measure import ScoreSettings

    return ScoreSettings(split=split, window=s.score_window, max_tokens=s.score_tokens)


def data_text(s, tdata: str) -> Text:
    """The parameter set's data's test split, as its reports name it."""
    return Text("data", tdata, _score_settings(s), "test split of the parameter set's data (in-domain)", "data")


def panel_texts(s, panel: dict[str, str]) -> list[Text]:
    """Each retain source's test split: the general panel, never trained on."""
    return [Text(name, d, _score_settings(s), f"the test split of the retain source {name}") for name, d in panel.items()]


def eval_text(runner, s, source: str) -> Text | None:
    """Every record of data.eval_sources (tokenized as the data is), when the parameter set names them."""
    from .data.builder import DATA

    ev = s.data.eval_sources
    if not ev:
        return None
    etd = runner.run(DATA, "data.eval", sources=ev, model=source, settings=s.data.build_settings())["path"]
    return Text("eval", etd, _score_settings(s, "all"), f"held-out text of another source: {', '.join(ev)}",
                at="score.eval.")


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


def student(runner, s) -> Made:
    """source → data → retain mix → compress: the opening of every flow that compresses."""
    from .compress.stages import compress_chain
    from .data.retain import with_retain

    source, tdata = source_and_data(runner, s)
    mixed, panel = with_retain(tdata, source, s.retain, runner.run, None, progress=False)
    return Made(source, tdata, mixed, panel, compress_chain(runner, source, mixed, s.compress))


def healed(runner, s) -> Made:
    """`student`, then heal (on the data with the retain sources mixed in) → score source, pruned and
    healed on the data's test split, on each retain source's test split and on data.eval_sources."""
    from .heal.stages import heal_chain

    m = student(runner, s)
    m.healed = heal_chain(runner, m.source, m.student, m.mixed, s.heal)
    models = {"source": m.source, "pruned": m.student, "healed": m.healed}
    m.texts = [data_text(s, m.tdata), *panel_texts(s, m.panel)]
    score_chain(runner, models, m.texts)
    ev = eval_text(runner, s, m.source)  # after the others: its data stage runs only now
    if ev is not None:
        m.texts.append(ev)
        score_chain(runner, models, [ev])
    return m


def pipeline(runner, s) -> tuple[str, Made]:
    """compress-and-heal (what `cortiq demo` runs): `healed`, the MTP draft healed on the healed
    trunk (when the parameter set asks), then the final model in each codec, each scored on every
    text. Returns (the final model, what was made)."""
    from .mtp import mtp_chain

    m = healed(runner, s)
    final = m.healed
    if s.mtp_enabled:
        final = mtp_chain(runner, final, m.tdata, s.mtp)
    reencode_chain(runner, final, m.tdata, s.codecs, s.quant, s.heal.qat_codec, m.texts)
    return final, m


def mtp_only(runner, s) -> str:
    """mtp-heal on a parameter set: its source and data, the draft healed, each codec scored on the data."""
    from .mtp import mtp_chain

    source, tdata = source_and_data(runner, s)
    final = mtp_chain(runner, source, tdata, s.mtp)
    reencode_chain(runner, final, tdata, s.codecs, s.quant, s.heal.qat_codec, [data_text(s, tdata)])
    return final
