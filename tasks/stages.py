"""The stage tasks of the pipeline: source, data, mtp (tasks/compress.py and tasks/heal.py hold those stages').

Each is a planner (parameters -> Plan: digest and output path) and a Prefect
task that reuses the output named by that digest or makes one cortiq call. `logger` (a
cortiq.tracking.Logger) is for live metrics only: it never enters the key,
and the flows log every stage's metrics from the returned report, because a
cached task does not run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cortiq import store, tracking
from cortiq.errors import CortiqError

from .common import Plan, execute, plan, stage_task

def _asdict(s):
    return dataclasses.asdict(s) if dataclasses.is_dataclass(s) else s


def _version(module: str, default: str = "1") -> str:
    """A stage's version (its module's VERSION): TASK_SOURCE would hash only the adapter, not the stage."""
    import importlib

    try:
        m = importlib.import_module(module)
    except ImportError:
        return default
    v = getattr(m, "VERSIONS", None) or getattr(m, "VERSION", default)
    return json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v)


# ── source: the model as one CMF file ───────────────────────────────────

def source_kind(source: str) -> str:
    p = Path(source)
    if source == "smollm2":
        return "smollm2"
    if p.suffix == ".cmf":
        return "cmf"
    if p.suffix == ".gguf":
        return "gguf"
    if p.is_dir():
        return "hf"
    raise CortiqError(f"{source}: not a model (a .cmf or .gguf file, a Hugging Face directory, or 'smollm2')")


def _source_path(source: str) -> Path:
    if source == "smollm2":
        from cortiq.convert.bundled import smollm2_path

        return Path(smollm2_path())
    return Path(source)


def plan_source(source: str, out_root: str, **_) -> Plan:
    kind = source_kind(source)
    return plan("source", _version("cortiq.convert"), {"kind": kind}, {"source": _source_path(source)}, out_root, "cmf")


@stage_task("source")
def source_task(source: str, out_root: str, logger=None) -> dict:
    """The source model converted to CMF once (a .cmf source needs no task: the flows use it where it is)."""
    kind = source_kind(source)
    if kind == "cmf":
        raise CortiqError(f"{source}: already a CMF file; nothing to convert")
    p = plan_source(source, out_root)

    def call(out: Path) -> dict:
        src = _source_path(source)
        if kind == "hf":
            from cortiq.convert.hf import convert_hf_dir

            convert_hf_dir(src, out)
        else:
            from cortiq.convert.gguf import convert_gguf

            convert_gguf(src, out)
        from cortiq.cmf import open_cmf

        return {"metrics": {"bytes": float(open_cmf(out).nbytes())}, "source": str(src)}

    return execute(p, call)


# ── data: corpus → tdata (tokenized with the source's tokenizer) ────────

def plan_data(sources: list, model: str, settings: dict, out_root: str, **_) -> Plan:
    from cortiq.data.build import BuildSettings, build_digest

    s = BuildSettings(**settings)
    # the data stage names its own digest (sources by content, the tokenizer by its text)
    d = build_digest(list(sources), model, s)
    return plan("tdata", _version("cortiq.data.tdata"), None, {"build": {"digest": d}}, out_root)


@stage_task("data")
def data_task(sources: list, model: str, settings: dict, out_root: str, logger=None) -> dict:
    from cortiq.data.build import BuildSettings, build

    p = plan_data(sources, model, settings, out_root)

    def call(out: Path) -> dict:
        td = build(list(sources), model, out, BuildSettings(**settings))
        counts = {f"records_{sp}": float(len(td.indices(sp))) for sp in ("train", "val", "test")}
        counts["tokens"] = float(td.n_tokens)
        return {"metrics": counts}

    return execute(p, call)


# ── mtp: a draft for a model without one, the trunk pass, the draft's training ──

def plan_mtp_init(model: str, out_root: str, **_) -> Plan:
    return plan("mtp_init", "1", None, {"model": model}, out_root, "cmf")


@stage_task("mtp_init")
def mtp_init_task(model: str, out_root: str, logger=None) -> dict:
    """The model plus a fresh draft block (for a source that has none, like SmolLM2)."""
    from cortiq.mtp.init import mtp_init

    return execute(plan_mtp_init(model, out_root), lambda out: mtp_init(Path(model), out) or {})


def has_draft(model: str) -> bool:
    from cortiq.cmf import open_cmf

    return "model.mtp.eh_proj.weight" in open_cmf(model)


def plan_trunk(model: str, tdata: str, settings: dict, out_root: str, **_) -> Plan:
    from cortiq.mtp.settings import MtpSettings

    s = MtpSettings(**settings)
    # what the trunk pass depends on: the trunk, the data, the window / top-k / token cap and the generated data
    key = {"window": s.window, "topk": s.topk, "tokens": s.tokens, "preset": s.preset, "generate": s.generate,
           "gen": [s.gen_prompt, s.gen_chat, s.gen_temperature, s.seed]}
    return plan("trunk", _version("cortiq.mtp.trunk"), key, {"model": model, "tdata": tdata}, out_root)


@stage_task("trunk")
def trunk_task(model: str, tdata: str, settings: dict, out_root: str, logger=None) -> dict:
    """The trunk's last hidden rows and next-token top-k per window (the trunk cache the draft trains on)."""
    from cortiq.mtp import trunk_pass
    from cortiq.mtp.settings import MtpSettings

    p = plan_trunk(model, tdata, settings, out_root)

    def call(out: Path) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        rep = trunk_pass(Path(model), str(tdata), MtpSettings(**settings), out)
        store.finish_dir(out, {"stage": "trunk", "digest": p.digest, "report": rep})
        return rep

    return execute(p, call)


def plan_mtp(model: str, tdata: str, trunk: str, settings: dict, out_root: str, **_) -> Plan:
    return plan("mtp", _version("cortiq.mtp"), settings, {"model": model, "tdata": tdata, "trunk": trunk}, out_root, "cmf")


@stage_task("mtp_heal")
def mtp_task(model: str, tdata: str, trunk: str, settings: dict, out_root: str, logger=None) -> dict:
    """The draft trained on the trunk's own predictions (read back from the trunk cache)."""
    from cortiq.mtp import mtp_heal
    from cortiq.mtp.settings import MtpSettings

    p = plan_mtp(model, tdata, trunk, settings, out_root)
    s = MtpSettings(**{**settings, "trunk_cache": str(trunk)})
    # the data spec is the tdata directory (cortiq.data.windows.parse_spec: PATH[@TOKENS])
    return execute(p, lambda out: mtp_heal(Path(model), str(tdata), s, out, logger=logger or tracking.NULL))
