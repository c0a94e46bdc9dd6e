"""The data every stage trains and scores on (see docs/internals.md, "Data API").

tdata: tokenized records (rid, split, category, ids, first scored position) in
an Arrow file inside a stage directory; windows: a split as one stream cut
into windows of T with per-row weights; packed windows: the MTP stage's
training text. The stages that make tdata (data, selfgen, mix) and their chain
(`with_retain`) are cortiq.data.stages.

Names load on first use, so `cortiq.data.settings` (the CLI's defaults) stays
free of numpy and Arrow.
"""

from __future__ import annotations

from .._lazy import exports

_EXPORTS = {
    "BuildSettings": "settings", "DataSettings": "settings", "RetainSettings": "settings", "SelfGenSettings": "settings",
    "DATA": "stages", "MIX": "stages", "SELFGEN": "stages", "self_tdata": "stages", "with_retain": "stages",
    "generate_rows": "selfgen",
    "build": "builder", "build_digest": "builder", "cut_text": "builder",
    "LOSS_ON": "tdata", "SPLITS": "tdata", "Record": "tdata", "Tdata": "tdata", "fnv1a64": "tdata",
    "tokenizer_digest": "tdata", "write_tdata": "tdata",
    "Batch": "windowing", "Packed": "windowing", "Windows": "windowing", "cut_windows": "windowing",
    "held_out": "windowing", "packed_windows": "windowing", "windows": "windowing",
}

__getattr__, __dir__, __all__ = exports(__name__, _EXPORTS)
