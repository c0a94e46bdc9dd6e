"""What a flow run reports: its stages' metrics, the named texts and their gaps, the codec rows, the
summary `cortiq run` and `cortiq demo` print. Read from a runner's results (flows.common.Stages):
the flows, the registry and the commands all import it, and it imports none of them."""

from __future__ import annotations

import functools
import sys

from cortiq.measure import named_texts


def metric(st, key: str, name: str) -> float | None:
    """A finished stage's report metric (None while the stage has not run)."""
    v = (((st.results.get(key) or {}).get("report") or {}).get("metrics") or {}).get(name)
    return None if v is None else float(v)


def texts(st) -> dict:
    """The two named texts every report shows (cortiq.measure.named_texts) of the texts the flow scored on."""
    return named_texts(st.results, getattr(st, "texts", []))


def gap(st) -> dict | None:
    """The share of the pruning's NLL loss the heal won back: on the general panel when the
    parameter set has one (retain sources, data.eval_sources), else on the data's own test
    split. {"text", "nll", "gap_recovered", "excess", "texts": both named texts}."""
    t = texts(st)
    g = t.get("panel") or t.get("data")
    if g is None:
        return None
    return {"gap_recovered": None, **g, "texts": t}


def facts(st) -> dict:
    """Facts kept of the source's by the pruned and the healed model (cortiq.facts.stages.facts_from)."""
    from cortiq.facts.stages import facts_from

    return facts_from(st.results)


def log_gap(st) -> None:
    """heal.gap_recovered and the three NLLs it comes from as MLflow metrics, the tag heal.gap_text
    saying on which text; and per named text (data, panel) heal.<text>.gap_recovered and
    heal.<text>.excess_nll (the healed model's NLL over the source's), the tag heal.<text>_text."""
    g = gap(st)
    if g is None:
        return
    n = g["nll"]
    st.log.log_metrics({"heal.nll.source": n["source"], "heal.nll.pruned": n["student"], "heal.nll.healed": n["healed"],
                        **({} if g["gap_recovered"] is None else {"heal.gap_recovered": g["gap_recovered"]})})
    st.log.set_tags({"heal.gap_text": g["text"]})
    for name, t in g["texts"].items():
        vals = {f"heal.{name}.gap_recovered": t.get("gap_recovered"), f"heal.{name}.excess_nll": t["excess"]["healed"],
                **{f"heal.{name}.{p}.excess_nll": q["excess"]["healed"] for p, q in t.get("parts", {}).items()}}
        st.log.log_metrics({k: v for k, v in vals.items() if v is not None})
        st.log.set_tags({f"heal.{name}_text": t["text"]})
    # the third measure: heal.facts.<model>.kept (and kept_share, known) on the probe's held part
    st.log.log_metrics({f"heal.facts.{label}.{k}": float(c[k]) for label, c in facts(st).items()
                        for k in ("kept", "kept_share", "known") if c.get(k) is not None})


def codec_rows(st) -> dict:
    """{codec: {"bytes", "nll" (the data's test split), "method" (gptq, awq; rtn for the round-to-nearest
    re-encode, which is also what a plain codec's is), "panel": {text: nll}}} of the re-encode stages run."""
    r = st.results
    m = functools.partial(metric, st)
    names = sorted({k.removeprefix("score.panel.").split(".reencode.")[0] for k in r if k.startswith("score.panel.")})
    return {k.removeprefix("reencode."): {"bytes": m(k, "bytes"), "nll": m(f"score.{k}", "nll"),
                                         "method": (r[k].get("report") or {}).get("method", "rtn"),
                                         "panel": {p: m(f"score.panel.{p}.{k}", "nll") for p in names
                                                   if f"score.panel.{p}.{k}" in r}}
            for k in r if k.startswith("reencode.")}


def summary(st) -> dict:
    """What `cortiq demo` prints: NLL per model, drafts per round before/after, size and NLL per codec."""
    r = st.results
    m = functools.partial(metric, st)
    out = {
        "mlflow_run_id": st.log.run_id,
        "tracking_uri": st.settings.run.tracking(),
        "params": st.settings.name,
        "nll": {k.removeprefix("score."): m(k, "nll") for k in r if k.startswith("score.") and "reencode." not in k},
        "gap": gap(st),
        "facts": facts(st),
        "bytes": {k.removeprefix("score."): m(k, "bytes") for k in r if k.startswith("score.") and "reencode." not in k},
        "codecs": codec_rows(st),
        "states": dict(st.states),
        "outputs": {k: v["path"] for k, v in r.items()},
    }
    if "mtp" in r:
        out["drafts_per_round"] = {"before": m("mtp", "drafts_per_round_before"),
                                   "after": m("mtp", "drafts_per_round_after")}
    return out


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
    if s.get("facts"):
        from cortiq.facts.stages import facts_line

        w(facts_line(s["facts"]) + "\n")
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
