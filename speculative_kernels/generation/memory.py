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
    unused; on the CPU the least of the system's available memory (``MemAvailable``), the room left under this
    process's cgroup memory limit (a container's: past it the OOM killer ends the process) and under its address
    space limit (``RLIMIT_AS``: past it the allocator fails); None where unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        limits = [v for v in (_mem_available(), _cgroup_room(), _address_space_room()) if v is not None]
        return min(limits) if limits else None
    return None


def _mem_available() -> int | None:
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


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # ("max": no limit)


def _cgroup_room() -> int | None:
    """memory.max - memory.current of this process's cgroup (v2; v1: limit_in_bytes - usage_in_bytes), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for hierarchy, controllers, path in entries:
        if hierarchy == "0" and controllers == "":  # v2
            base = "/sys/fs/cgroup" + path.rstrip("/")
            limit, used = _read_int(base + "/memory.max"), _read_int(base + "/memory.current")
        elif "memory" in controllers.split(","):  # v1
            base = "/sys/fs/cgroup/memory" + path.rstrip("/")
            limit, used = _read_int(base + "/memory.limit_in_bytes"), _read_int(base + "/memory.usage_in_bytes")
            limit = None if limit is not None and limit >= 2**60 else limit  # (v1's "no limit" is a huge number)
        else:
            continue
        if limit is not None and used is not None:
            return max(0, limit - used)
    return None


def _address_space_room() -> int | None:
    """RLIMIT_AS minus this process's virtual size, or None (no limit, or unknown)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as f:
            virtual = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return max(0, limit - virtual)


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
