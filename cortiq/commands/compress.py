"""`cortiq compress`: DTG-MA masks, the fold, optional repair and GPTQ."""

from __future__ import annotations

HELP = "prune MLP neurons (DTG-MA masks + fold), optionally repair down_proj and quantize with GPTQ"
DESCRIPTION = (
    "Learn a gate on every MLP neuron under a rising L1 pull (DTG-MA) on the data's train split, keep the "
    "top --keep-frac share of the neurons and slice the MLPs (--fold-repair refits down_proj by least squares "
    "from the Grams of the MLP activations); --use-gptq quantizes the student into --gptq-codec from the same "
    "Grams. Every option is a setting of the parameter files' compress group (--masks-lr is compress.masks.lr). "
    "Intermediate stages are cached under the cortiq home by content digest. The last line says which runtimes "
    "run the student smaller: all of them for uniform widths, CMF and GGUF (llama.cpp) only where widths "
    "differ per layer (the Hugging Face export pads them to the widest)."
)
ORDER = 30


def add_arguments(p):
    from ..compress.settings import CompressSettings
    from ..settings_meta import add_arguments as add_settings
    from ._output import add_stage_io
    from .heal import add_retain

    p.add_argument("source", help="the source model (.cmf)")
    add_stage_io(p, "the student model to write (.cmf)",
                 "stage outputs (default: the cortiq home's work/, shared with the flows)")
    add_settings(p, CompressSettings, title="compress settings")
    add_retain(p)


def run(args) -> int:
    import json
    import sys

    from ..compress import compress
    from ..compress.settings import CompressSettings
    from ..settings_meta import from_args

    from .heal import check_io

    retain = check_io(args, [args.source, args.data])
    s = from_args(CompressSettings, args)
    rep = compress(args.source, args.data, s, args.out, work=args.work, retain=retain)
    print(json.dumps(rep["metrics"], indent=1, sort_keys=True), file=sys.stdout, flush=True)
    from ..cmf import open_cmf
    from ..export.hf import runtimes_line

    print(runtimes_line(open_cmf(args.out).arch.intermediate_sizes, max(open_cmf(args.source).arch.intermediate_sizes)),
          file=sys.stderr)
    return 0
