"""`cortiq mtp heal|init`: retrain a model's MTP draft on its own trunk; give a model a fresh draft."""

from __future__ import annotations

NAME = "mtp"
HELP = "retrain the MTP draft head on the (compressed) trunk; give a model a fresh draft"
DESCRIPTION = (
    "mtp heal: the trunk runs once over the data (hidden rows + top-k, cacheable), then the draft is trained by "
    "KL to the trunk's distribution one position further, every chain step from its own previous output; the "
    "checkpoint keeping the most drafts a round on held-out windows is written into model.mtp.*. "
    "mtp init: a fresh MTP block for a model without one (layer copied from the trunk's last full-attention "
    "layer, eh_proj passing the hidden row through)."
)
ORDER = 35


def _heal_args(p):
    import argparse
    from dataclasses import fields

    p.add_argument("model", metavar="MODEL.cmf", help="a model with an MTP draft (cortiq mtp init gives one)")
    p.add_argument("--data", required=True, metavar="SPEC", help="PATH.tdata[@TOKENS], comma-separated")
    p.add_argument("--out", required=True, metavar="OUT.cmf", help="the model with its trained draft")
    # every MtpSettings field as an option, its help the field's comment (imported lazily: no torch here)
    from ..mtp.settings import PRESET_CHOICES, PRESETS, MtpSettings, field_help, field_type

    helps = field_help()
    special = {"also", "taps", "trunk_cache", "dump", "gen_cache"}
    g = p.add_argument_group("mtp heal settings (unset preset-controlled ones take the preset's value)")
    for fl in fields(MtpSettings):
        if fl.name in special:
            continue
        opt = "--" + fl.name.replace("_", "-")
        typ = field_type(fl.name)
        h = helps.get(fl.name, "")
        if fl.name in PRESETS["fresh"]:
            h += " (default: the preset's)"
        if typ is bool:
            g.add_argument(opt, action=argparse.BooleanOptionalAction, default=fl.default, help=h)
        else:
            choices = PRESET_CHOICES if fl.name == "preset" else None
            g.add_argument(opt, type=typ, default=fl.default, choices=choices,
                           help=h + ("" if fl.default is None else " (default: %(default)s)"))
    p.add_argument("--trunk-cache", metavar="DIR", default=None, help="keep the trunk pass per data set here")
    p.add_argument("--gen-cache", metavar="DIR", default=None,
                   help="keep the generated windows here (default: the trunk cache, else <cortiq home>/cache/mtp-gen)")
    p.add_argument("--also", action="append", default=[], metavar="CODEC:PATH", help="the result with the draft in another codec (repeatable)")
    p.add_argument("--dump", metavar="DIR", default=None, help="the rows and tensors a draft built elsewhere reads")
    p.add_argument("--taps", metavar="DIR:LAYERS", default=None, help="trunk layers' output rows for held-out windows")


def add_arguments(p):
    sub = p.add_subparsers(dest="mtp_command", metavar="SUBCOMMAND", required=True)
    h = sub.add_parser("heal", help="retrain the draft on the model's own trunk")
    _heal_args(h)
    i = sub.add_parser("init", help="give a model without a draft a fresh MTP block (mtp heal then picks its fresh preset)")
    i.add_argument("model", metavar="MODEL.cmf", help="a model without an MTP draft")
    i.add_argument("--out", required=True, metavar="OUT.cmf", help="the model with a fresh draft")


def run(args) -> int:
    import sys
    from dataclasses import fields

    from ..mtp import MtpSettings, mtp_heal, mtp_init

    if args.mtp_command == "init":
        rep = mtp_init(args.model, args.out)
        print(f"{rep['out']}: fresh MTP block from layer {rep['layer']}", file=sys.stderr)
        return 0
    from .. import dist

    kw = {fl.name: getattr(args, fl.name) for fl in fields(MtpSettings)}
    s = MtpSettings(**kw)
    if s.gpus > 1 and not dist.under_torchrun():
        from ..mtp import _open

        _open(args.model)  # a model without a draft: one line here, not one per rank
        return dist.launch(args._argv, s.gpus)  # this command again, one process per GPU
    dist.init()
    try:
        rep = mtp_heal(args.model, args.data, s, args.out)
    finally:
        dist.finish()
    if rep is None:  # another rank than 0: rank 0 reports
        return 0
    m = rep["metrics"]
    print(f"{args.out}: drafts a round {m['drafts_per_round_before']:.3f} -> {m['drafts_per_round_after']:.3f} "
          f"({int(m['steps'])} steps, best at {int(m['best_step'])}, preset {rep['preset']})", file=sys.stderr)
    return 0
