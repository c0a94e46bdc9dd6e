"""`cortiq compare RUN RUN...`: MLflow runs side by side, and a comparison plot."""

from __future__ import annotations

import sys

HELP = "compare MLflow runs side by side (params, stage metrics, registered model versions) and write a comparison plot"
ORDER = 20


def add_arguments(p):
    p.add_argument("runs", nargs="+", metavar="RUN", help="MLflow run ids (two or more)")
    p.add_argument("--tracking-uri", default="", help="MLflow tracking URI (default: sqlite under the cortiq home)")
    p.add_argument("--plot", default="compare.png", metavar="PNG", help="where the comparison plot goes")
    p.add_argument("--all-params", action="store_true", help="show every param, not only those that differ")


def run(args) -> int:
    import importlib.util

    from cortiq.errors import CortiqError
    from cortiq.settings import RunSettings

    if len(args.runs) < 2:
        raise CortiqError("compare needs at least two runs")
    if importlib.util.find_spec("mlflow") is None or importlib.util.find_spec("flows") is None:
        raise CortiqError("compare needs mlflow and cortiq's flows: pip install 'cortiq[flows]'")
    from flows.compare import load_runs, plot, table  # the orchestrator's side: cortiq/ never imports mlflow

    uri = RunSettings(tracking_uri=args.tracking_uri or "").tracking()
    runs = load_runs(uri, args.runs)
    print(table(runs, args.all_params), file=sys.stdout)
    from flows.registry import registered_versions

    versions = registered_versions(uri, args.runs)
    if versions:
        print(f"\nregistered model versions:\n{versions}", file=sys.stdout)
    print(f"\nplot: {plot(runs, args.plot)}", file=sys.stdout)
    return 0
