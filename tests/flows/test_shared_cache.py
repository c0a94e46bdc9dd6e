"""The command line and the flows run the same stages through one runner: one cache.

`cortiq compress` then the compress flow on the same source, data and settings
reuse the masks and the student; a changed heal setting recomputes exactly
the stages downstream of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortiq.cli import main
from cortiq.data.builder import build
from cortiq.data.settings import BuildSettings
from flows.compress import compress
from flows.heal import heal

MASKS = {"max_steps": 4, "window": 32, "batch": 2, "eval_every": 2}


def test_cli_compress_then_the_flow_reuse_the_same_outputs(tiny, tiny_params):
    td = tiny["dir"] / "td"
    # the tdata the flow's data stage makes from the same sources and settings (same digest)
    build([tiny["corpus"]], tiny["model"], td, BuildSettings(record_tokens=64, fractions=(0.6, 0.2, 0.2)))
    student = tiny["dir"] / "student.cmf"
    assert main(["compress", tiny["model"], "--data", str(td), "--out", str(student), "--keep-frac", "0.5",
                 "--masks-max-steps", "4", "--masks-window", "32", "--masks-batch", "2", "--masks-eval-every", "2",
                 "--retain-sources", "none"]) == 0
    p = tiny_params(tiny)
    p["compress"] = {"keep_frac": 0.5, "masks": dict(MASKS)}
    out = compress(p)
    assert out["states"]["data"] == "Completed"  # the flow builds its own tdata (same digest as td)
    assert out["states"]["masks"] == "Cached" and out["states"]["fold"] == "Cached"
    assert Path(out["outputs"]["fold"]).read_bytes() == student.read_bytes()


def test_the_cli_runner_then_the_flow_share_every_stage_of_the_one_chain(tiny, tiny_params):
    """cortiq.chains.compress_and_heal run by the command line's runner, then the compress-and-heal flow on the
    same parameters: the flow runs the same stages with the same digests and recomputes none."""
    from cortiq import chains
    from cortiq.runner import LocalRunner
    from cortiq.settings import load_settings
    from flows.compress_and_heal import compress_and_heal

    p = tiny_params(tiny)
    s = load_settings(p)
    runner = LocalRunner(s.run.out_dir(), progress=False)
    final, _ = chains.compress_and_heal(runner, s)
    assert not any(r["reused"] for r in runner.results.values())
    out = compress_and_heal(p)
    assert list(out["states"]) == list(runner.results)
    assert set(out["states"].values()) == {"Cached"}
    assert {k: v for k, v in out["outputs"].items()} == {k: r["path"] for k, r in runner.results.items()}
    assert out["outputs"]["mtp"] == final


def test_a_changed_setting_recomputes_exactly_the_stages_downstream(tiny, tiny_params):
    p = tiny_params(tiny)
    p["heal"]["train_from"] = 1
    first = heal(p)
    assert set(first["states"].values()) == {"Completed"}
    p["heal"]["lr"] = 2e-3  # what training does, not what the teacher or the frozen prefix produce
    again = heal(p)
    assert again["states"] == {"data": "Cached", "masks": "Cached", "fold": "Cached", "targets": "Cached",
                               "prefix": "Cached", "train": "Completed", "heal": "Completed",
                               "score.source": "Cached", "score.pruned": "Cached", "score.healed": "Completed",
                               "facts.source": "Cached", "facts.pruned": "Cached", "facts.healed": "Completed"}


def test_a_changed_retain_setting_reruns_exactly_the_stages_it_feeds(tiny, tiny_params):
    from mlflow.tracking import MlflowClient

    other = tiny["dir"] / "other.txt"
    other.write_text("\n\n".join(f"record {i}: the quick brown fox jumps over the lazy dog " * 3 for i in range(40)))
    retain = tiny["dir"] / "other.tdata"
    build([str(other)], tiny["model"], retain, BuildSettings(record_tokens=64, fractions=(0.6, 0.2, 0.2)))
    p = tiny_params(tiny)
    p["heal"]["train_from"] = 1
    p["retain"] = {"sources": [str(retain)], "share": 0.5}
    first = heal(p)
    assert set(first["states"].values()) == {"Completed"}
    assert {"mix", "score.panel.other.source", "score.panel.other.pruned", "score.panel.other.healed"} <= set(first["states"])
    texts = first["gap"]["texts"]
    assert texts["data"]["text"].startswith("test split") and list(texts["panel"]["parts"]) == ["other"]
    assert first["gap"]["text"].startswith("general panel")
    run = MlflowClient(tracking_uri=first["tracking_uri"]).get_run(first["mlflow_run_id"])
    for name in ("data", "panel"):
        assert run.data.metrics[f"heal.{name}.excess_nll"] == pytest.approx(texts[name]["excess"]["healed"])
        assert run.data.tags[f"heal.{name}_text"] == texts[name]["text"]
    p["retain"]["share"] = 0.3  # what every stage reading the mix sees, not the user's data nor the panel
    again = heal(p)
    st = again["states"]
    assert {k: st[k] for k in ("data", "score.source", "score.panel.other.source")} == {k: "Cached" for k in
                                                                                     ("data", "score.source", "score.panel.other.source")}
    assert {k: st[k] for k in ("mix", "masks", "fold", "targets", "prefix", "train", "heal")} == \
        {k: "Completed" for k in ("mix", "masks", "fold", "targets", "prefix", "train", "heal")}
