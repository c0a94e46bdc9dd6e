"""What the flows share: running a stage task through its cache, logging its report, the plots.

`Stages.run` calls a stage's task, which reuses the stage's finished output
(the run is Cached) or makes it; nothing is read back from Prefect's result
store, so a deleted output is recomputed, never a dead path. Every stage's
metrics are logged from the task's result, so a cached stage still shows up in
the MLflow run; per-step history is logged from the report only when the stage
did not log it live (it was cached or reused).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from cortiq import runner
from cortiq.runner import Stage
from cortiq.settings import PipelineSettings
from tasks.stage import stage_task

from .tracking import MlflowLogger, log_json, log_model_file


class Stages:
    """Runs stage tasks for one flow run and keeps their results."""

    def __init__(self, settings: PipelineSettings, log: MlflowLogger):
        self.settings = settings
        self.log = log
        self.out_root = str(settings.run.out_dir())
        Path(self.out_root).mkdir(parents=True, exist_ok=True)
        self.results: dict[str, dict] = {}
        self.states: dict[str, str] = {}

    def run(self, stage: Stage, key: str | None = None, **params) -> dict:
        """Run `stage` as the task of that name; `key` (default: the stage's name,
        `score.healed` for one of several) is what its metrics are logged under."""
        key = key or stage.name
        # a run that cannot be keyed (a missing input) fails here once, not through the task's retries
        runner.cache_entry(stage, self.out_root, **params)
        t = stage_task(stage).with_options(
            retries=self.settings.run.retries,
            retry_delay_seconds=self.settings.run.retry_delay_s,
            task_run_name=key,
        )
        # the Prefect edge: the task gets JSON values, and builds the settings back (the same digest)
        state = t(self.out_root, runner.json_params(stage, params), logger=self.log.child(f"{key}."),
                  return_state=True)
        result = state.result()  # raises the stage's error when it failed
        self.results[key] = result
        self.states[key] = state.name
        live = state.name != "Cached" and not result.get("reused")
        self._log_report(key, result, history=not live)
        self.log.flush()  # the stage's metrics are in the run when the stage is done
        return result

    def _log_report(self, key: str, result: dict, history: bool) -> None:
        rep = result.get("report") or {}
        metrics = {k: v for k, v in (rep.get("metrics") or {}).items() if isinstance(v, (int, float))}
        if metrics:
            self.log.child(f"{key}.").log_metrics(metrics)
        if history:  # every row at once (one batch, not a store round trip per row)
            rows = [(int(row.get("step", i)), {k: v for k, v in row.items() if k != "step"})
                    for i, row in enumerate(list(rep.get("history") or []) + list(rep.get("evals") or []))]
            self.log.child(f"{key}.").log_rows(rows)
        self.log.set_tags({f"digest.{key}": result["digest"], f"state.{key}": self.states.get(key, "")})

    def artifacts(self, models: dict[str, str]) -> None:
        """The output models (or references), the provenance of each, and the plots."""
        from cortiq.cmf import open_cmf

        limit = self.settings.run.artifact_limit_mb
        for label, path in models.items():
            log_model_file(self.log, path, limit)
            log_json(self.log, f"{label}.provenance.json", open_cmf(path).provenance, "provenance")
        log_json(self.log, "settings.json", self.settings.to_dict())
        log_json(self.log, "stages.json", {k: {"digest": r["digest"], "path": r["path"], "state": self.states.get(k)}
                                           for k, r in self.results.items()})
        with tempfile.TemporaryDirectory() as d:
            for p in plots(self.results, Path(d)):
                self.log.log_artifact(str(p), "plots")


# ── plots ────────────────────────────────────────────────────────────────

def _history(result: dict | None) -> list[dict]:
    return list(((result or {}).get("report") or {}).get("history") or [])


def plots(results: dict[str, dict], out: Path) -> list[Path]:
    """PNG plots of what a person would rather look at than read: held-out loss
    curves, NLL per model, hold rate per chain step before/after, bytes and NLL per codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    curves = []
    for key, r in results.items():
        rep = (r or {}).get("report") or {}
        # heal's evaluations, the mask run's hard-mask evaluations, the draft's held-out KL
        rows = list(rep.get("evals") or []) + _history(r)
        for row_key in ("heldout", "val_hard", "heldout_kl"):
            pts = [(row.get("step", i), row[row_key]) for i, row in enumerate(rows) if row_key in row]
            if pts:
                curves.append((f"{key} {row_key}", pts))
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, pts in curves:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss")
        ax.legend()
        ax.set_title("held-out loss")
        made.append(_save(fig, out / "heldout_loss.png"))

    nll = {k.removeprefix("score."): r["report"]["metrics"]["nll"] for k, r in results.items()
           if k.startswith("score.") and "nll" in r["report"].get("metrics", {})}
    if nll:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(list(nll), list(nll.values()), color="tab:blue")
        ax.set_ylabel("test NLL (nats / token)")
        ax.set_title("NLL per model")
        for i, v in enumerate(nll.values()):
            ax.text(i, v, f"{v:.3f}", ha="center", va="bottom")
        made.append(_save(fig, out / "nll_per_model.png"))

    mrep = (results.get("mtp") or {}).get("report") or {}
    before, after = (mrep.get("before") or {}).get("hold"), (mrep.get("after") or {}).get("hold")
    if before or after:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rates in (("before", before), ("after", after)):
            if rates:
                ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
        ax.set_xlabel("chain step")
        ax.set_ylabel("hold rate")
        ax.set_ylim(0, 1)
        ax.legend()
        ax.set_title("MTP draft hold rate per chain step")
        made.append(_save(fig, out / "hold_rate.png"))

    codecs = {}
    for k, r in results.items():
        if k.startswith("reencode."):
            c = k.removeprefix("reencode.")
            codecs.setdefault(c, {})["bytes"] = r["report"]["metrics"]["bytes"]
        if k.startswith("score.reencode."):
            c = k.removeprefix("score.reencode.")
            codecs.setdefault(c, {})["nll"] = r["report"]["metrics"]["nll"]
    if codecs:
        fig, ax1 = plt.subplots(figsize=(7, 4))
        names = list(codecs)
        ax1.bar(names, [codecs[c].get("bytes", 0) / 1e6 for c in names], color="tab:gray")
        ax1.set_ylabel("size (MB)")
        ax2 = ax1.twinx()
        ax2.plot(names, [codecs[c].get("nll", float("nan")) for c in names], color="tab:red", marker="o")
        ax2.set_ylabel("test NLL", color="tab:red")
        ax1.set_title("bytes and NLL per codec")
        made.append(_save(fig, out / "codecs.png"))
    return made


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


@contextlib.contextmanager
def quiet_prefect() -> Any:
    """Flow runs without the per-run heartbeat thread (measured: ~1 s a flow run with it, ~0.1 s without)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def flow_run_id() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.id or "")


def flow_run_name() -> str:
    from prefect.runtime import flow_run

    return str(flow_run.name or "")
