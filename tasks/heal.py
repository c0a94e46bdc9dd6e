"""The heal stage as Prefect tasks: teacher top-k, frozen prefix, train, export (each cached on its digest).

The same cortiq functions `cortiq heal` chains (cortiq.heal); here each is its
own task. The train task's directory is its work directory: a run that failed
mid-training, run again, resumes from the last checkpoint there.
"""

from __future__ import annotations

from pathlib import Path

from cortiq import store, tracking

from .common import Plan, execute, plan, stage_task


def _s(settings: dict):
    from cortiq.heal.settings import HealSettings

    return HealSettings(**settings)


def plan_targets(teacher: str, tdata: str, settings: dict, out_root: str, **_) -> Plan:
    from cortiq.heal import targets

    s = _s(settings)
    # with ce = 1 no teacher runs: the targets do not depend on it
    inputs = {"tdata": tdata, "teacher": teacher if s.ce < 1.0 else {"digest": "-"}}
    return plan("targets", targets.VERSION, s.targets_key(), inputs, out_root)


@stage_task("targets")
def targets_task(teacher: str, tdata: str, settings: dict, out_root: str, logger=None) -> dict:
    """The teacher's top-k next-token distribution per row (ce-mixed, weight-scaled), train and val windows."""
    from cortiq.heal.targets import teacher_targets

    s = _s(settings)
    return execute(plan_targets(teacher, tdata, settings, out_root),
                   lambda out: teacher_targets(teacher if s.ce < 1.0 else None, Path(tdata), s, out,
                                               logger or tracking.NULL))


def plan_prefix(student: str, tdata: str, settings: dict, out_root: str, **_) -> Plan:
    from cortiq.heal import prefix

    return plan("prefix", prefix.VERSION, _s(settings).prefix_key(), {"student": student, "tdata": tdata}, out_root)


@stage_task("prefix")
def prefix_task(student: str, tdata: str, settings: dict, out_root: str, logger=None) -> dict:
    """The frozen layers' output, once per window (f32, f16 or not cached, by the memory budget)."""
    from cortiq.heal.prefix import prefix_cache

    return execute(plan_prefix(student, tdata, settings, out_root),
                   lambda out: prefix_cache(Path(student), Path(tdata), _s(settings), out, logger or tracking.NULL))


def plan_train(student: str, targets: str, prefix: str | None, tdata: str, settings: dict, out_root: str, **_) -> Plan:
    from cortiq.heal.stages import TRAIN_VERSION, _train_key

    inputs = {"student": student, "targets": targets, "prefix": prefix or {"digest": "-"}, "tdata": tdata}
    return plan("train", TRAIN_VERSION, _train_key(_s(settings)), inputs, out_root)


@stage_task("train")
def train_task(student: str, targets: str, prefix: str | None, tdata: str, settings: dict, out_root: str,
               logger=None) -> dict:
    """The student's tail trained on the targets; the best held-out weights kept. Resumes from its checkpoint."""
    from cortiq.heal.stages import train

    p = plan_train(student, targets, prefix, tdata, settings, out_root)

    def call(out: Path) -> dict:
        out.mkdir(parents=True, exist_ok=True)
        rep = train(Path(student), Path(targets), prefix and Path(prefix), Path(tdata), _s(settings), out,
                    logger or tracking.NULL)
        store.finish_dir(out, {"stage": "train", "digest": p.digest, "report": rep})
        return rep

    return execute(p, call)


def plan_export(student: str, teacher: str, train: str, prefix: str | None, settings: dict, out_root: str, **_) -> Plan:
    from cortiq.heal.stages import VERSION

    return plan("heal", VERSION, {"codec": "keep"}, {"student": student, "train": train}, out_root, "cmf")


@stage_task("export")
def export_task(student: str, teacher: str, train: str, prefix: str | None, settings: dict, out_root: str,
                logger=None) -> dict:
    """The healed CMF: the student with the trained weights, in the student's codecs, provenance `heal`."""
    from cortiq.heal.stages import TRAINED, export, provenance_block

    s = _s(settings)

    def call(out: Path) -> dict:
        rep = store.read_meta(train)["report"]
        dtype = store.read_meta(prefix)["dtype"] if prefix else "none"
        block = provenance_block(rep, s, teacher if s.ce < 1.0 else None, dtype)
        export(Path(student), Path(train) / TRAINED, out, block)
        return {"metrics": {k: rep["metrics"][k] for k in ("heldout_start", "heldout_best", "best_step", "steps")}}

    return execute(plan_export(student, teacher, train, prefix, settings, out_root), call)
