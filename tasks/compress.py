"""The compress stage as Prefect tasks: masks, grams, fold, gptq (each cached on its digest).

The same cortiq stage functions `cortiq compress` chains (cortiq.compress.stages);
here each is its own task, so a re-run after a failure in the fold reuses the
learned masks and the captured Grams.
"""

from __future__ import annotations

from pathlib import Path

from cortiq import tracking

from .common import Plan, execute, plan, stage_task


def _versions() -> dict:
    from cortiq.compress.stages import VERSIONS

    return VERSIONS


def plan_masks(model: str, tdata: str, settings: dict, out_root: str, **_) -> Plan:
    return plan("masks", _versions()["masks"], settings, {"model": model, "tdata": tdata}, out_root)


@stage_task("masks")
def masks_task(model: str, tdata: str, settings: dict, out_root: str, logger=None, device: str = "auto",
               compute_dtype: str = "auto") -> dict:
    """DTG-MA: gate logits of every MLP neuron learned under a rising L1 pull."""
    from cortiq.compress.settings import MaskSettings
    from cortiq.compress.stages import learn_masks

    return execute(plan_masks(model, tdata, settings, out_root),
                   lambda out: learn_masks(Path(model), Path(tdata), MaskSettings(**settings), out, logger or tracking.NULL,
                                             device, compute_dtype))


def plan_grams(model: str, tdata: str, settings: dict, out_root: str, **_) -> Plan:
    return plan("grams", _versions()["grams"], settings, {"model": model, "tdata": tdata}, out_root)


@stage_task("grams")
def grams_task(model: str, tdata: str, settings: dict, out_root: str, logger=None, device: str = "auto",
               compute_dtype: str = "auto") -> dict:
    """Grams of every MLP's down_proj input over the train windows (repair, activation ranking, GPTQ)."""
    from cortiq.compress.settings import GramSettings
    from cortiq.compress.stages import capture_grams

    return execute(plan_grams(model, tdata, settings, out_root),
                   lambda out: capture_grams(Path(model), Path(tdata), None, GramSettings(**settings), out,
                                             logger or tracking.NULL, device, compute_dtype))


def plan_fold(model: str, masks: str | None, grams: str | None, settings: dict, out_root: str, **_) -> Plan:
    inputs = {"model": model, "masks": masks or {"digest": "-"}, "grams": grams or {"digest": "-"}}
    return plan("fold", _versions()["fold"], settings, inputs, out_root, "cmf")


@stage_task("fold")
def fold_task(model: str, masks: str | None, grams: str | None, settings: dict, out_root: str, logger=None,
              device: str = "auto") -> dict:
    """The student: the MLPs sliced to the kept neurons (down_proj repaired when asked)."""
    from cortiq.compress.settings import FoldSettings
    from cortiq.compress.stages import fold

    return execute(plan_fold(model, masks, grams, settings, out_root),
                   lambda out: fold(Path(model), masks and Path(masks), grams and Path(grams), FoldSettings(**settings),
                                    out, logger or tracking.NULL, device))


def plan_gptq(model: str, grams: str, settings: dict, out_root: str, **_) -> Plan:
    return plan("gptq", _versions()["gptq"], settings, {"model": model, "grams": grams}, out_root, "cmf")


@stage_task("gptq")
def gptq_task(model: str, grams: str, settings: dict, out_root: str, logger=None, device: str = "auto") -> dict:
    """The student quantized into the q4/q8 codecs by GPTQ from the same Grams."""
    from cortiq.compress.settings import GptqSettings
    from cortiq.compress.stages import gptq

    return execute(plan_gptq(model, grams, settings, out_root),
                   lambda out: gptq(Path(model), Path(grams), GptqSettings(**settings), out, logger or tracking.NULL, device))
