"""`cortiq compress`: DTG-MA masks, the fold, optional repair and GPTQ."""

from __future__ import annotations

HELP = "prune MLP neurons (DTG-MA masks + fold), optionally repair down_proj and quantize with GPTQ"
DESCRIPTION = (
    "Learn a gate on every MLP neuron under a rising L1 pull (DTG-MA) on the data's train split, keep the "
    "top --keep share of the neurons and slice the MLPs (--repair refits down_proj by least squares from "
    "the Grams of the MLP activations); --gptq quantizes the student into --codec from the same Grams. "
    "Intermediate stages are cached under the cortiq home by content digest."
)
ORDER = 30


def add_arguments(p):
    p.add_argument("source", help="the source model (.cmf)")
    p.add_argument("--data", required=True, help="a tdata directory (cortiq data build)")
    p.add_argument("--out", required=True, help="the student model to write (.cmf)")
    p.add_argument("--keep", type=float, default=0.75, help="share of MLP neurons to keep")
    g = p.add_argument_group("masks (DTG-MA)")
    g.add_argument("--no-masks", action="store_true", help="rank neurons by activation score from the Grams instead")
    g.add_argument("--steps", type=int, default=200, help="most mask training steps")
    g.add_argument("--window", type=int, default=256, help="tokens per window (masks and Grams)")
    g.add_argument("--batch", type=int, default=4, help="windows per batch")
    g.add_argument("--lr", type=float, default=0.05, help="Adam learning rate of the gate logits")
    g.add_argument("--l1-init", type=float, default=1.0, help="initial L1 pressure")
    g.add_argument("--l1-step", type=float, default=1.0, help="pressure added per evaluation below the target")
    g.add_argument("--l1-grow", type=float, default=1.5, help="pressure growth per evaluation below the target")
    g.add_argument("--eval-every", type=int, default=10, help="steps between hard-mask evaluations")
    g.add_argument("--settle", type=int, default=2, help="evaluations past the first at the target before stopping")
    g.add_argument("--loss-on", choices=("answer", "all"), default="answer", help="tokens the LM loss scores")
    g = p.add_argument_group("fold")
    g.add_argument("--scope", choices=("per_layer", "global"), default="per_layer", help="rank per layer or over all")
    g.add_argument("--floor", type=float, default=0.25, help="global scope: least share each layer keeps")
    g.add_argument("--repair", action="store_true", help="least-squares repair of down_proj from the Grams")
    g.add_argument("--damp", type=float, default=0.01, help="repair ridge: damp·mean diag G")
    g = p.add_argument_group("Grams and GPTQ")
    g.add_argument("--gram-windows", type=int, default=64, help="most train windows the Grams see (0: all)")
    g.add_argument("--gptq", action="store_true", help="quantize the student with GPTQ")
    g.add_argument("--codec", choices=("q4", "q4_64", "q8"), default="q4", help="GPTQ codec")
    g.add_argument("--act-order", action="store_true", help="GPTQ columns by decreasing Hessian diagonal")
    g.add_argument("--work", default=None, help="stage outputs (default: the cortiq home's work/, shared with the flows)")
    g = p.add_argument_group("resources")
    g.add_argument("--device", default="auto",
                   help="where masks, Grams, the repair and GPTQ compute: auto (CUDA when present), cpu, cuda, cuda:1, ...")
    g.add_argument("--compute-dtype", choices=("auto", "f32", "bf16"), default="auto",
                   help="forward passes under autocast: auto = bf16 on CUDA, f32 on the CPU "
                        "(Gram accumulators and the solves stay f64)")


def run(args) -> int:
    import json
    import sys

    from ..compress import compress
    from ..compress.settings import CompressSettings, FoldSettings, GptqSettings, GramSettings, MaskSettings

    s = CompressSettings(
        masks=MaskSettings(keep_frac=args.keep, lr=args.lr, l1_init=args.l1_init, l1_step=args.l1_step,
                           l1_grow=args.l1_grow, eval_every=args.eval_every, max_steps=args.steps, settle=args.settle,
                           window=args.window, batch=args.batch, loss_on=args.loss_on),
        fold=FoldSettings(keep_frac=args.keep, scope=args.scope, floor=min(args.floor, args.keep), repair=args.repair,
                          damp=args.damp),
        grams=GramSettings(window=args.window, batch=args.batch, max_windows=args.gram_windows),
        gptq=GptqSettings(codec=args.codec, act_order=args.act_order),
        learn_masks=not args.no_masks,
        use_gptq=args.gptq,
        device=args.device,
        compute_dtype=args.compute_dtype,
    )
    rep = compress(args.source, args.data, s, args.out, work=args.work)
    print(json.dumps(rep["metrics"], indent=1, sort_keys=True), file=sys.stdout)
    return 0
