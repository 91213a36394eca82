"""A fake CUDA toolkit for the build-decision tests."""

from pathlib import Path


def fake_cuda_home(root: Path, release: str) -> str:
    """A CUDA_HOME whose bin/nvcc only answers ``--version`` with ``release``."""
    bin_dir = root / f"cuda-{release}" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return str(bin_dir.parent)
