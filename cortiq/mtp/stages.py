"""The MTP stages and their chain: mtp init (a model without a draft), the trunk pass,
the draft trained on it (cortiq.mtp.heal does the work)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .. import dist
from ..runner import Stage, settings_gpus
from .heal import _say, mtp_heal, mtp_init, recode_draft, trunk_pass
from .settings import MtpSettings


def mtp_chain(runner, model, data: str, settings: MtpSettings, say=_say) -> str:
    """mtp init (when `model` carries no draft) → the trunk pass over `data` (a tdata directory, or
    a spec PATH[@TOKENS],...) → the draft trained on it; each `also` (codec, path) of the settings
    is then written from the result and re-measured (rank 0)."""
    from ..cmf import open_cmf
    from .init import has_draft

    if not has_draft(open_cmf(model)):
        model = runner.run(MTP_INIT, model=model)["path"]
    m = replace(settings, also=[])  # the stage writes its own output; `also` is done below
    trunk = runner.run(TRUNK, model=model, tdata=data, settings=m)["path"]
    r = runner.run(MTP, model=model, tdata=data, trunk=trunk, settings=m)
    if dist.is_main():
        for codec, path in settings.also:
            got = recode_draft(r["path"], codec, path, data, replace(settings, trunk_cache=str(trunk)))
            say(f"mtp: the draft as {codec} -> {path} ({got['metrics'].get('drafts_per_round', float('nan')):.3f} "
                "drafts a round)")
    return r["path"]


# ── the stages, declared once (cortiq.runner runs them for the CLI and the flows) ──

def _init_stage(out, ctx, model) -> dict:
    return mtp_init(Path(model), out) or {}


def _trunk_stage(out, ctx, model, tdata, settings) -> dict:
    from .. import store

    out.mkdir(parents=True, exist_ok=True)
    rep = trunk_pass(Path(model), str(tdata), settings, out)
    if dist.is_main():  # across ranks, rank 0 finishes the directory the ranks' shards went into
        store.finish_dir(out, {"stage": TRUNK.name, "digest": ctx.digest, "report": rep})
    return rep


def _mtp_stage(out, ctx, model, tdata, trunk, settings) -> dict:
    # the data spec is the tdata directory (cortiq.store.parse_data_spec: PATH[@TOKENS])
    s = replace(settings, trunk_cache=str(trunk))
    return mtp_heal(Path(model), str(tdata), s, out, logger=ctx.logger)


MTP_INIT = Stage("mtp_init", 1, _init_stage, None, ("model",), output="cmf",
                 doc="the model plus a fresh draft block (for a source that has none)")
# the generated data's fields as one list: the layout the trunk's digests were first made with
# version 2: the windows generated from a data set are bounded by its tokens (mtp.tokens or PATH@TOKENS),
# where gen_windows asked for more; the same settings made more windows before
TRUNK = Stage("trunk", 2, _trunk_stage, MtpSettings, ("model", "tdata"),
              layout=(("gen", ("gen_prompt", "gen_chat", "gen_temperature", "seed", "gen_share")),),
              doc="the trunk's last hidden rows and next-token top-k per window (what the draft trains on)",
              gpus=settings_gpus)
# version 2: the file holds the draft's token ranking (cortiq.mtp.vocab) that serve's --draft-vocab reads
MTP = Stage("mtp", 2, _mtp_stage, MtpSettings, ("model", "tdata", "trunk"), output="cmf",
            doc="the draft trained on the trunk's own predictions, measured before and after", gpus=settings_gpus)
