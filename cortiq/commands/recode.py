"""`cortiq recode IN.cmf OUT.cmf --codec NAME`: any codec to any codec, streaming."""

from __future__ import annotations

HELP = "re-encode a CMF file's tensors in another codec (streaming)"
DESCRIPTION = (
    "Write IN.cmf's tensors in --codec to OUT.cmf, one tensor at a time. Plain codecs (f32, f16, bf16) apply to "
    "every tensor; quantized codecs (q8, q4, q4_64, fp8) to matrices, while vectors (norms, biases) stay plain. "
    "Tensors already in the target codec are copied byte for byte. The provenance gains a 'recode' entry. "
    "Another cortiq process writing the same OUT.cmf is waited for (OUT.cmf.lock)."
)
ORDER = 40


def add_arguments(p):
    p.add_argument("src", metavar="IN.cmf", help="the CMF file to read")
    p.add_argument("out", metavar="OUT.cmf", help="the CMF file to write")
    p.add_argument("--codec", required=True, help="target codec: f32, f16, bf16, q8, q4, q4_64, fp8")
    p.add_argument("--no-verify", action="store_true",
                   help="skip checking each tensor's sha256 as it is read (faster; a damaged tensor is copied "
                        "and its new hash vouches for it)")
    p.add_argument("--allow-nonfinite", action="store_true", help="copy tensors that hold NaN or Inf values")


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from .. import cmf, codecs, store
    from ..measure import recode

    codecs.get(args.codec)  # an unknown codec fails before any work
    store.check_output(args.out, [args.src])
    src = cmf.open_cmf(args.src)
    before = {}
    for i in src.infos.values():
        before[i.codec] = before.get(i.codec, 0) + 1
    # one writer of OUT at a time: two would remove each other's .partial files
    with store.locked(args.out), tqdm(total=len(src.infos), desc=f"recode → {args.codec}", unit=" tensors",
                                      file=sys.stderr, leave=False, disable=None) as bar:
        path = recode(args.src, args.out, args.codec, {"source": str(args.src), "from": before},
                      verify=not args.no_verify, finite=not args.allow_nonfinite, progress=lambda _n: bar.update(1))
    print(f"wrote {path}")
    return 0
