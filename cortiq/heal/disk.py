"""Whether heal's resumable checkpoints fit the disk of its work folder.

A checkpoint holds every trained weight twice in f32 (as it is and the best so
far; three times with the heal's moving average) and Adam's two moments (f32,
or 8 bits with the adam8 memory plan): 16 bytes a trained weight, about 10 with
adam8. A new one is written beside the last and then replaces it, so for a
moment the folder holds two. At the Qwen3-8B geometry with every layer trained
that is over 100 GB a copy, more than the disk of a machine that runs the rest
of the pipeline well. The rule
(docs/internals.md, "Defaults that fit"):

- room for two copies (after what the run still writes: its healed model):
  checkpoints as set;
- room for one: the last is removed before the next is written (a run stopped
  mid-write then starts its training again);
- not even one: no checkpoints, said in one line (the run is as exact; a
  stopped run starts its training again).

The free space is the file system's (`shutil.disk_usage` of the work folder),
or `disk_gb` where the settings give one (a quota, or a test).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from .memory import GiB, size

#: bytes a trained weight takes in a checkpoint besides its moments: the f32 weight and the f32 best
WEIGHT_BYTES = 8
#: bytes of Adam's two moments a trained weight: f32 each, or 8 bits each with their block scales
MOMENT_BYTES = {False: 8, True: 2}
#: what a checkpoint holds besides (the loop's state, the data order, the RNG), generously
OVERHEAD = 64 << 20
#: the margin kept free on the disk beside the checkpoints and the healed model
SLACK = 1 << 30

KEEP, REPLACE, OFF = "keep", "replace", "off"


def checkpoint_bytes(trained: int, adam8: bool, averaged: bool = False) -> int:
    """A checkpoint's size on disk, for `trained` trained weights (`averaged`: with their moving
    average, f32, HealSettings.average)."""
    return trained * (WEIGHT_BYTES + 4 * bool(averaged) + MOMENT_BYTES[bool(adam8)]) + OVERHEAD


def checkpoint_mode(need: int, free: int, reserve: int) -> str:
    """KEEP (room for two checkpoints), REPLACE (for one) or OFF, given `free` bytes of which
    `reserve` are for what the run still writes."""
    room = free - reserve - SLACK
    return KEEP if 2 * need <= room else REPLACE if need <= room else OFF


def free_bytes(work_dir, disk_gb: float) -> int:
    """The bytes heal's checkpoints may use: `disk_gb` GiB where given (> 0), else the work folder's free space."""
    return int(disk_gb * GiB) if disk_gb > 0 else shutil.disk_usage(Path(work_dir)).free


def plan_checkpoints(every: int, trained: int, adam8: bool, reserve: int, work_dir, disk_gb: float,
                     say: bool = True, averaged: bool = False) -> str:
    """The checkpoint mode of a heal that checkpoints every `every` steps (OFF when 0), with a
    line to stderr (with `say`) when the disk makes it other than KEEP."""
    if not every:
        return OFF
    need, free = checkpoint_bytes(trained, adam8, averaged), free_bytes(work_dir, disk_gb)
    mode = checkpoint_mode(need, free, reserve)
    if mode != KEEP and say:
        what = ("one checkpoint at a time (the last removed before the next is written)" if mode == REPLACE else
                "no resumable checkpoints (a stopped run starts its training again)")
        print(f"cortiq: heal: a resumable checkpoint of {trained:,} trained weights takes {size(need)} and "
              f"{size(free)} are free at {work_dir} ({size(reserve)} of them for the healed model): "
              f"{what}; --disk-gb or --checkpoint-every 0 say it yourself", file=sys.stderr)
    return mode
