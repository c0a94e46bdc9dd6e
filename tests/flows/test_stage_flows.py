"""The standalone flows compress, heal and mtp-heal: each runs its stages, and
they share one cache with compress-and-heal (the same digests)."""

from __future__ import annotations

import math

from flows.compress import compress
from flows.compress_and_heal import compress_and_heal
from flows.heal import heal
from flows.mtp_heal import mtp_heal


def test_compress_then_heal_then_the_whole_pipeline_share_the_cache(tiny, tiny_params):
    p = tiny_params(tiny)
    a = compress(p)
    assert list(a["states"]) == ["data", "masks", "fold", "score.source", "score.pruned"]
    assert set(a["states"].values()) == {"Completed"}
    assert a["bytes"]["pruned"] < a["bytes"]["source"] and math.isfinite(a["nll"]["pruned"])

    # text of another source, scored whole: the gap is reported on it, and says so
    other = tiny["dir"] / "other.txt"
    other.write_text("\n\n".join(f"record {i}: the quick brown fox jumps over the lazy dog " * 3 for i in range(12)))
    p["data"]["eval_sources"] = [str(other)]
    b = heal(p)
    assert b["states"]["fold"] == "Cached" and b["states"]["train"] == b["states"]["heal"] == "Completed"
    assert b["nll"]["pruned"] == a["nll"]["pruned"] and math.isfinite(b["nll"]["healed"])
    assert {"data.eval", "score.eval.source", "score.eval.pruned", "score.eval.healed"} <= set(b["states"])
    n = {k: b["nll"][f"eval.{k}"] for k in ("source", "pruned", "healed")}
    assert n["source"] != b["nll"]["source"]  # another text, another score
    # the general panel (here that one text) and the data's own test split, each named
    assert b["gap"]["text"].startswith("general panel")
    assert b["gap"]["texts"]["panel"]["parts"]["eval"]["text"] == f"held-out text of another source: {other}"
    assert b["gap"]["texts"]["data"]["text"].startswith("test split")
    assert b["gap"]["gap_recovered"] == (n["pruned"] - n["healed"]) / (n["pruned"] - n["source"])
    assert b["gap"]["texts"]["panel"]["excess"]["healed"] == n["healed"] - n["source"]

    c = compress_and_heal(p)
    assert {c["states"][k] for k in ("data", "masks", "fold", "targets", "train", "heal", "score.healed",
                                     "data.eval")} == {"Cached"}
    assert c["states"]["mtp"] == "Completed"
    # every codec row is scored on the held-out text too (every record of it), beside the test split
    q8 = c["codecs"]["q8"]
    assert c["states"]["score.panel.eval.reencode.q8"] == "Completed"
    assert math.isfinite(q8["panel"]["eval"]) and q8["panel"]["eval"] != q8["nll"]


def test_mtp_heal_drafts_any_model(tiny, tiny_params):
    out = mtp_heal(tiny_params(tiny))
    assert list(out["states"]) == ["data", "mtp_init", "trunk", "mtp", "qgrams.q8", "reencode.q8", "score.reencode.q8"]
    # the figures the run reports are the ones the trained model carries in its provenance
    from cortiq.cmf import open_cmf

    prov = open_cmf(out["outputs"]["mtp"]).provenance["mtp_heal"]
    assert prov["steps"] > 0
    assert out["drafts_per_round"] == {"before": prov["drafts_per_round_before"], "after": prov["drafts_per_round_after"]}
    assert math.isfinite(out["codecs"]["q8"]["nll"])
