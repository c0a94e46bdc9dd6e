"""Score and re-encode: test NLL of a model, and the final model written in other codecs.

Both are cached like the stages: a model's score is keyed on the model's and
the data's digests, so the source is scored once for every parameter set that
shares it, and a re-encode is keyed on the model and the codec.
"""

from __future__ import annotations

import math
from pathlib import Path

from cortiq import store

from .common import Plan, execute, plan, stage_task

SCORE_VERSION = 1
REENCODE_VERSION = 1


def model_nll(model_path: str | Path, tdata: str | Path, window: int, max_tokens: int = 0, batch: int = 4,
             loss_on: str = "answer") -> tuple[float, float]:
    """(summed NLL in nats, scored tokens) of a model on the test split of `tdata`: the
    split's windows of `window` tokens (cortiq.data.windows), the first ones that
    hold `max_tokens` positions (0 = all)."""
    import numpy as np
    import torch

    from cortiq.data.tdata import Tdata
    from cortiq.data.windows import windows
    from cortiq.model import load_model

    td = Tdata.open(tdata)
    w = windows(td, "test", window, loss_on=loss_on)
    n = len(w) if not max_tokens else min(len(w), max(1, math.ceil(max_tokens / window)))
    if n == 0:
        from cortiq.errors import CortiqError

        raise CortiqError(f"{tdata}: the test split has no scored tokens")
    model = load_model(model_path)
    total = torch.zeros((), dtype=torch.float64)
    with torch.inference_mode():
        for b in range(0, n, batch):
            ids = torch.from_numpy(w.ids[b:b + batch])  # [B, T]
            nxt = torch.from_numpy(w.next[b:b + batch])  # [B, T]
            wt = torch.from_numpy(w.weight[b:b + batch])  # [B, T]
            logits = model(ids).float()  # [B, T, V]
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), nxt.flatten(), reduction="none")  # [B·T]
            total += (nll * wt.flatten()).sum().double()
    return float(total), float(np.asarray(w.weight[:n]).sum())


def plan_score(model: str, tdata: str, window: int, max_tokens: int, out_root: str, **_) -> Plan:
    return plan("score", SCORE_VERSION, {"window": window, "max_tokens": max_tokens}, {"model": model, "tdata": tdata},
                out_root)


@stage_task("score")
def score_task(model: str, tdata: str, window: int, max_tokens: int, out_root: str, label: str = "", logger=None) -> dict:
    """Test NLL per scored token of `model` (label: what the flow calls it, for the report)."""
    p = plan_score(model, tdata, window, max_tokens, out_root)

    def call(out: Path) -> dict:
        s, n = model_nll(model, tdata, window, max_tokens)
        from cortiq.cmf import open_cmf

        metrics = {"nll": s / n, "tokens": n, "bytes": float(open_cmf(model).nbytes())}
        with store.stage_dir(out, {"stage": "score", "version": SCORE_VERSION, "digest": p.digest,
                                   "settings": {"window": window, "max_tokens": max_tokens},
                                   "inputs": [store.file_digest(model), store.file_digest(tdata)],
                                   "metrics": metrics}):
            pass
        return {"metrics": metrics}

    r = execute(p, call)
    r["label"] = label
    return r


def plan_reencode(model: str, codec: str, out_root: str, **_) -> Plan:
    return plan("reencode", REENCODE_VERSION, {"codec": codec}, {"model": model}, out_root, "cmf")


@stage_task("reencode")
def reencode_task(model: str, codec: str, out_root: str, logger=None) -> dict:
    """`model` with its 2-D weights in `codec` (norms, biases and vectors stay as stored)."""
    from cortiq import codecs
    from cortiq.cmf import copy_specs, open_cmf, with_provenance, write_cmf

    p = plan_reencode(model, codec, out_root)

    def call(out: Path) -> dict:
        src = open_cmf(model)
        codecs.get(codec)

        def codec_for(name, info):
            return codec if len(info.shape) == 2 else info.codec

        doc = with_provenance({k: v for k, v in src.doc.items() if k not in ("codecs", "hashes", "shards")},
                              "reencode", {"codec": codec, "from": store.file_digest(model)})
        write_cmf(out, doc, copy_specs(src, codec_for))
        return {"metrics": {"bytes": float(open_cmf(out).nbytes())}, "codec": codec}

    return execute(p, call)
