"""`PipelineSettings`: the one parameter set of the compress-and-heal pipeline.

A named parameter set is a YAML file (deployments/params/*.yaml) whose
top-level keys are the groups below. Loading checks every key: an unknown one
is an error that names the file and suggests the nearest known key
("deployments/params/demo.yaml: unknown key heal.lrr (did you mean heal.lr?)").

The stage groups (`data`, `compress`, `heal`, `mtp`) are the stages' own
settings dataclasses (cortiq/<stage>/settings.py); here they are kept as plain
dicts checked against those dataclasses' fields, so that a stage's defaults
live in one place and the digest of a stage output depends only on what the
user set plus that stage's version. This module imports neither prefect nor
mlflow: the CLI validates a parameter file before anything heavy starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CortiqError

#: stage group -> (module, dataclass) holding that stage's settings
STAGE_SETTINGS = {
    "data": ("cortiq.data.build", "BuildSettings"),
    "compress": ("cortiq.compress.settings", "CompressSettings"),
    "heal": ("cortiq.heal.settings", "HealSettings"),
    "mtp": ("cortiq.mtp.settings", "MtpSettings"),
}

#: keys a stage group holds beside its dataclass's fields (the data group names its sources)
EXTRA_KEYS = {"data": {"sources": ["corpus:pydoc"]}}

#: codecs a re-encode may write (cortiq.codecs names)
DEFAULT_CODECS = ["f16", "q8", "q4"]


def stage_settings_class(group: str):
    """The settings dataclass of a stage group, or None while that stage has none."""
    mod, name = STAGE_SETTINGS[group]
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError):
        return None


@dataclass
class RunSettings:
    """Where outputs and runs go, and how failures are retried."""

    # ── outputs ──
    #: directory of stage outputs (each in its own digest-named directory); "" = <cortiq home>/work
    out: str = ""
    # ── tracking ──
    #: MLflow tracking URI; "" = sqlite:///<cortiq home>/mlflow.db
    tracking_uri: str = ""
    #: MLflow experiment the runs go to
    experiment: str = "cortiq"
    #: output CMF files larger than this are logged as a reference (path + sha256), not copied
    artifact_limit_mb: float = 200.0
    # ── failures ──
    #: times Prefect retries a failed stage task (training resumes from its checkpoint)
    retries: int = 0
    #: seconds between retries
    retry_delay_s: float = 10.0

    def __post_init__(self):
        if not isinstance(self.retries, int) or self.retries < 0:
            raise CortiqError(f"run.retries must be a whole number >= 0, not {self.retries!r}")
        if self.retry_delay_s < 0:
            raise CortiqError(f"run.retry_delay_s must be >= 0, not {self.retry_delay_s!r}")
        if self.artifact_limit_mb < 0:
            raise CortiqError(f"run.artifact_limit_mb must be >= 0, not {self.artifact_limit_mb!r}")

    def out_dir(self) -> Path:
        from .store import home

        return Path(self.out) if self.out else home() / "work"

    def tracking(self) -> str:
        from .store import home

        if self.tracking_uri:
            return self.tracking_uri
        return f"sqlite:///{(home() / 'mlflow.db').resolve()}"


@dataclass
class PipelineSettings:
    """compress-and-heal: source → data → compress → heal → score → mtp heal → re-encode."""

    #: the parameter set's name (tags the MLflow run); defaults to the YAML file's stem
    name: str = "default"
    # ── the model ──
    #: a .cmf file, a Hugging Face safetensors directory, a .gguf file, or "smollm2" (the bundled SmolLM2-135M-Instruct)
    source: str = "smollm2"
    # ── stage settings (the stages' own dataclasses, as dicts of what is set here) ──
    #: `sources` (files, directories, or corpus:pydoc / corpus:shakespeare) and cortiq.data.build.BuildSettings
    data: dict = field(default_factory=dict)
    #: cortiq.compress.settings.CompressSettings: masks, keep ratio, repair, GPTQ
    compress: dict = field(default_factory=dict)
    #: cortiq.heal.settings.HealSettings: distillation
    heal: dict = field(default_factory=dict)
    #: cortiq.mtp.settings.MtpSettings: draft head healing
    mtp: dict = field(default_factory=dict)
    #: run the MTP heal (needs a source with an MTP block, or one is initialised; see cortiq.mtp)
    mtp_enabled: bool = True
    # ── score and re-encode ──
    #: test-split tokens the NLL is scored on (0 = the whole test split)
    score_tokens: int = 0
    #: window length (tokens) the test NLL is scored in
    score_window: int = 256
    #: codecs the final model is re-encoded in and re-measured (cortiq.codecs names)
    codecs: list = field(default_factory=lambda: list(DEFAULT_CODECS))
    # ── outputs, tracking, retries ──
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self):
        if isinstance(self.run, dict):
            self.run = _build(RunSettings, self.run, "run", "settings")
        if not isinstance(self.source, str) or not self.source:
            raise CortiqError("source must be a model path or 'smollm2'")
        from . import codecs as _codecs

        if not isinstance(self.codecs, list):
            raise CortiqError(f"codecs must be a list of codec names, not {self.codecs!r}")
        for c in self.codecs:
            _codecs.get(c)
        if self.score_window < 1:
            raise CortiqError(f"score_window must be >= 1, not {self.score_window}")
        if self.score_tokens < 0:
            raise CortiqError(f"score_tokens must be >= 0, not {self.score_tokens}")
        for g in STAGE_SETTINGS:
            if not isinstance(getattr(self, g), dict):
                raise CortiqError(f"{g} must be a mapping of settings, not {getattr(self, g)!r}")

    def stage(self, group: str):
        """The stage's settings dataclass built from this group (the group's dict while the stage has none);
        the group's extra keys (data.sources) are left out: see `extra`."""
        cls = stage_settings_class(group)
        values = {k: v for k, v in getattr(self, group).items() if k not in EXTRA_KEYS.get(group, {})}
        return values if cls is None else _build(cls, values, group, self.name)

    def extra(self, group: str, key: str):
        """A group's extra key (e.g. data.sources), or its default."""
        return getattr(self, group).get(key, EXTRA_KEYS[group][key])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _unknown(where: str, key: str, known: list[str]) -> CortiqError:
    short = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(short, known, n=1)
    prefix = key[: -len(short)]
    hint = f" (did you mean {prefix}{close[0]}?)" if close else f" (known: {', '.join(sorted(known))})"
    return CortiqError(f"{where}: unknown key {key}{hint}")


def _check_keys(cls, values: dict, group: str, where: str, extra: tuple = ()) -> None:
    """Every key of `values` is a field of `cls` (nested dataclass groups checked too)."""
    import typing

    known = [f.name for f in dataclasses.fields(cls)]
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: check this level only
        hints = {}
    for k, v in values.items():
        if k in extra:
            continue
        if k not in known:
            raise _unknown(where, f"{group}.{k}", known + list(extra))
        sub = hints.get(k)
        if isinstance(v, dict) and isinstance(sub, type) and dataclasses.is_dataclass(sub):
            _check_keys(sub, v, f"{group}.{k}", where)


def _build(cls, values: Any, group: str, where: str):
    if dataclasses.is_dataclass(values):
        return values
    if not isinstance(values, dict):
        raise CortiqError(f"{where}: {group} must be a mapping, not {values!r}")
    _check_keys(cls, values, group, where)
    try:
        return cls(**values)
    except CortiqError as e:
        raise CortiqError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise CortiqError(f"{where}: {group}: {e}") from None


def settings_from_dict(doc: Any, where: str = "settings") -> PipelineSettings:
    """PipelineSettings from a mapping, every key checked (stage groups against their stage's dataclass)."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise CortiqError(f"{where}: a parameter set must be a mapping of groups, not {type(doc).__name__}")
    known = [f.name for f in dataclasses.fields(PipelineSettings)]
    for k in doc:
        if k not in known:
            raise _unknown(where, str(k), known)
    run = doc.get("run", {})
    if run is None:
        run = {}
    if not isinstance(run, dict):
        raise CortiqError(f"{where}: run must be a mapping, not {run!r}")
    for k in run:
        if k not in [f.name for f in dataclasses.fields(RunSettings)]:
            raise _unknown(where, f"run.{k}", [f.name for f in dataclasses.fields(RunSettings)])
    values = dict(doc)
    for g in STAGE_SETTINGS:
        v = values.get(g)
        if v is None:
            values[g] = {}
        elif not isinstance(v, dict):
            raise CortiqError(f"{where}: {g} must be a mapping, not {v!r}")
    try:
        s = PipelineSettings(**{**values, "run": _build(RunSettings, run, "run", where)})
    except CortiqError as e:
        msg = str(e)
        raise CortiqError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except TypeError as e:
        raise CortiqError(f"{where}: {e}") from None
    # stage groups: checked against the stage's dataclass now, not when the stage starts
    for g in STAGE_SETTINGS:
        cls = stage_settings_class(g)
        extra = EXTRA_KEYS.get(g, {})
        values = getattr(s, g)
        if cls is not None:
            _check_keys(cls, values, g, where, tuple(extra))
            _build(cls, {k: v for k, v in values.items() if k not in extra}, g, where)
    srcs = s.extra("data", "sources")
    if not isinstance(srcs, list) or not srcs or not all(isinstance(x, str) for x in srcs):
        raise CortiqError(f"{where}: data.sources must be a non-empty list of paths or corpus:NAME, not {srcs!r}")
    return s


def load_settings(params: str | os.PathLike | dict | PipelineSettings | None) -> PipelineSettings:
    """A parameter set from a YAML file, a mapping, or PipelineSettings (returned as is)."""
    if isinstance(params, PipelineSettings):
        return params
    if params is None or isinstance(params, dict):
        return settings_from_dict(params or {}, "settings")
    import yaml

    path = Path(params)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CortiqError(f"{path}: no such parameter file") from None
    except IsADirectoryError:
        raise CortiqError(f"{path}: is a directory, not a parameter file") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        raise CortiqError(f"{path}: not YAML{f' (line {line + 1})' if line is not None else ''}") from None
    doc = {} if doc is None else doc
    if isinstance(doc, dict):
        doc.setdefault("name", path.stem)
    return settings_from_dict(doc, str(path))
