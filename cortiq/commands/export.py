"""`cortiq export MODEL.cmf --to hf DIR | --to gguf FILE`: the model out to transformers / vLLM / llama.cpp."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..settings_meta import add_arguments as add_arguments_of
from ..settings_meta import check, setting

HELP = "export a CMF model as a Hugging Face directory (transformers, vLLM, SGLang) or a GGUF file (llama.cpp)"
DESCRIPTION = (
    "Export a CMF model. --to hf DIR writes config.json (the family's own model_type: llama, qwen2, qwen3, "
    "qwen3_next, qwen3_5_text), generation_config.json, tokenizer.json and tokenizer_config.json (special tokens, "
    "chat template) and model.safetensors (numbered shards and model.safetensors.index.json over --shard-mb), "
    "the decoder layers' q8 / q4 / q4_64 matrices as compressed-tensors pack-quantized weights with a "
    "quantization_config (transformers and vLLM load them quantized; q8 exactly, q4 exactly where its blocks are "
    "symmetric, as `cortiq recode --q4-grid symmetric` writes them, else dequantized unless --quantized all "
    "re-derives them: docs/export.md), other quantized tensors dequantized to --dtype (all of them with --no-quantized); the MTP draft goes under mtp.* (the Qwen3-Next / Qwen3.5 names "
    "vLLM reads; transformers skips it), for Llama / Qwen2 / Qwen3 (no MTP in transformers or vLLM) into "
    "mtp/model.safetensors beside the checkpoint, which `cortiq convert` reads back. MLP widths that differ per layer (a global fold) are padded to the "
    "widest layer with zero neurons, which add exactly 0: none of these families has a per-layer width field in "
    "transformers; config.json records the true widths (cortiq_intermediate_sizes) and `cortiq convert` trims "
    "the padding back; transformers and vLLM run the padding, so only uniform widths (`cortiq compress`'s "
    "default, `--fold-scope per_layer`) are smaller there. "
    "--to gguf FILE writes llama.cpp's names and metadata (Llama, Qwen2, Qwen3 only), Llama's q/k rows in "
    "llama.cpp's order and the tokenizer as tokenizer.ggml.*; q8 tensors become Q8_0 and q4 tensors Q4_1 "
    "without re-quantization (the same scales, mins and codes), f16 / bf16 stay F16 / BF16, other codecs are "
    "written as F32 (their values exactly); per-layer widths go in as llama.cpp's per-layer feed_forward_length "
    "(no padding); the MTP draft has no place in llama.cpp and is left out. "
    "Writes go to DIR.partial / FILE.partial and are renamed when complete; an existing non-empty DIR or an "
    "existing FILE is refused unless --force (which replaces it only once the new one is complete)."
)
ORDER = 12


@dataclass
class ExportSettings:
    """How the exported weights are written."""

    #: transformers and vLLM load any of the three; quantized tensors become this dtype
    dtype: str = setting("f32", "hf: dtype of the safetensors weights (quantized tensors are dequantized to it)",
                         choices=("f32", "f16", "bf16"))
    #: transformers' own save_pretrained cuts at 5 GB by default
    shard_mb: float = setting(5000.0, "hf: safetensors files are cut into numbered shards of at most this size (MB)",
                              gt=0)
    #: compressed-tensors' zero points are whole steps and cortiq's q4 min is not: a q4 block travels
    #: exactly only when it is symmetric (QuantSettings.q4_grid "symmetric" writes every block so); "all"
    #: re-derives the others (cortiq.convert.ct), which costs (docs/export.md, "Quantized Hugging Face exports")
    quantized: str = setting("exact", "hf: which q8 / q4 matrices go as compressed-tensors pack-quantized weights that "
                                      "transformers and vLLM load quantized: exact (q8, and q4 whose blocks are "
                                      "symmetric: cortiq's values exactly; other q4 dequantized to --dtype), all (q4 "
                                      "re-derived as symmetric int4 too: smaller, not cortiq's values), none",
                             choices=("exact", "all", "none"))
    #: llama.cpp picks its pre-tokenizer by this name; a wrong one splits text differently from training
    pre: str | None = setting(None, "gguf: llama.cpp's pre-tokenizer name", choices=("gpt-2", "smollm", "llama-bpe", "qwen2"),
                              show="recognised from the tokenizer")

    def __post_init__(self):
        check(self, "export settings")


def add_arguments(p):
    from ._output import add_force

    p.add_argument("model", metavar="MODEL.cmf", help="the CMF model to export")
    p.add_argument("--to", required=True, nargs=2, metavar=("FORMAT", "OUT"),
                   help="hf DIR (a Hugging Face model directory) or gguf FILE (a llama.cpp model file)")
    add_force(p)
    add_arguments_of(p, ExportSettings, title="export settings")


def run(args) -> int:
    import sys

    from tqdm import tqdm

    from ..cmf import open_cmf
    from ..errors import CortiqError
    from ..settings_meta import from_args
    from ..store import check_output

    s = from_args(ExportSettings, args)
    fmt, out = args.to[0], Path(args.to[1])
    if fmt not in ("hf", "gguf"):
        raise CortiqError(f"--to {fmt}: the format is hf or gguf")
    check_output(out, [args.model], folder=fmt == "hf", kind="new", force=args.force)
    f = open_cmf(args.model)
    with tqdm(desc=f"export {Path(args.model).name}", total=len(f.names), unit=" tensors", file=sys.stderr,
              leave=False, disable=None) as bar:
        def progress(_name):
            bar.update(1)

        if fmt == "hf":
            from ..export.hf import export_hf

            path = export_hf(f, out, dtype=s.dtype, shard_bytes=int(s.shard_mb * 1e6), progress=progress,
                             force=args.force, quantized=s.quantized, say=lambda m: print(m, file=sys.stderr))
            left = []
        else:
            from ..export.gguf import export_gguf

            path, left = export_gguf(f, out, pre=s.pre, progress=progress)
    if left:
        print(f"left out (no place in llama.cpp's {f.arch.arch_name}): {len(left)} tensors of the MTP draft",
              file=sys.stderr)
    print(f"wrote {path}")
    return 0

