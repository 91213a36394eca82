"""Can the CUDA toolkit build the extension for this torch, and with which flags? One answer for ``setup.py`` and
the JIT build (``cuda_ext.py``).

torch's extension builder compiles with ``CUDA_HOME/bin/nvcc`` (``torch.utils.cpp_extension.CUDA_HOME``) and refuses an
nvcc whose CUDA *major* version differs from the one torch was built with (``torch.version.cuda``): in ``setup.py``
that made ``pip install`` fail outright. Checked here first, so the build is skipped with the reason instead (or, when
forced, fails with it). A minor-version difference is allowed, as torch allows it.

Standard library only: ``setup.py`` loads this file by path, before the package (or its requirements) can be imported.
"""

import os
import re
import subprocess

_RELEASE = re.compile(r"release (\d+)\.(\d+)")
# The compiler flags of both builds. No --use_fast_math: the kernels' arithmetic must match the torch reference (true
# division, accurate expf/logf, no flushed denormals). No -std: torch's builder picks the language standard its
# headers need (C++17 or C++20; the sources compile as both).
NVCC_FLAGS = ("-O3", "-lineinfo")
CXX_FLAGS = ("-O3",)


def nvcc_path(cuda_home: str | None) -> str | None:
    """The nvcc torch's builder uses, ``CUDA_HOME/bin/nvcc``, or None when there is none."""
    if not cuda_home:
        return None
    path = os.path.join(cuda_home, "bin", "nvcc")
    return path if os.path.isfile(path) else None


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) from ``nvcc --version``, or None when it cannot be run or read."""
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = _RELEASE.search(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def build_blocker(torch_cuda: str | None, cuda_home: str | None) -> str | None:
    """Why the extension cannot be built for a torch built with CUDA ``torch_cuda`` ("13.0"; None for a CPU build)
    using the toolkit at ``cuda_home``, or None when it can."""
    if torch_cuda is None:
        return "the installed torch is built without CUDA (torch.version.cuda is None)"
    nvcc = nvcc_path(cuda_home)
    if nvcc is None:
        return f"nvcc not found (torch looks for CUDA_HOME/bin/nvcc; CUDA_HOME={cuda_home})"
    release = nvcc_release(nvcc)
    if release is None:
        return f"could not read the CUDA version from '{nvcc} --version'"
    torch_major = int(torch_cuda.split(".")[0])
    if release[0] != torch_major:
        return (f"{nvcc} is CUDA {release[0]}.{release[1]} but torch was built with CUDA {torch_cuda}; torch's "
                f"extension builder refuses a different CUDA major version (point CUDA_HOME at a CUDA {torch_major}.x "
                "toolkit)")
    return None
