"""Where a stage computes: the one resolver of device names and compute dtypes
every stage (compress, heal, mtp) uses, so "auto" means the same everywhere."""

from __future__ import annotations

from .errors import CortiqError

#: compute dtypes a stage may name: "auto" is bf16 on CUDA, f32 on the CPU
COMPUTE = ("auto", "f32", "bf16", "f16")


def resolve_device(name: str, what: str = "settings"):
    """A torch.device for "auto" (CUDA when present, else the CPU), "cpu",
    "cuda", "cuda:1", ...; CortiqError (prefixed `what`) for a name torch
    does not know or CUDA asked for where there is none."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise CortiqError(f"{what}: device {name!r} is not a torch device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CortiqError(f"{what}: device {name!r} asked for but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CortiqError(f"{what}: device {name!r} asked for but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def rank_device(name: str, what: str = "settings"):
    """The device this process computes on for the settings' device `name`: `resolve_device`,
    then under torchrun each rank's own GPU (cortiq.dist.device)."""
    from . import dist

    return dist.device(resolve_device(name, what))


def resolve_compute(name: str, device):
    """The autocast dtype for `name` on `device` ("auto": bf16 on CUDA, f32 on the CPU)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[name]
    except KeyError:
        raise CortiqError(f"compute dtype {name!r} is not one of {', '.join(COMPUTE)}") from None


def free_memory(device) -> int:
    """Bytes a new allocation on `device` may still take: CUDA's free memory plus what the
    caching allocator holds unused; on the CPU, the kernel's MemAvailable (page cache it
    can drop included), or, where that is unknown, the physical memory."""
    import os

    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
