"""Compress (S2): DTG-MA neuron masks, the fold, Gram capture, GPTQ.

Stage functions in the common shape (docs/internals.md, "Stages"):

    learn_masks(source_cmf, tdata_dir, MaskSettings, out_dir, logger) -> report
    capture_grams(source_cmf, tdata_dir, layers, GramSettings, out_dir, logger) -> report
    fold(source_cmf, masks_dir | None, grams_dir | None, FoldSettings, out_cmf, logger) -> report
    gptq(student_cmf, grams_dir, GptqSettings, out_cmf, logger) -> report
    compress(source_cmf, tdata_dir, CompressSettings, out_cmf, logger) -> report   (the chain, for the CLI)

`out_dir` is the finished stage directory to write (meta.json last). The
stages as the runner knows them (cortiq.runner): MASKS, GRAMS, FOLD, GPTQ; their chain:
`compress_chain`.
"""

from .._lazy import exports
from .settings import CompressSettings, FoldSettings, GptqSettings, GramSettings, MaskSettings

# the stage functions load on first use, with torch: the settings above stay importable without it
# (`cortiq --help` builds every command's options from them)
_STAGES = ("capture_grams", "compress", "compress_chain", "fold", "gptq", "learn_masks", "read_grams", "read_masks",
           "MASKS", "GRAMS", "FOLD", "GPTQ")
__getattr__, _, _lazy_all = exports(__name__, {name: "stages" for name in _STAGES})
__all__ = ["CompressSettings", "FoldSettings", "GptqSettings", "GramSettings", "MaskSettings", *_lazy_all]


def __dir__():
    return sorted(set(globals()) | set(__all__))
