"""The data every stage trains and scores on (see docs/internals.md, "Data API").

tdata: tokenized records (rid, split, category, ids, first scored position) in
an Arrow file inside a stage directory; windows: a split as one stream cut
into windows of T with per-row weights; packed windows: the MTP stage's
training text.
"""

from .build import BuildSettings, build, build_digest, cut_text
from .tdata import LOSS_ON, SPLITS, Record, Tdata, fnv1a64, tokenizer_digest
from .windows import Batch, Packed, Windows, cut_windows, held_out, packed_windows, windows

__all__ = [
    "Batch", "BuildSettings", "LOSS_ON", "Packed", "Record", "SPLITS", "Tdata", "Windows",
    "build", "build_digest", "cut_text", "cut_windows", "fnv1a64", "held_out", "packed_windows",
    "tokenizer_digest", "windows",
]
