"""Loading the CUDA extension (``csrc/``) that registers ``torch.ops.speculative_kernels_cuda``.

``load()`` imports the prebuilt ``speculative_kernels._C`` when the package was installed with the CUDA build (see
``setup.py``), and otherwise JIT-compiles the same sources with ninja (``torch.utils.cpp_extension.load``) into
torch's extension cache (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), for the visible GPUs'
architectures (or ``TORCH_CUDA_ARCH_LIST``). This happens on first use, once per process; what happened is logged once.
The sources are found in the installed package (``speculative_kernels/csrc``, copied there by ``setup.py``) or, for an
editable install, in the repository's ``csrc/``.

Nothing here touches CUDA at import time.
"""

import functools
import importlib
import importlib.util
import logging
import os
import time
from pathlib import Path

from .cuda_toolkit import CXX_FLAGS, NVCC_FLAGS, build_blocker

logger = logging.getLogger("speculative_kernels")

OP_NAMESPACE = "speculative_kernels_cuda"
PREBUILT_MODULE = "speculative_kernels._C"
JIT_NAME = "speculative_kernels_cuda_jit"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
# Installed copy first (non-editable install), then the repository checkout (editable install / source tree).
SOURCE_DIRS = (_PACKAGE_DIR / "csrc", _PACKAGE_DIR.parent / "csrc")


def source_dir() -> Path | None:
    """The directory holding the extension's sources, or None when neither location has them."""
    for directory in SOURCE_DIRS:
        if (directory / "bindings.cpp").is_file():
            return directory
    return None


def source_files(directory: Path) -> list[str]:
    """Every translation unit of the extension: ``*.cu`` then ``*.cpp`` in ``directory``."""
    return [str(p) for p in sorted(directory.glob("*.cu")) + sorted(directory.glob("*.cpp"))]


def _device_reason() -> str | None:
    """Why no CUDA device can run the ops, or None."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None


def _import_prebuilt() -> str | None:
    """Import ``speculative_kernels._C``; None on success, else why not (absent or broken)."""
    try:
        if importlib.util.find_spec(PREBUILT_MODULE) is None:
            return f"{PREBUILT_MODULE} is not installed"
        importlib.import_module(PREBUILT_MODULE)
    except ImportError as exc:
        return f"{PREBUILT_MODULE} failed to import: {exc}"
    return None


def _jit_blocker() -> str | None:
    """Why the JIT build cannot work here (``cuda_toolkit.build_blocker`` with torch's CUDA_HOME), or None."""
    import torch
    from torch.utils import cpp_extension

    return build_blocker(torch.version.cuda, cpp_extension.CUDA_HOME)


def _jit_build() -> None:
    """JIT-compile (or reuse torch's cached build of) the sources and load the library. Raises on failure."""
    from torch.utils import cpp_extension

    directory = source_dir()
    if directory is None:
        raise RuntimeError(f"the CUDA sources are missing (looked in {', '.join(str(d) for d in SOURCE_DIRS)})")
    cpp_extension.load(
        name=JIT_NAME,
        sources=source_files(directory),
        extra_include_paths=[str(directory)],
        extra_cflags=list(CXX_FLAGS),
        extra_cuda_cflags=list(NVCC_FLAGS),
        is_python_module=False,
        verbose=os.environ.get("SPECULATIVE_KERNELS_JIT_VERBOSE", "0") == "1",
    )


@functools.cache
def _load_once() -> str | None:
    """Load the ops once per process; None on success, else the reason they cannot run."""
    reason = _device_reason()
    if reason is not None:
        return reason
    prebuilt_reason = _import_prebuilt()
    if prebuilt_reason is None:
        logger.info("speculative_kernels: loaded the prebuilt CUDA extension %s", PREBUILT_MODULE)
        return None
    blocker = _jit_blocker()
    if blocker is not None:
        logger.warning("speculative_kernels: no JIT build of the CUDA extension (%s; %s)", blocker, prebuilt_reason)
        return f"{prebuilt_reason}, and it cannot be JIT-compiled: {blocker}"
    start = time.perf_counter()
    try:
        _jit_build()
    except Exception as exc:  # compiler missing, build error, ...: report it as the reason, once
        logger.warning("speculative_kernels: JIT build of the CUDA extension failed (%s; %s)", exc, prebuilt_reason)
        return f"{prebuilt_reason}, and the JIT build failed: {exc}"
    logger.info(
        "speculative_kernels: %s; JIT-compiled (or reused the cached build of) torch extension %r in %.1f s",
        prebuilt_reason,
        JIT_NAME,
        time.perf_counter() - start,
    )
    return None


def unavailable_reason() -> str | None:
    """None when the CUDA ops can run (a CUDA device is present and the extension loads), else why not.

    The first call on a CUDA machine without the prebuilt extension JIT-compiles it (a minute or so).
    """
    reason = _device_reason()
    if reason is not None:
        return reason
    return _load_once()


def load() -> None:
    """Make ``torch.ops.speculative_kernels_cuda`` available; raises RuntimeError naming why it cannot."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the speculative_kernels CUDA extension cannot run: {reason}")
