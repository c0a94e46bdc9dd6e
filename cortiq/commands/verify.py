"""`cortiq verify FILE.cmf`: every tensor's sha256 against the header."""

from __future__ import annotations

HELP = "check every tensor of a CMF file against its recorded sha256, and that it holds no NaN or Inf"
ORDER = 30


def add_arguments(p):
    p.add_argument("file", metavar="FILE.cmf", help="the CMF file (the first file of a sharded model)")


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from ..cmf import CmfError, open_cmf

    f = open_cmf(args.file)
    with tqdm(total=len(f.infos), desc="verify", unit=" tensors", file=sys.stderr, leave=False, disable=None) as bar:
        nonfinite: list[str] = []
        bad = f.verify(progress=lambda k, n: bar.update(1), nonfinite=nonfinite)

    def shown(names):
        return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    if bad:
        raise CmfError(f"{args.file}: {len(bad)} of {len(f.infos)} tensors fail their sha256: {shown(bad)}")
    if nonfinite:
        raise CmfError(f"{args.file}: {len(nonfinite)} of {len(f.infos)} tensors hold NaN or Inf values: {shown(nonfinite)}")
    print(f"{args.file}: ok, {len(f.infos)} tensors, {f.nbytes()} bytes in {len(f.paths)} file(s)")
    return 0
