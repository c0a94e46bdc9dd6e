"""Compare MLflow runs: a side-by-side table and a plot (what `cortiq compare` shows)."""

from __future__ import annotations

from cortiq.errors import CortiqError


def load_runs(uri: str, ids: list[str]):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = []
    for rid in ids:
        try:
            runs.append(client.get_run(rid))
        except MlflowException:
            raise CortiqError(f"{uri}: no MLflow run {rid}") from None
    return runs


def table(runs, all_params: bool = False) -> str:
    """Params (those that differ, unless all) and final metric values, one column per run."""
    names = [r.info.run_name or r.info.run_id[:8] for r in runs]
    head = [r.info.run_id[:12] for r in runs]
    rows = [("run", head), ("name", names), ("params", [r.data.tags.get("cortiq.params", "") for r in runs])]
    keys = sorted(set().union(*(r.data.params for r in runs)))
    for k in keys:
        vals = [r.data.params.get(k, "") for r in runs]
        if all_params or len(set(vals)) > 1:
            rows.append((k, vals))
    mkeys = sorted(set().union(*(r.data.metrics for r in runs)))
    for k in mkeys:
        rows.append((k, [_num(r.data.metrics.get(k)) for r in runs]))
    w0 = max(len(k) for k, _ in rows)
    ws = [max(len(str(v[i])) for _, v in rows) for i in range(len(runs))]
    lines = []
    for k, vals in rows:
        lines.append(f"{k:<{w0}}  " + "  ".join(f"{str(v):>{w}}" for v, w in zip(vals, ws)))
    return "\n".join(lines)


def _num(v):
    return "" if v is None else f"{v:.4g}"


def plot(runs, path: str) -> str:
    """Bar groups of the metrics every run has (NLL per model, sizes...), one bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    common = sorted(set.intersection(*(set(r.data.metrics) for r in runs)))
    nll = [k for k in common if k.endswith(".nll")]
    size = [k for k in common if k.endswith(".bytes")]
    groups = [(g, t) for g, t in ((nll, "test NLL"), (size, "bytes")) if g] or [(common[:12], "value")]
    fig, axes = plt.subplots(len(groups), 1, figsize=(max(6, 1.2 * max(len(g) for g, _ in groups) * len(runs)), 4 * len(groups)),
                             squeeze=False)
    for ax, (keys, title) in zip(axes[:, 0], groups):
        x = np.arange(len(keys))
        width = 0.8 / len(runs)
        for i, r in enumerate(runs):
            ax.bar(x + i * width, [r.data.metrics[k] for k in keys], width,
                   label=f"{r.data.tags.get('cortiq.params', '')} {r.info.run_id[:8]}")
        ax.set_xticks(x + 0.4 - width / 2, keys, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
