"""The command line and the flows run the same stages through one runner: one cache.

`cortiq compress` then the compress flow on the same source, data and settings
reuse the masks and the student; a changed heal setting recomputes exactly
the stages downstream of it."""

from __future__ import annotations

from pathlib import Path

from cortiq.cli import main
from cortiq.data.build import build
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
                 "--masks-max-steps", "4", "--masks-window", "32", "--masks-batch", "2", "--masks-eval-every", "2"]) == 0
    p = tiny_params(tiny)
    p["compress"] = {"keep_frac": 0.5, "masks": dict(MASKS)}
    out = compress(p)
    assert out["states"]["data"] == "Completed"  # the flow builds its own tdata (same digest as td)
    assert out["states"]["masks"] == "Cached" and out["states"]["fold"] == "Cached"
    assert Path(out["outputs"]["fold"]).read_bytes() == student.read_bytes()


def test_a_changed_setting_recomputes_exactly_the_stages_downstream(tiny, tiny_params):
    p = tiny_params(tiny)
    p["heal"]["train_from"] = 1
    first = heal(p)
    assert set(first["states"].values()) == {"Completed"}
    p["heal"]["lr"] = 2e-3  # what training does, not what the teacher or the frozen prefix produce
    again = heal(p)
    assert again["states"] == {"data": "Cached", "masks": "Cached", "fold": "Cached", "targets": "Cached",
                               "prefix": "Cached", "train": "Completed", "heal": "Completed",
                               "score.source": "Cached", "score.pruned": "Cached", "score.healed": "Completed"}
