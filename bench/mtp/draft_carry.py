"""A trained draft between device leases: its model.mtp.* tensors as files small enough for a
device call to bring back, and those files put back into a model with the same trunk.

    python -m bench.mtp.draft_carry save DRAFTED.cmf DIR        # DIR/draft-0.safetensors, draft-1...
    python -m bench.mtp.draft_carry load INIT.cmf DIR OUT.cmf   # INIT (mtp init's output) with the draft

Why: a device call brings back files of at most 16 MiB, and a draft at `mtp heal`'s defaults takes
about 470 s of the H200 to train (bench/DECODE.md); a later lease, on a fresh machine, rebuilds the
drafted model from the converted trunk (`convert`, `mtp init`: seconds) and these files instead of
training it again. Each tensor travels as stored (its codec's bytes, the codec in the file's
metadata), in files of at most 15 MB; `load` refuses files whose names, codecs or shapes are not
INIT's draft tensors, and writes OUT as INIT's other tensors and document with the draft in place.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.common import finish, log

PART = 15_000_000  # bytes a file holds at most (a device call brings back 16 MiB a file)
PREFIX = "model.mtp."


def save(model: str, folder: str) -> list[Path]:
    from safetensors.torch import save_file

    from cortiq.cmf import open_cmf
    from cortiq.errors import CortiqError

    f = open_cmf(model)
    names = [n for n in f.names if n.startswith(PREFIX)]
    if not names:
        raise CortiqError(f"{model}: no draft tensors ({PREFIX}*): give a model after mtp init / mtp heal")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict] = [{}]
    size = 0
    for n in names:
        t = f.stored(n).contiguous()
        b = t.numel() * t.element_size()
        if size + b > PART and parts[-1]:
            parts.append({})
            size = 0
        parts[-1][n] = t
        size += b
    paths = []
    for i, part in enumerate(parts):
        meta = {"codecs": json.dumps({n: f.info(n).codec for n in part})}
        path = out / f"draft-{i}.safetensors"
        tmp = path.with_name(path.name + ".partial")
        save_file(part, str(tmp), metadata=meta)
        tmp.replace(path)
        paths.append(path)
    log(f"bench.mtp.draft_carry: {len(names)} draft tensors of {model} in {len(paths)} files under {out}")
    return paths


def load(init: str, folder: str, out: str) -> Path:
    from safetensors import safe_open

    from cortiq.cmf import Stored, copy_specs, open_cmf, write_cmf
    from cortiq.errors import CortiqError

    f = open_cmf(init)
    files = sorted(Path(folder).glob("draft-*.safetensors"))
    if not files:
        raise CortiqError(f"{folder}: no draft-*.safetensors files (made by `python -m bench.mtp.draft_carry save`)")
    got = {}
    for p in files:
        with safe_open(str(p), "pt") as sf:
            codecs = json.loads((sf.metadata() or {}).get("codecs", "{}"))
            for n in sf.keys():
                got[n] = (codecs.get(n), sf.get_tensor(n))
    want = {n for n in f.names if n.startswith(PREFIX)}
    if set(got) != want:
        raise CortiqError(f"{folder}: its draft tensors are not {init}'s (missing {sorted(want - set(got))[:3]}, "
                          f"extra {sorted(set(got) - want)[:3]})")
    specs = copy_specs(f)
    for s in specs:
        if s.name in got:
            codec, t = got[s.name]
            st = f.stored(s.name)
            if codec != s.codec or t.dtype != st.dtype or t.shape != st.shape:
                raise CortiqError(f"{folder}: {s.name} is {codec} {tuple(t.shape)} {t.dtype}, {init} holds "
                                  f"{s.codec} {tuple(st.shape)} {st.dtype}")
            s.get = lambda t=t: Stored(t)
    path = write_cmf(out, f.doc, specs)
    log(f"bench.mtp.draft_carry: {out}: {init} with the {len(got)} draft tensors of {folder}")
    return path


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("save", help="a model's draft tensors into files of at most 15 MB")
    s.add_argument("model")
    s.add_argument("folder")
    ld = sub.add_parser("load", help="a model with the same trunk, with the saved draft in place")
    ld.add_argument("init")
    ld.add_argument("folder")
    ld.add_argument("out")
    a = ap.parse_args(argv)
    from cortiq.errors import CortiqError

    try:
        if a.verb == "save":
            save(a.model, a.folder)
        else:
            load(a.init, a.folder, a.out)
    except CortiqError as e:
        print(f"bench.mtp.draft_carry: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    finish(main(sys.argv[1:]))
