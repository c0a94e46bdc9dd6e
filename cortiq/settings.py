"""`PipelineSettings`: the one parameter set of the compress-and-heal pipeline.

A named parameter set is a YAML file (deployments/params/*.yaml) whose
top-level keys are the groups below. Loading checks every key: an unknown one
is an error that names the file and suggests the nearest known key
("deployments/params/demo.yaml: unknown key heal.lrr (did you mean heal.lr?)").

The stage groups (`data`, `compress`, `heal`, `mtp`, `retain`, `quant`) are the
stages' own settings dataclasses (cortiq/<stage>/settings.py), built once here,
when the parameter set is loaded: a stage's defaults live in one place, and a
chain hands each stage its group as it is. Dicts appear only where settings
leave the process (`to_dict`: a Prefect flow's parameters, the MLflow params).
This module imports neither prefect nor mlflow: the CLI validates a parameter
file before anything heavy starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .compress.settings import CompressSettings
from .data.settings import DataSettings, RetainSettings
from .errors import CortiqError
from .heal.settings import HealSettings
from .mtp.settings import MtpSettings
from .quant.settings import QuantSettings
from .settings_meta import WINDOW, check, check_value, derived_error, nested, parent_key, setting

#: codecs a re-encode may write (cortiq.codecs names)
DEFAULT_CODECS = ["f16", "q8", "q4"]

# ── limits on a parameter file, checked before its values are built ──
#: a parameter set is a few hundred bytes; a file past this is not one
MAX_PARAM_BYTES = 1 << 20
#: values a file may hold with every YAML alias expanded (a shipped set holds ~80): aliases
#: referring to aliases grow exponentially, and the settings are copied, flattened and
#: hashed in full later (a 1 KB "billion laughs" file would hold 10**9)
MAX_PARAM_VALUES = 20_000
#: nesting depth of a parameter file (a shipped set nests 3 deep)
MAX_PARAM_DEPTH = 32

#: the largest whole number a setting takes: beyond it a float loses integers, and no count of
#: steps, tokens or bytes a run plans comes near it
MAX_INT = 1 << 53

#: torch device strings a stage may name ("auto" picks CUDA when present)
DEVICE_RE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d{1,3})?")


@dataclass
class RunSettings:
    """Where outputs and runs go, and how failures are retried."""

    # ── outputs ──
    out: str = setting("", "directory of stage outputs", show="<cortiq home>/work")
    # ── tracking ──
    tracking_uri: str = setting("", "MLflow tracking URI", show="sqlite:///<cortiq home>/mlflow.db")
    experiment: str = setting("cortiq", "MLflow experiment the runs go to")
    #: copying a multi-GB model into the tracking store doubles the disk it takes
    artifact_limit_mb: float = setting(200.0, "output CMF files larger than this (MB) are logged as a reference "
                                              "(path + sha256), not copied", lo=0)
    # ── failures ──
    retries: int = setting(0, "times a failed stage is retried (training resumes from its checkpoint)", lo=0)
    retry_delay_s: float = setting(10.0, "seconds between retries", lo=0)

    def __post_init__(self):
        check(self, "run")

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

    name: str = setting("default", "the parameter set's name (tags the MLflow run)", show="the YAML file's stem")
    # ── the model ──
    source: str = setting("smollm2", "the model: a .cmf file, a Hugging Face directory, a .gguf file, or smollm2 "
                                     "(the bundled SmolLM2-135M-Instruct)")
    # ── the stages' settings ──
    data: DataSettings = field(default_factory=DataSettings)
    compress: CompressSettings = field(default_factory=CompressSettings)
    heal: HealSettings = field(default_factory=HealSettings)
    mtp: MtpSettings = field(default_factory=MtpSettings)
    #: its test splits are the general panel every report scores
    retain: RetainSettings = field(default_factory=RetainSettings)
    quant: QuantSettings = field(default_factory=QuantSettings)
    mtp_enabled: bool = setting(True, "heal the MTP draft (a source without one gets a fresh one)")
    # ── score and re-encode ──
    score_tokens: int = setting(0, "test-split tokens the NLL is scored on (0: the whole test split)", lo=0)
    score_window: int = setting(256, "tokens per window the test NLL is scored in", **WINDOW)
    codecs: list[str] = setting(factory=lambda: list(DEFAULT_CODECS),
                                help="codecs the final model is re-encoded in and re-measured")
    # ── outputs, tracking, retries ──
    run: RunSettings = field(default_factory=RunSettings)

    def __post_init__(self):
        for name, cls in groups().items():  # a group given as a mapping (PipelineSettings(heal={...}))
            if isinstance(getattr(self, name), dict):
                setattr(self, name, _build(cls, getattr(self, name), name, "settings"))
        if not isinstance(self.source, str) or not self.source:
            raise CortiqError("source must be a model path or 'smollm2'")
        from . import codecs as _codecs

        if not isinstance(self.codecs, list):
            raise CortiqError(f"codecs must be a list of codec names, not {self.codecs!r}")
        for c in self.codecs:
            _codecs.get(c)
        check(self, "settings")

    def to_dict(self) -> dict:
        """The parameter set as a parameter file writes it: every key `load_settings` takes (and
        none that another sets), lists where the settings hold tuples. What leaves the process:
        a flow's Prefect parameters, the MLflow params, settings.json."""
        return as_document(self)


def groups() -> dict[str, type]:
    """The groups of a parameter set (`run` and the stage groups): key -> settings dataclass."""
    return {f.name: nested(PipelineSettings, f) for f in dataclasses.fields(PipelineSettings)
            if nested(PipelineSettings, f) is not None}


def as_document(obj) -> dict:
    """A settings dataclass as the mapping a parameter file holds (`PipelineSettings.to_dict`)."""
    out = {}
    for f in dataclasses.fields(obj):
        if "set_by" not in f.metadata:
            out[f.name] = _document_value(getattr(obj, f.name))
    return out


def _document_value(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return as_document(v)
    if isinstance(v, (list, tuple)):
        return [_document_value(x) for x in v]
    return v


def _unknown(where: str, key: str, known: list[str], elsewhere: dict[str, str] | None = None) -> CortiqError:
    """An unknown key, with the nearest known one; `elsewhere` maps a name known under another
    key (a field its enclosing group sets) to that key."""
    short = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(short, known + list(elsewhere or {}), n=1)
    prefix = key[: -len(short)]
    near = (elsewhere or {}).get(close[0], prefix + close[0]) if close else None
    hint = f" (did you mean {near}?)" if close else f" (known: {', '.join(sorted(known))})"
    return CortiqError(f"{where}: unknown key {key}{hint}")


def _check_keys(cls, values: dict, group: str, where: str) -> None:
    """Every key of `values` is a field of `cls` (nested dataclass groups checked too)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = [k for k, f in fields.items() if "set_by" not in f.metadata]
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation: check this level only
        hints = {}
    for k, v in values.items():
        if k in fields and k not in known:
            raise CortiqError(f"{where}: {derived_error(f'{group}.', fields[k])}")
        if k not in known:
            elsewhere = {n: parent_key(f"{group}.", f.metadata["set_by"]) for n, f in fields.items() if n not in known}
            raise _unknown(where, f"{group}.{k}", known, elsewhere)
        sub = hints.get(k)
        if isinstance(v, dict) and isinstance(sub, type) and dataclasses.is_dataclass(sub):
            _check_keys(sub, v, f"{group}.{k}", where)


def _short(v: Any) -> str:
    """A value as an error message shows it: its repr, cut to a line."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Mismatch(Exception):
    """A value of the wrong kind for its field; the message says what was expected."""


def _kind(tp: Any, v: Any, key: str) -> Any:
    """`v` checked against the annotation `tp` (and normalised: an int where a float is
    expected becomes a float, a nested dataclass's mapping is checked field by field)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return v
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        wanted = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _kind(a, v, key)
            except _Mismatch as e:
                wanted.append(str(e))
        raise _Mismatch(" or ".join(wanted) + (" or null" if type(None) in args else ""))
    if tp is bool:
        # YAML reads `no` as false but 'no' (quoted) as a string; a string is never a boolean here
        if not isinstance(v, bool):
            raise _Mismatch("true or false")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _Mismatch("a whole number")
        if abs(v) > MAX_INT:
            raise _Mismatch(f"a whole number of at most {MAX_INT}")
        return v
    if tp is float:
        if isinstance(v, str) and re.fullmatch(r"[-+]?\d+[eE][-+]?\d+", v.strip()):
            raise _Mismatch(f"a number (YAML reads {v} as text: write it with a point, {v.replace('e', '.0e', 1)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Mismatch("a number")
        if not math.isfinite(v):
            raise _Mismatch("a finite number")
        return float(v)
    if tp is str:
        if not isinstance(v, str):
            raise _Mismatch("a string")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in v):
            raise _Mismatch("a string without control characters")
        return v
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(v, tp):
            return v
        if not isinstance(v, dict):
            raise _Mismatch("a mapping of settings")
        return check_types(tp, v, key, None)
    if tp is dict or origin is dict:
        if not isinstance(v, dict):
            raise _Mismatch("a mapping of settings")
        return v
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise _Mismatch("a list")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(v) != len(args):
                raise _Mismatch(f"a list of {len(args)}")
            return [_item(a, x, f"{key}[{i}]") for i, (a, x) in enumerate(zip(args, v))]
        if args:
            return [_item(args[0], x, f"{key}[{i}]") for i, x in enumerate(v)]
        return list(v)
    return v  # an annotation this check does not know: the dataclass's own __post_init__ checks it


def _item(tp: Any, v: Any, key: str) -> Any:
    """One item of a list setting, named by its index when it is of the wrong kind."""
    try:
        return _kind(tp, v, key)
    except _Mismatch as e:
        raise CortiqError(f"{key} must be {e}, not {_short(v)}") from None


def _field_check(name: str, v: Any, key: str) -> None:
    """Checks by field name, the same in every group: device strings parsed before anything runs."""
    if name == "device" and isinstance(v, str) and not DEVICE_RE.fullmatch(v):
        raise CortiqError(f"{key} {v!r} is not a device (auto, cpu, cuda, cuda:N, mps, xpu, xpu:N)")
    if name == "name" and isinstance(v, str) and not (0 < len(v) <= 200):
        raise CortiqError(f"{key} must be 1 to 200 characters, not {len(v)}")


def check_types(cls, values: dict, group: str, where: str | None) -> dict:
    """`values` (a group of settings from a parameter file) checked against `cls`'s field
    annotations: whole numbers are ints, numbers finite, booleans true/false, strings strings,
    a mapping where a group is expected; devices parsed and absurd plans refused. Returns the
    values normalised (ints where floats are expected become floats), each within its field's
    bounds and choices. Raises CortiqError naming `where` and the key; unknown keys are left to
    `_check_keys`."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: the dataclass's own checks stand
        hints = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = dict(values)
    for k, v in values.items():
        tp = hints.get(k)
        if tp is None:
            continue
        key = f"{group}.{k}" if group else str(k)
        try:
            out[k] = _kind(tp, v, key)
            _field_check(str(k), v, key)
            check_value(fields[k], out[k], key)
        except _Mismatch as e:
            msg = f"{key} must be {e}, not {_short(v)}"
            raise CortiqError(f"{where}: {msg}" if where else msg) from None
        except CortiqError as e:
            raise CortiqError(f"{where}: {e}" if where and not str(e).startswith(f"{where}: ") else str(e)) from None
    return out


def _build(cls, values: Any, group: str, where: str):
    if dataclasses.is_dataclass(values):
        return values
    if not isinstance(values, dict):
        raise CortiqError(f"{where}: {group} must be a mapping, not {_short(values)}")
    _check_keys(cls, values, group, where)
    values = check_types(cls, values, group, where)
    try:
        return cls(**values)
    except CortiqError as e:
        raise CortiqError(f"{where}: {e}") from None
    except (TypeError, ValueError) as e:
        raise CortiqError(f"{where}: {group}: {e}") from None


def settings_from_dict(doc: Any, where: str = "settings") -> PipelineSettings:
    """PipelineSettings from a mapping, every key checked (each group against its dataclass)."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise CortiqError(f"{where}: a parameter set must be a mapping of groups, not {type(doc).__name__}")
    known = [f.name for f in dataclasses.fields(PipelineSettings)]
    for k in doc:
        if k not in known:
            raise _unknown(where, str(k), known)
    values = dict(doc)
    # each group checked and built now, not when its stage starts
    built = {g: _build(cls, {} if values.get(g) is None else values[g], g, where) for g, cls in groups().items()}
    values = check_types(PipelineSettings, {k: v for k, v in values.items() if k not in built}, "", where)
    try:
        return PipelineSettings(**values, **built)
    except CortiqError as e:
        msg = str(e)
        raise CortiqError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except TypeError as e:
        raise CortiqError(f"{where}: {e}") from None


def load_settings(params: str | os.PathLike | dict | PipelineSettings | None) -> PipelineSettings:
    """A parameter set from a YAML file, a mapping, or PipelineSettings (returned as is)."""
    if isinstance(params, PipelineSettings):
        return params
    if params is None or isinstance(params, dict):
        return settings_from_dict(params or {}, "settings")
    path = Path(params)
    doc = read_yaml(path)
    doc = {} if doc is None else doc
    if isinstance(doc, dict):
        doc.setdefault("name", path.stem)
    return settings_from_dict(doc, str(path))


def read_yaml(path: Path) -> Any:
    """A YAML parameter file read within limits: a regular file, at most MAX_PARAM_BYTES, UTF-8
    text, at most MAX_PARAM_VALUES values with its aliases expanded and MAX_PARAM_DEPTH deep;
    only plain YAML types (yaml.safe_load's). Every failure is one CortiqError naming the file."""
    import yaml

    from .cmf import regular_size

    regular_size(path, MAX_PARAM_BYTES, "parameter file", CortiqError)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PARAM_BYTES + 1)
    except OSError as e:
        raise CortiqError(f"{path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_PARAM_BYTES:
        raise CortiqError(f"{path}: over {MAX_PARAM_BYTES} bytes; a parameter file is at most that")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CortiqError(f"{path}: not a text file (not UTF-8): a parameter file is YAML") from None
    if "\x00" in text:
        raise CortiqError(f"{path}: not a text file (NUL bytes): a parameter file is YAML")
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _bound_yaml(node, path)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        problem = getattr(e, "problem", None)
        detail = f" (line {line + 1}{': ' + problem if problem else ''})" if line is not None else ""
        raise CortiqError(f"{path}: not YAML{detail}") from None
    except RecursionError:
        raise CortiqError(f"{path}: nested deeper than {MAX_PARAM_DEPTH} levels") from None
    finally:
        loader.dispose()


def _bound_yaml(root, path: Path) -> None:
    """Refuse a composed YAML document that would expand past MAX_PARAM_VALUES values or nest
    past MAX_PARAM_DEPTH, or whose aliases refer to themselves: counted on the node graph, where
    an alias is one shared node, in time linear in the file."""
    import yaml

    sizes: dict[int, int | None] = {}  # node id -> expanded values (None while being counted)

    def size(node, depth: int) -> int:
        if depth > MAX_PARAM_DEPTH:
            raise CortiqError(f"{path}: nested deeper than {MAX_PARAM_DEPTH} levels")
        k = id(node)
        if k in sizes:
            if sizes[k] is None:
                raise CortiqError(f"{path}: an alias refers to itself (line {node.start_mark.line + 1})")
            return sizes[k]
        sizes[k] = None
        n = 1
        if isinstance(node, yaml.SequenceNode):
            n += sum(size(c, depth + 1) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            n += sum(size(a, depth + 1) + size(b, depth + 1) for a, b in node.value)
        if n > MAX_PARAM_VALUES:
            raise CortiqError(f"{path}: expands to more than {MAX_PARAM_VALUES} values with its aliases resolved "
                              f"(nested YAML aliases); a parameter set is a few dozen")
        sizes[k] = n
        return n

    size(root, 0)
