"""`cortiq verify FILE.cmf`: every tensor's sha256 against the header."""

from __future__ import annotations

HELP = "check every tensor of a CMF file against its recorded sha256, and that it holds no NaN or Inf"
ORDER = 30


def add_arguments(p):
    p.add_argument("file", metavar="FILE.cmf", help="the CMF file (the first file of a sharded model)")


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from ..cmf import open_cmf
    from ..model import verify_file

    f = open_cmf(args.file)
    with tqdm(total=len(f.infos), desc="verify", unit=" tensors", file=sys.stderr, leave=False, disable=None) as bar:
        verify_file(f, progress=lambda k, n: bar.update(1))
    print(f"{args.file}: ok, {len(f.infos)} tensors, {f.nbytes()} bytes in {len(f.paths)} file(s)")
    return 0
