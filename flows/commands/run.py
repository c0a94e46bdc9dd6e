"""`cortiq run FLOW --params FILE`: run a Prefect flow on Prefect's embedded server (no server needed)."""

from __future__ import annotations

import sys

HELP = "run a pipeline flow (compress-and-heal, compress, heal, mtp-heal) on a parameter set, cached and tracked"
DESCRIPTION = ("Run a Prefect flow on a named parameter set (a YAML file, see deployments/params/). Every stage is "
               "cached on the digest of its inputs and settings: a failed run, run again, resumes at the stage that "
               "failed. One MLflow run per flow run (default store: sqlite under the cortiq home).")
ORDER = 10

FLOWS = {
    "compress-and-heal": ("flows.compress_and_heal", "compress_and_heal"),
    "compress": ("flows.compress", "compress"),
    "heal": ("flows.heal", "heal"),
    "mtp-heal": ("flows.mtp_heal", "mtp_heal"),
}


def add_arguments(p):
    p.add_argument("flow", choices=sorted(FLOWS), help="the flow to run")
    p.add_argument("--params", required=True, metavar="FILE", help="parameter set (YAML)")


def load_flow(name: str):
    """The flow function, or a clear error when the orchestrator is not installed."""
    import importlib
    import importlib.util

    from cortiq.errors import CortiqError

    missing = [m for m in ("prefect", "mlflow", "tasks", "flows") if importlib.util.find_spec(m) is None]
    if missing:
        raise CortiqError(f"the {name} flow needs {' and '.join(missing)}: pip install 'cortiq[flows]'")
    importlib.import_module("tasks")  # the offline environment, set before prefect's settings are read
    mod, fn = FLOWS[name]
    return getattr(importlib.import_module(mod), fn)


def run_flow(name: str, params) -> dict:
    """Run a flow without the per-run heartbeat and return its summary, on a Prefect server
    that dies with this process (flows.server) unless one is configured."""
    from cortiq.settings import load_settings

    settings = load_settings(params)  # a bad key fails here, before prefect starts
    flow = load_flow(name)
    from flows.common import quiet_prefect
    from flows.server import embedded_server

    with embedded_server(), quiet_prefect():
        return flow(settings.to_dict() if not isinstance(params, str) else str(params))


def run(args) -> int:
    from flows.summary import print_summary

    summary = run_flow(args.flow, args.params)
    print_summary(summary, sys.stdout)
    return 0
