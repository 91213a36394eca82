"""Checking that an allocation fits before making it, on every device: a clear ``MemoryError`` naming what needs
the memory, instead of a failure deep in the allocator (or, on the CPU, swapping and the OOM killer)."""

import os

import torch

GIB = 2.0**30
MIB = 2.0**20
# torch's CPU allocator reports a failed allocation as a RuntimeError with this message (CUDA's: OutOfMemoryError)
_CPU_ALLOCATION_FAILED = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that did not fit: our own free-memory check's MemoryError, CUDA's
    OutOfMemoryError, or the RuntimeError torch's CPU allocator raises."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(error, RuntimeError) and _CPU_ALLOCATION_FAILED in str(error))


def describes_out_of_memory(text: str) -> bool:
    """``is_out_of_memory`` on an error given as ``"ExceptionType: message"`` (``RequestResult.error``)."""
    return text.split(":")[0] in ("MemoryError", "OutOfMemoryError") or (
        text.startswith("RuntimeError:") and _CPU_ALLOCATION_FAILED in text)


def _size(count: float) -> str:
    if count >= GIB:
        return f"{count / GIB:.2f} GiB"
    return f"{count / MIB:.1f} MiB" if count >= MIB else f"{count / 1024:.1f} KiB"


def free_bytes(device: torch.device) -> int | None:
    """Bytes an allocation on ``device`` can still get: CUDA's free memory plus what torch's caching allocator holds
    unused; on the CPU the system's available memory (``MemAvailable``); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def check_free_memory(required: dict, device: torch.device, what: str,
                      remedy: str = "lower the batch size or max_new_tokens") -> None:
    """Raise MemoryError before allocating when ``required['total']`` bytes exceed what ``device`` has free.

    required: {part: bytes, ..., "total": bytes}; what: the allocation, in words (for the message); remedy: what
    the caller can change."""
    free = free_bytes(device)
    if free is None or required["total"] <= free:
        return
    parts = ", ".join(f"{k} {_size(v)}" for k, v in required.items() if k != "total")
    raise MemoryError(f"{what} needs {_size(required['total'])} ({parts}) but only {_size(free)} are free on {device}; "
                      f"{remedy}")
