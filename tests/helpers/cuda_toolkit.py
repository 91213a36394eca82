"""A fake CUDA toolkit for the build-decision tests; the C++ standards the installed torch's headers accept."""

import re
from pathlib import Path


def fake_cuda_home(root: Path, release: str) -> str:
    """A CUDA_HOME whose bin/nvcc only answers ``--version`` with ``release``."""
    bin_dir = root / f"cuda-{release}" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return str(bin_dir.parent)


# The guard at the top of ATen/ATen.h: `#error C++NN or later compatible compiler is required to use ATen.` below it.
_ATEN_GUARD = re.compile(r"__cplusplus\s*<\s*(\d{6})L")
_STANDARDS = {"c++17": 201703, "c++20": 202002}


def torch_header_standards() -> list[str]:
    """The C++ standards, oldest first, that the installed torch's headers accept: ``ATen/ATen.h`` stops any older
    one with ``#error`` (C++17 through torch 2.13, C++20 from 2.14 on, whose builder passes ``-std=c++20``). Read
    from that guard rather than from the torch version. Without a guard there, both (a refusal then fails loudly)."""
    from torch.utils.cpp_extension import include_paths

    header = next((Path(p) / "ATen" / "ATen.h" for p in include_paths() if (Path(p) / "ATen" / "ATen.h").is_file()),
                  None)
    minimum = 0
    if header is not None:
        minimum = max((int(value) for value in _ATEN_GUARD.findall(header.read_text())), default=0)
    return [std for std, value in _STANDARDS.items() if value >= minimum]
