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
    from ..mtp.settings import MtpSettings
    from ..settings_meta import add_arguments as add_settings
    from ._output import add_force

    p.add_argument("model", metavar="MODEL.cmf", help="a model with an MTP draft (cortiq mtp init gives one)")
    p.add_argument("--data", required=True, metavar="SPEC", help="PATH.tdata[@TOKENS], comma-separated")
    p.add_argument("--out", required=True, metavar="OUT.cmf", help="the model with its trained draft")
    add_force(p)
    p.add_argument("--work", default=None, help="stage outputs (default: the cortiq home's work/, shared with the flows)")
    add_settings(p, MtpSettings, title="mtp heal settings (those shown as the preset's take the preset's value "
                                       "when unset)")


def add_arguments(p):
    from ..settings_meta import HelpFormatter
    from ._output import add_force

    sub = p.add_subparsers(dest="mtp_command", metavar="SUBCOMMAND", required=True)
    fmt = HelpFormatter
    h = sub.add_parser("heal", help="retrain the draft on the model's own trunk", formatter_class=fmt,
                       description="Retrain the model's MTP draft on its own trunk: the trunk runs once over the "
                                   "data, the draft learns the trunk's next-position distribution, and the "
                                   "checkpoint keeping the most drafts a round on held-out windows is written.")
    _heal_args(h)
    i = sub.add_parser("init", help="give a model without a draft a fresh MTP block (mtp heal then picks its fresh preset)",
                       formatter_class=fmt)
    i.add_argument("model", metavar="MODEL.cmf", help="a model without an MTP draft")
    i.add_argument("--out", required=True, metavar="OUT.cmf", help="the model with a fresh draft")
    add_force(i)


def run(args) -> int:
    import sys

    from ..mtp import MtpSettings, mtp_init
    from ..settings_meta import from_args
    from ..store import check_output, parse_data_spec, work_root

    data = [] if args.mtp_command == "init" else [path for path, _ in parse_data_spec(args.data)]
    inputs = [args.model, *data]
    check_output(args.out, inputs, kind="cmf", force=args.force)
    if args.mtp_command == "heal":
        from ..mtp.settings import parse_also

        for _, also in parse_also(getattr(args, "also", None) or []):  # the result in other codecs: outputs too
            check_output(also, inputs, kind="cmf", force=args.force)
    if args.mtp_command == "init":
        rep = mtp_init(args.model, args.out)
        print(f"{rep['out']}: fresh MTP block from layer {rep['layer']}", file=sys.stderr)
        return 0
    from .. import dist

    from ..mtp.heal import _open

    s = from_args(MtpSettings, args)
    work = work_root(args.work)
    _open(args.model)  # a model without a draft is pointed at `mtp init` (one line here, not one per rank)
    if s.gpus > 1 and not dist.under_torchrun():
        return dist.launch(args._argv, s.gpus)  # this command again, one process per GPU
    from ..runner import LocalRunner, deliver
    from ..mtp.stages import mtp_chain

    dist.init()
    try:
        # the chain the flows run, through the same cache: a second run with the same model, data and
        # settings reuses the trunk pass and the trained draft
        runner = LocalRunner(work, say=lambda m: print(m, file=sys.stderr))
        made = mtp_chain(runner, args.model, args.data, s, say=lambda m: print(m, file=sys.stderr))
        if not dist.is_main():  # another rank than 0: rank 0 reports
            return 0
        deliver({"path": made}, args.out)
    finally:
        dist.finish()
    r = runner.results["mtp"]
    if r["reused"] and (s.dump or s.taps):
        print(f"{args.out}: the draft was reused from {r['path']}; --dump and --taps are written when it is "
              "trained (give other settings or another --work)", file=sys.stderr)
    rep = r["report"]
    m = rep["metrics"]
    print(f"{args.out}: drafts a round {m['drafts_per_round_before']:.3f} -> {m['drafts_per_round_after']:.3f} "
          f"({int(m['steps'])} steps, best at {int(m['best_step'])}, preset {rep['preset']})", file=sys.stderr)
    from ..cmf import open_cmf
    from ..mtp.vocab import AUTO_ABOVE, AUTO_ROWS

    f = open_cmf(args.out)
    narrow = f"{AUTO_ROWS} by default" if f.arch.vocab_size > AUTO_ABOVE else "every token by default"
    print(f"{args.out}: its tokens ranked for the draft (`serve --speculative --draft-vocab N`: the first N; "
          f"{narrow})", file=sys.stderr)
    return 0
