"""Scoring and re-encoding a model: the one NLL scorer and the one re-encode,
with the two stages the flows run them as.

`score` is what `cortiq heal`, `cortiq nll`'s tdata mode, the flows' score
stage and the quality bench all measure: the teacher-forced NLL per scored
token of a tdata split (cortiq.model.nll.score_records), optionally with the
records cut into windows of one model pass and capped at a token count.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from pathlib import Path

import dataclasses
from dataclasses import dataclass

from . import codecs, store
from .errors import CortiqError
from .runner import Stage
from .settings_meta import check, setting


def score(models: dict, tdata_dir, split: str | None = "test", loss_on: str = "answer", device: str = "auto",
          progress: bool = True, window: int = 0, max_tokens: int = 0) -> dict:
    """Teacher-forced NLL per scored token of each model on `split` (None: every
    record): {name: nll}. A model is a CMF path or a loaded module. `window` > 0
    cuts records into passes of that many tokens; `max_tokens` > 0 scores only
    the leading records that hold that many scored tokens."""
    import torch
    from tqdm import tqdm

    from .data import Tdata
    from .devices import resolve_device
    from .model.nll import first_tokens, score_records, windowed

    td = Tdata.open(tdata_dir)
    recs = first_tokens(td.records(split), max_tokens, loss_on)
    where = "every" if split is None else f"the {split}"
    if not recs:
        raise CortiqError(f"{tdata_dir}: {where} split is empty" if split else f"{tdata_dir}: no records")
    if window:
        recs = windowed(recs, window, loss_on)
    dev = resolve_device(device, "score")
    out = {}
    for name, m in models.items():
        model = m.to(dev) if isinstance(m, torch.nn.Module) else _read(m, dev)
        bar = tqdm(total=len(recs), desc=f"{split or 'all'} NLL ({name})", unit="rec", disable=not progress,
                   file=sys.stderr)
        s, n = score_records(model, recs, loss_on=loss_on, pad_id=td.eos_id, progress=bar.update)
        bar.close()
        if n == 0:
            raise CortiqError(f"{tdata_dir}: {where} split has no scored token" if split else f"{tdata_dir}: no scored token")
        out[name] = s / n
        del model
    return out


#: the model `score` read last inside `reading_once` ((path, size, mtime, device), module), else None
_LAST: contextvars.ContextVar = contextvars.ContextVar("cortiq_measure_last", default=None)


@contextlib.contextmanager
def reading_once():
    """Inside it, `score` keeps the last CMF model it read and reuses it while the next text asks for the
    same file on the same device: a chain that scores one model on several texts reads it once (a read
    checks every tensor's sha256 and dequantizes it: seconds, where scoring a short text on a GPU is less).
    One model at a time, so the device holds no more than `score` alone; dropped on leaving."""
    token = _LAST.set([None])
    try:
        yield
    finally:
        _LAST.reset(token)


def _read(path, device):
    """The model at `path` on `device` as `score` reads it: inside `reading_once` the last one read when it
    is the same file, else read now."""
    import torch

    from .model import load_model

    slot = _LAST.get()
    if slot is None:
        return load_model(path, dtype=torch.float32, device=device)
    st = Path(path).stat()
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, str(device))
    if slot[0] is None or slot[0][0] != key:
        slot[0] = None  # the previous model let go before the next is read
        slot[0] = (key, load_model(path, dtype=torch.float32, device=device))
    return slot[0][1]


def gap_recovered(nll: dict) -> float | None:
    """(pruned − healed) / (pruned − source): the share of the pruning's NLL loss the heal won back."""
    if "source" not in nll or nll["student"] == nll["source"]:
        return None
    return (nll["student"] - nll["healed"]) / (nll["student"] - nll["source"])


def text_gap(text: str, nll: dict) -> dict:
    """One named text's line of a report: the NLLs ({source, student, healed}, those
    present), each model's excess NLL over the source, and the gap recovered."""
    out: dict = {"text": text, "nll": dict(nll)}
    if "source" in nll:
        out["excess"] = {k: v - nll["source"] for k, v in nll.items() if k != "source"}
    g = gap_recovered(nll) if "student" in nll and "healed" in nll else None
    if g is not None:
        out["gap_recovered"] = g
    return out


def panel_gap(parts: dict[str, dict]) -> dict | None:
    """The general panel over its texts ({name: text_gap}): each model's NLL the mean over
    the texts (each text counts once, whatever its length), with its excess and gap; the
    texts themselves under `parts`. None with no text."""
    if not parts:
        return None
    models = [m for m in next(iter(parts.values()))["nll"] if all(m in p["nll"] for p in parts.values())]
    nll = {m: sum(p["nll"][m] for p in parts.values()) / len(parts) for m in models}
    out = text_gap("general panel (held-out text of other sources, never trained on: " + ", ".join(parts) + ")", nll)
    out["parts"] = parts
    return out


def gap_line(name: str, t: dict) -> str:
    """A report's line of one named text: gap recovered and excess NLL over the source."""
    ex = t.get("excess") or {}
    bits = []
    if "gap_recovered" in t:
        bits.append(f"gap recovered {t['gap_recovered']:.1%}")
    if "healed" in ex:
        bits.append(f"excess NLL over the source {ex['healed']:+.4f}" +
                    (f" (pruned {ex['student']:+.4f})" if "student" in ex else ""))
    return f"{name}: " + (", ".join(bits) or "NLL " + "  ".join(f"{k} {v:.4f}" for k, v in t["nll"].items())) + \
        f", on {t['text']}"


def recode(src_cmf, out_cmf, codec: str, provenance: dict | None = None, verify: bool = True, finite: bool = True,
           progress=None, q4_grid: str = "asymmetric") -> Path:
    """`src_cmf` with every tensor in the codec `codecs.choose_codec` gives it for
    `codec` (plain codecs everywhere, quantized ones on matrices), provenance
    `recode`. Tensors already in their codec are copied byte for byte (with
    `q4_grid` "symmetric", q4 ones whose blocks are symmetric: cmf.copy_specs)."""
    from .cmf import copy_specs, open_cmf, with_provenance, write_cmf

    codecs.get(codec)  # an unknown codec fails before any work
    from .model import check_file

    src = open_cmf(src_cmf)
    check_file(src)  # a file load refuses is not re-encoded into one that looks finished
    specs = copy_specs(src, lambda name, info: codecs.choose_codec(codec, info.shape, info.codec, name), verify=verify,
                       finite=finite, q4_grid=q4_grid)
    grid = {"q4_grid": q4_grid} if q4_grid != "asymmetric" else {}
    doc = with_provenance({k: v for k, v in src.doc.items() if k not in ("codecs", "hashes", "shards")}, "recode",
                          {"codec": codec, **grid, **(provenance or {})})
    return write_cmf(Path(out_cmf), doc, specs, progress=progress)


@dataclasses.dataclass
class Text:
    """One text the models are scored on: a tdata and how (`ScoreSettings`: split, window,
    tokens), the line a report names it by, where it counts ("data": the data's own held-out
    split; "panel": text no stage trained on) and the key its scores run under (`at` + label:
    score.healed, score.panel.NAME.healed, score.eval.healed)."""

    name: str
    tdata: str
    settings: object
    label: str
    kind: str = "panel"
    at: str = ""

    def __post_init__(self):
        self.at = self.at or ("score." if self.kind == "data" else f"score.panel.{self.name}.")


def scored_texts(how: ScoreSettings, data: tuple | None = None, panel: dict | None = None, panel_tokens: int = 0,
                 eval: tuple | None = None) -> list[Text]:
    """The texts a report scores the models on, each as `how` says: `data` (tdata, label), the
    data's own `how.split`; `panel` ({name: tdata}), each retain source's test split (capped at
    `panel_tokens` scored tokens where given); `eval` (name, tdata, label), every record of held-out
    text of another source."""
    texts = []
    if data is not None:
        texts.append(Text("data", str(data[0]), how, data[1], "data"))
    for name, d in (panel or {}).items():
        texts.append(Text(name, str(d), dataclasses.replace(how, split="test", max_tokens=panel_tokens or how.max_tokens),
                          f"the test split of the retain source {name} (never trained on)"))
    if eval is not None:
        texts.append(Text(eval[0], str(eval[1]), dataclasses.replace(how, split="all"), eval[2], at="score.eval."))
    return texts


def score_chain(runner, models: dict[str, str], texts: list[Text]) -> dict:
    """The score stage for each model ({label: CMF}) on each text (run as `text.at` + label);
    returns the named texts every report shows (`named_texts`)."""
    with reading_once():  # model by model: each read once for all of its texts
        for label, model in models.items():
            for t in texts:
                runner.run(SCORE, f"{t.at}{label}", model=model, tdata=t.tdata, settings=t.settings)
    return named_texts(runner.results, texts, tuple(models))


#: the labels of the three models a report compares, and the names `cortiq.measure.text_gap` gives them
MODELS = (("source", "source"), ("student", "pruned"), ("healed", "healed"))


def named_texts(results: dict, texts: list[Text], labels: tuple[str, ...] = ("source", "pruned", "healed")) -> dict:
    """The two named texts every report shows, from the score stages' results: "data" (the
    data's own held-out split) and "panel" (the mean over the other texts, text no stage trained
    on), each with the NLLs of the models `labels` names (source, pruned, healed), the excess
    over the source and the gap recovered; a text some of whose models are not scored yet is
    left out."""
    names = {label: name for name, label in MODELS}

    def nll(at):
        got = {names.get(label, label): (((results.get(f"{at}{label}") or {}).get("report") or {}).get("metrics") or {}).get("nll")
               for label in labels}
        return None if any(v is None for v in got.values()) else {k: float(v) for k, v in got.items()}

    out, parts = {}, {}
    for t in texts:
        n = nll(t.at)
        if n is None:
            continue
        if t.kind == "data":
            out["data"] = text_gap(t.label, n)
        else:
            parts[t.name] = text_gap(t.label, n)
    if parts:
        out["panel"] = panel_gap(parts)
    return out


# ── the stages, declared once (cortiq.runner runs them for the flows) ──

@dataclass
class ScoreSettings:
    """What the score stage measures: the NLL per scored token of a tdata split."""

    split: str = setting("test", "the split scored (all: every record)", choices=("train", "val", "test", "all"))
    window: int = setting(0, "tokens per scoring pass (0: each record whole)", lo=0)
    max_tokens: int = setting(0, "scored tokens of the leading records that hold them (0: all)", lo=0)
    loss_on: str = setting("answer", "tokens scored: answer (each record's scored span) or all",
                           choices=("answer", "all"))
    device: str = setting("auto", "where the model scores: auto (CUDA when present), cpu, cuda, cuda:N", how=True)

    def __post_init__(self):
        check(self, "score settings")


def _score(out, ctx, model, tdata, settings) -> dict:
    from .cmf import open_cmf

    s = settings
    nll = score({"model": model}, tdata, None if s.split == "all" else s.split, s.loss_on, s.device, ctx.progress,
                s.window, s.max_tokens)["model"]
    metrics = {"nll": nll, "bytes": float(open_cmf(model).nbytes())}
    with store.stage_dir(out, {"stage": SCORE.name, "digest": ctx.digest, "metrics": metrics}):
        pass
    return {"metrics": metrics}


def _reencode(out, ctx, model, codec, q4_grid="asymmetric") -> dict:
    from .cmf import open_cmf

    recode(model, out, codec, {"from": store.file_digest(model)}, q4_grid=q4_grid)
    return {"metrics": {"bytes": float(open_cmf(out).nbytes())}, "codec": codec}


def _grid_key(p: dict) -> dict:
    """A symmetric q4 grid in REENCODE's key where it changes the output (a q4 codec); nothing otherwise, so
    every output made before the grid was a parameter keeps its digest."""
    grid = p.get("q4_grid", "asymmetric")
    return {"q4_grid": grid} if grid != "asymmetric" and codecs.takes_grid(p["codec"]) else {}


SCORE = Stage("score", 2, _score, ScoreSettings, ("model", "tdata"),
              doc="NLL per scored token of a model on a tdata split (\"all\": every record), and its size")
REENCODE = Stage("reencode", 2, _reencode, None, ("model",), extra=lambda p: {"codec": p["codec"],
                 **codecs.rule_key(p["codec"]), **_grid_key(p)}, output="cmf",
                 doc="a model in another codec (plain codecs everywhere, quantized ones on matrices)")
