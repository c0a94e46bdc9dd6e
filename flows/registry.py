"""The MLflow Model Registry: each flow run's final model becomes a version of
the registered model named after its parameter set.

A version's source is the model file the run logged as an artifact or, above
the run's artifact size limit, the reference it logged instead (path, bytes,
sha256); the version carries the run's test NLL, gap recovered, drafts per
round, the digest of the data it was scored on, and the model's sha256 as
tags. The alias `champion` moves to a new version only when its test NLL
beats the current champion's on the same data digest: NLLs on different
data are not comparable, so a champion scored on other data stays until a
version scored on the same data beats it (or is moved by hand). Every
version records why it did or did not take the alias (tag
`champion_decision`).

Everything goes through `MlflowClient` with explicit names, ids and versions
(no active run, no thread-local state).
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from cortiq.cmf import open_cmf

CHAMPION = "champion"


def sha256_of(paths: list[Path]) -> str:
    """sha256 of the model's files, in order (one file: that file's sha256)."""
    if len(paths) == 1:
        h = hashlib.sha256()
        with open(paths[0], "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()
    return hashlib.sha256("".join(sha256_of([p]) for p in paths).encode()).hexdigest()


def _fmt(v) -> str:
    # repr: the shortest text that reads back as the same float, so a later
    # comparison against the tag is a comparison against the value itself
    return "" if v is None else repr(float(v))


def ensure_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=f"final models of the cortiq parameter set {name!r}")


def champion(client, name: str):
    """The version the alias points at, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None


def decide(current, test_nll: float | None, data_digest: str) -> tuple[bool, str]:
    """(take the alias?, why) for a new version against the current champion."""
    if test_nll is None or not math.isfinite(test_nll):
        return False, "no test NLL"
    if current is None:
        return True, "first version with a test NLL"
    digest = current.tags.get("data_digest", "")
    if digest != data_digest:
        return False, f"champion v{current.version} was scored on other data ({digest[:12]} vs {data_digest[:12]})"
    try:
        best = float(current.tags["test_nll"])
    except (KeyError, ValueError):
        return True, f"champion v{current.version} has no test NLL"
    if test_nll < best:
        return True, f"test NLL {test_nll:.6g} < champion v{current.version}'s {best:.6g}"
    return False, f"test NLL {test_nll:.6g} >= champion v{current.version}'s {best:.6g}"


def register(client, name: str, run_id: str, model: str | Path, limit_mb: float, test_nll: float | None,
             data_digest: str, gap_recovered: float | None = None, drafts_per_round: float | None = None,
             tags: dict | None = None) -> dict:
    """Register `model` (logged by run `run_id` under its `models/` artifacts, as
    `flows.tracking.log_model_file` logs it) as a new version of `name`, and move
    `champion` to it when it wins (see the module doc). Returns name, version,
    whether it is champion, and why."""
    model = Path(model)
    files = open_cmf(model).paths
    size = sum(p.stat().st_size for p in files)
    by_ref = size > limit_mb * 1e6
    base = client.get_run(run_id).info.artifact_uri.rstrip("/") + "/models"
    source = f"{base}/{model.name}.ref.json" if by_ref else f"{base}/{model.name}"
    vtags = {
        "test_nll": _fmt(test_nll),
        "gap_recovered": _fmt(gap_recovered),
        "drafts_per_round": _fmt(drafts_per_round),
        "data_digest": data_digest,
        "sha256": sha256_of(files),
        "bytes": str(size),
        "storage": "reference" if by_ref else "artifact",
        "path": str(model.resolve()),
        **{k: str(v) for k, v in (tags or {}).items()},
    }
    ensure_model(client, name)
    current = champion(client, name)
    mv = client.create_model_version(name, source, run_id=run_id, tags=vtags,
                                     description=f"{model.name} from run {run_id}")
    take, why = decide(current, test_nll, data_digest)
    if take:
        client.set_registered_model_alias(name, CHAMPION, mv.version)
    client.set_model_version_tag(name, mv.version, "champion_decision", why)
    client.set_tag(run_id, "registry.model", name)
    client.set_tag(run_id, "registry.version", str(mv.version))
    return {"name": name, "version": int(mv.version), "champion": take, "reason": why}


def register_final(st, model: str | Path) -> dict:
    """Register a flow run's final model (after `Stages.artifacts` logged it): the
    test NLL is the healed model's (the draft does not change the trunk's
    logits), gap recovered as the flow reports it (flows.summary.gap), drafts
    per round from the MTP stage."""
    from .summary import codec_rows, facts, gap, metric

    g = gap(st)
    s = st.settings
    # both named texts: the data's own test split and the general panel (each text's gap and excess NLL)
    tags = {}
    for name, t in ((g or {}).get("texts") or {}).items():
        tags.update({f"{name}_text": t["text"], f"{name}_excess_nll": _fmt(t["excess"]["healed"]),
                     f"{name}_gap_recovered": _fmt(t.get("gap_recovered"))})
    # facts kept of the source's (the fact probe's held part): facts_kept, facts_kept_share
    kept = facts(st).get("healed") or {}
    if kept.get("source_known") is not None:
        tags.update({"facts_kept": f"{kept['kept']}/{kept['source_known']}", "facts_kept_share": _fmt(kept["kept_share"])})
    # each codec's NLL on the test split and on every panel text: codec.<c>.nll, codec.<c>.nll.<text>
    for c, row in codec_rows(st).items():
        tags[f"codec.{c}.nll"] = _fmt(row["nll"])
        tags.update({f"codec.{c}.nll.{p}": _fmt(v) for p, v in row["panel"].items()})
    out = register(st.log.client, s.name, st.log.run_id, model, s.run.artifact_limit_mb, metric(st, "score.healed", "nll"),
                   (st.results.get("data") or {}).get("digest", ""), g and g["gap_recovered"],
                   metric(st, "mtp", "drafts_per_round_after"), tags)
    print(f"registered {out['name']} v{out['version']}" + (" (champion)" if out["champion"] else "") + f": {out['reason']}")
    return out


def versions_table(client, run_ids: list[str]) -> str:
    """The registered versions the runs made, one line each (what `cortiq compare` shows)."""
    rows = []
    for rid in run_ids:
        for found in client.search_model_versions(f"run_id = '{rid}'"):
            mv = client.get_model_version(found.name, found.version)  # a search leaves the aliases out
            rows.append((mv.name, f"v{mv.version}", ",".join(mv.aliases or []) or "-", mv.tags.get("test_nll", ""),
                         mv.tags.get("gap_recovered", ""), mv.tags.get("drafts_per_round", ""),
                         mv.tags.get("data_digest", "")[:12], rid[:12], mv.tags.get("storage", "")))
    if not rows:
        return ""
    head = ("model", "version", "aliases", "test NLL", "gap rec.", "drafts/round", "data", "run", "stored as")
    ws = [max(len(str(x[i])) for x in rows + [head]) for i in range(len(head))]
    return "\n".join("  ".join(f"{str(v):<{w}}" for v, w in zip(row, ws)).rstrip() for row in [head] + rows)


def registered_versions(uri: str, run_ids: list[str]) -> str:
    """`versions_table` on the tracking store at `uri`."""
    from .tracking import client_for

    return versions_table(client_for(uri), run_ids)
