"""The source stage: a parameter set's model converted to CMF once (a Hugging Face
directory, a GGUF file, or the bundled SmolLM2); a .cmf source needs no stage."""

from __future__ import annotations

from pathlib import Path

from ..errors import CortiqError
from ..runner import Stage


def source_kind(source: str) -> str:
    """What a model source is: "smollm2" (the bundled GGUF), "cmf", "gguf" or "hf" (a directory)."""
    p = Path(source)
    if source == "smollm2":
        return "smollm2"
    if p.suffix == ".cmf":
        return "cmf"
    if p.suffix == ".gguf":
        return "gguf"
    if p.is_dir():
        return "hf"
    raise CortiqError(f"{source}: not a model (a .cmf or .gguf file, a Hugging Face directory, or 'smollm2')")


def source_path(source: str) -> Path:
    """The file or directory a source names (the bundled GGUF's path for "smollm2")."""
    if source == "smollm2":
        from .bundled import smollm2_path

        return Path(smollm2_path())
    return Path(source)


def _located(p: dict) -> dict:
    kind = source_kind(p["source"])
    if kind == "cmf":
        raise CortiqError(f"{p['source']}: already a CMF file; nothing to convert")
    return {**p, "kind": kind, "path": source_path(p["source"])}


def _convert(out, ctx, source, kind, path) -> dict:
    if kind == "hf":
        from .hf import convert_hf_dir

        convert_hf_dir(path, out)
    else:
        from .gguf import convert_gguf

        convert_gguf(path, out)
    from ..cmf import open_cmf

    return {"metrics": {"bytes": float(open_cmf(out).nbytes())}, "source": str(path)}


# its version is that of what the converters write (bumped when a converter's output changes)
SOURCE = Stage("source", 1, _convert, None, ("path",), extra=lambda p: {"kind": p["kind"]}, output="cmf",
               normalize=_located, doc="the source model converted to CMF once")
