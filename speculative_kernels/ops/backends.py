"""Backend selection for the verification ops: ``"cuda"`` extension, ``"triton"`` kernels, ``"torch"`` reference.

``auto`` picks, for a CUDA device, the CUDA extension, then Triton, then torch; for any other device, torch (the
Triton kernels run on CPU only under ``TRITON_INTERPRET=1``, which is for testing, so ``auto`` never picks them
there). The decision is made once per device type and the reason for a fallback is logged once. A backend asked
for by name that cannot run raises ``RuntimeError`` with the reason; it is never replaced silently.
"""

import contextlib
import functools
import importlib
import logging
import os
import sys
from types import ModuleType

import torch

logger = logging.getLogger("speculative_kernels")

BACKENDS = ("torch", "triton", "cuda")
_MODULES = {
    "torch": "speculative_kernels.ops.torch_backend",
    "triton": "speculative_kernels.ops.triton_backend",
    "cuda": "speculative_kernels.ops.cuda_backend",
}
# Op families beyond verify/sample, each with its own module per backend (same selection rules).
_FAMILIES = {
    "verify": _MODULES,
    "compaction": {
        "torch": "speculative_kernels.ops.compaction_torch",
        "triton": "speculative_kernels.ops.compaction_triton",
        "cuda": "speculative_kernels.ops.compaction_cuda",
    },
    # No CUDA C++ lookup kernel: on a CUDA device the "cuda" backend runs the Triton one.
    "lookup": {
        "torch": "speculative_kernels.ops.lookup_torch",
        "triton": "speculative_kernels.ops.lookup_triton",
        "cuda": "speculative_kernels.ops.lookup_triton",
    },
}


def _unavailable_reason(name: str, device_type: str) -> str | None:
    """None when backend ``name`` can run on ``device_type``, else why not."""
    if name == "torch":
        return None
    if name == "triton":
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        if device_type != "cuda" and not (device_type == "cpu" and interpret):
            return f"Triton kernels need a CUDA device (or TRITON_INTERPRET=1 on CPU), got {device_type}"
        missing = [api for api in ("triton_op", "wrap_triton") if not hasattr(torch.library, api)]
        if missing:  # the kernels register through them (triton_backend.py, compaction_triton.py)
            return f"torch {torch.__version__} has no torch.library.{' or '.join(missing)} (torch >= 2.6 has)"
        try:
            triton = importlib.import_module("triton")
            importlib.import_module("triton.language.extra.libdevice")
        except ImportError as exc:
            return f"triton is not importable: {exc}"
        if device_type == "cpu":
            return _interpreter_reason(triton.__version__)
        return None
    if device_type != "cuda":
        return f"the CUDA extension needs a CUDA device, got {device_type}"
    from . import cuda_ext

    return cuda_ext.unavailable_reason()


def _interpreter_reason(triton_version: str) -> str | None:
    """None when Triton's interpreter can run the kernels, else why not. Triton 3.6's interpreter reads a loop bound
    that is a runtime integer (``range(0, num_slots, ...)``) as ``int()`` of a one-element array, which NumPy 2.4
    made an error (every such kernel fails with "only 0-dimensional arrays can be converted to Python scalars");
    Triton 3.7 squeezes it first."""
    import numpy
    from packaging.version import Version

    if Version(triton_version).release[:2] <= (3, 6) and Version(numpy.__version__).release[:2] >= (2, 4):
        return (f"Triton {triton_version}'s interpreter (TRITON_INTERPRET=1) cannot run these kernels with NumPy "
                f"{numpy.__version__} (it converts one-element arrays to int, an error since NumPy 2.4): use triton "
                f">= 3.7 or numpy < 2.4")
    return None


@functools.cache
def _auto_backend(device_type: str) -> str:
    if device_type != "cuda":
        return "torch"
    for name in ("cuda", "triton"):
        reason = _unavailable_reason(name, device_type)
        if reason is None:
            return name
        logger.warning("speculative_kernels: backend %r unavailable (%s); falling back", name, reason)
    return "torch"


def resolve(backend: str, device_type: str) -> str:
    """The concrete backend name for a request (``auto`` or a name) on a device type; raises if impossible."""
    if backend == "auto":
        return _auto_backend(device_type)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    reason = _unavailable_reason(backend, device_type)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} cannot run: {reason}")
    return backend


def implementation(backend: str, device_type: str, family: str = "verify") -> ModuleType:
    """The module implementing an op family for the resolved backend: ``verify``/``sample`` (family "verify"),
    ``compact_kv`` (family "compaction") or ``prompt_lookup`` (family "lookup")."""
    return sys.modules[_import_backend(family, backend, device_type)]


@torch.compiler.assume_constant_result
def _import_backend(family: str, backend: str, device_type: str) -> str:
    """Resolve and import the backend module; return its name. Under ``torch.compile`` dynamo runs this once while
    tracing and keeps the name as a constant, so the selection and the import (which dynamo cannot trace) never
    break the graph, whether or not the op ran eagerly first."""
    name = _FAMILIES[family][resolve(backend, device_type)]
    importlib.import_module(name)
    return name


def device_guard(device: torch.device):
    """Context that makes ``device`` the current CUDA device for a kernel launch (a no-op context elsewhere).

    Triton launches on the *current* device and its current stream, whatever device the tensors live on: logits on
    cuda:1 (an HF ``device_map`` model's head) with cuda:0 current would fault. The CUDA bindings do the same with
    ``c10::cuda::CUDAGuard``."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
