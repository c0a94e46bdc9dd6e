"""Compress (S2): DTG-MA neuron masks, the fold, Gram capture, GPTQ.

Stage functions in the common shape (docs/internals.md, "Stages"):

    learn_masks(source_cmf, tdata_dir, MaskSettings, out_dir, logger) -> report
    capture_grams(source_cmf, tdata_dir, layers, GramSettings, out_dir, logger) -> report
    fold(source_cmf, masks_dir | None, grams_dir | None, FoldSettings, out_cmf, logger) -> report
    gptq(student_cmf, grams_dir, GptqSettings, out_cmf, logger) -> report
    compress(source_cmf, tdata_dir, CompressSettings, out_cmf, logger) -> report   (the chain, for the CLI)

`out_dir` is the finished stage directory to write (meta.json last). The
stages as the runner knows them (cortiq.pipeline): MASKS, GRAMS, FOLD, GPTQ.
"""

# the submodules load first: the stage functions below then own the names
# `fold` and `gptq` in this package (`cortiq.compress.fold` the module stays
# importable through sys.modules)
from . import fold as _fold_module, gptq as _gptq_module, grams as _grams_module, masks as _masks_module  # noqa: F401
from .settings import CompressSettings, FoldSettings, GptqSettings, GramSettings, MaskSettings
from .stages import (FOLD, GPTQ, GRAMS, MASKS, VERSIONS, capture_grams, compress, fold, gptq, learn_masks, read_grams,
                     read_masks)

__all__ = [
    "CompressSettings", "FoldSettings", "GptqSettings", "GramSettings", "MaskSettings", "VERSIONS",
    "capture_grams", "compress", "fold", "gptq", "learn_masks", "read_grams", "read_masks",
    "MASKS", "GRAMS", "FOLD", "GPTQ",
]
