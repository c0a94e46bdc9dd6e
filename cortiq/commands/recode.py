"""`cortiq recode IN.cmf OUT.cmf --codec NAME`: any codec to any codec, streaming;
with --data, the block codecs by GPTQ (or AWQ) from calibration windows."""

from __future__ import annotations

HELP = "re-encode a CMF file's tensors in another codec (streaming; GPTQ/AWQ from --data)"
DESCRIPTION = (
    "Write IN.cmf's tensors in --codec to OUT.cmf, one tensor at a time. Plain codecs (f32, f16, bf16) apply to "
    "every tensor; quantized codecs (q8, q4, q4_64, fp8) to matrices, while vectors (norms, biases) stay plain, "
    "and below 8 bits (q4, q4_64) the token embedding, the head and an MTP draft's eh_proj stay at q8 (in a tied "
    "model the embedding is the head, which every logit reads). "
    "Tensors already in the target codec are copied byte for byte. The provenance gains a 'recode' entry. "
    "With --data TDATA and a block codec (q4, q4_64, q8), every decoder layer's linear weights are quantized by "
    "--method (gptq: GPTQ from the Grams of their inputs over calibration windows of TDATA's train split, layer "
    "by layer on the outputs of the layers already quantized; awq: activation-aware scales folded into the op "
    "before, then GPTQ; rtn: round-to-nearest; q8 by --method-8bit, rtn unless asked); the Grams are a cached stage under --work, reused by the next "
    "run on the same model, data and settings; the provenance gains a 'quantize' entry. Without --data the "
    "blocks are round-to-nearest (--q4-grid symmetric: q4 blocks of min −8·scale, which `cortiq export --to hf` "
    "packs as exact 4-bit), and any other quantization option (which would change nothing) is refused, as is --data "
    "where nothing would read it (a codec GPTQ does not write, a method of rtn). Another cortiq process writing the same OUT.cmf is waited for (OUT.cmf.lock)."
)
ORDER = 40


def add_arguments(p):
    from ..quant import QuantSettings
    from ..settings_meta import add_arguments as add_settings
    from ._output import add_model_io

    add_model_io(p, "IN.cmf", "the CMF file to read")
    p.add_argument("--codec", required=True, help="target codec: f32, f16, bf16, q8, q4, q4_64, fp8")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking each tensor's sha256 as it is read (faster; a damaged tensor is copied "
                        "and its new hash vouches for it)")
    p.add_argument("--allow-nonfinite", action="store_true", help="copy tensors that hold NaN or Inf values")
    p.add_argument("--data", default=None, metavar="TDATA",
                   help="a tdata directory whose train windows calibrate GPTQ/AWQ (block codecs only)")
    p.add_argument("--work", default=None, help="stage outputs (default: the cortiq home's work/, shared with the flows)")
    add_settings(p, QuantSettings, title="quantization (with --data)")


def check_start(args, s, given: set[str], arch) -> None:
    """Every refusal of recode that needs no work, in one place: a q4 grid with a codec it does not
    place, a quantization option that acts only with --data (all of them but a method of rtn, which
    is what happens without data, and the q4 grid), --data where it would be ignored (a codec GPTQ
    does not write, a method of rtn), a method named for the other width's codecs, and calibration
    windows past the model's context."""
    from ..codecs import takes_grid
    from ..errors import CortiqError
    from ..quant.settings import BLOCK_CODECS, EIGHT_BIT, check_window
    from ..settings_meta import flag

    def needs(name: str, what: str):
        raise CortiqError(f"recode: {flag('', name)} acts only with {what}")

    if "q4_grid" in given and not takes_grid(args.codec):
        needs("q4_grid", f"--codec q4 or q4_64, not --codec {args.codec}")
    if args.data is None:
        for name in (f for f in s.__dataclass_fields__ if f in given and f != "q4_grid"):
            if not (name in ("method", "method_8bit") and getattr(s, name) == "rtn"):
                needs(name, "--data (calibrated quantization)")
        if args.work is not None:
            needs("work", "--data (the calibration's cached stages)")
        return
    if args.codec not in BLOCK_CODECS:
        needs("data", f"a codec GPTQ writes ({', '.join(BLOCK_CODECS)}), not --codec {args.codec}")
    method, other = ("method_8bit", "method") if args.codec in EIGHT_BIT else ("method", "method_8bit")
    if getattr(s, method) == "rtn":
        needs("data", f"{flag('', method)} gptq or awq (rtn takes no data)")
    if other in given:
        theirs = EIGHT_BIT if other == "method_8bit" else [c for c in BLOCK_CODECS if c not in EIGHT_BIT]
        needs(other, f"--codec {' or '.join(theirs)} (--codec {args.codec} takes {flag('', method)})")
    if "awq_grid" in given and getattr(s, method) != "awq":
        needs("awq_grid", f"{flag('', method)} awq")
    check_window(s, arch, args.src, "--window")


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from .. import cmf, codecs, store
    from ..measure import recode
    from ..quant import QuantSettings, requantize
    from ..runner import deliver
    from ..settings_meta import from_args, named

    codecs.get(args.codec)  # an unknown codec fails before any work
    store.check_output(args.out, [args.src, args.data], kind="cmf", force=args.force)
    s = from_args(QuantSettings, args)
    src = cmf.open_cmf(args.src)
    check_start(args, s, named(getattr(args, "_argv", None), "recode", add_arguments, s), src.arch)
    if args.data is not None:
        work = store.work_root(args.work)
        with store.locked(args.out):
            r = requantize(args.src, args.data, args.codec, s, work)
            path = deliver({"path": r["path"]}, args.out)
        m = r["quantize"]["report"]["metrics"]
        print(f"{s.method_for(args.codec)}: output error under the Grams {m['quant_over_rtn']:.3f}× round-to-nearest's",
              file=sys.stderr)
        print(f"wrote {path}")
        return 0
    before = {}
    for i in src.infos.values():
        before[i.codec] = before.get(i.codec, 0) + 1
    # one writer of OUT at a time: two would remove each other's .partial files
    with store.locked(args.out), tqdm(total=len(src.infos), desc=f"recode → {args.codec}", unit=" tensors",
                                      file=sys.stderr, leave=False, disable=None) as bar:
        path = recode(args.src, args.out, args.codec, {"source": str(args.src), "from": before},
                      verify=not args.no_verify, finite=not args.allow_nonfinite, progress=lambda _n: bar.update(1),
                      q4_grid=s.q4_grid)
    print(f"wrote {path}")
    return 0
