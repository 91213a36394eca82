"""Build script for speculative-kernels.

The CUDA extension in ``csrc/`` is compiled only where it can be:

* ``SPECULATIVE_KERNELS_BUILD_CUDA=1`` forces the build (fails loudly without nvcc / CUDA torch);
* ``SPECULATIVE_KERNELS_BUILD_CUDA=0`` skips it;
* unset (default): built when the installed torch is a CUDA build and the nvcc torch's builder uses
  (``CUDA_HOME/bin/nvcc``) has torch's CUDA major version; otherwise skipped, with the reason printed.

Without a prebuilt extension the package JIT-compiles the same sources with ninja on first use
(``speculative_kernels/ops/cuda_ext.py``). Install with ``--no-build-isolation`` so the build sees the torch you
installed instead of pulling another one.
"""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
CSRC = ROOT / "csrc"
CUDA_SOURCES = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.cu")) + sorted(
    str(p.relative_to(ROOT)) for p in CSRC.glob("*.cpp")
)
# Everything the JIT build needs: the translation units and their headers.
CSRC_FILES = sorted(p for pattern in ("*.cu", "*.cuh", "*.cpp", "*.h") for p in CSRC.glob(pattern))


def _cuda_toolkit():
    """``speculative_kernels/ops/cuda_toolkit.py`` (standard library only), loaded by path: the package cannot be
    imported before it is installed. The JIT build (``ops/cuda_ext.py``) runs the same check with the same flags."""
    path = ROOT / "speculative_kernels" / "ops" / "cuda_toolkit.py"
    spec = importlib.util.spec_from_file_location("_speculative_kernels_cuda_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _want_cuda_build() -> bool:
    switch = os.environ.get("SPECULATIVE_KERNELS_BUILD_CUDA", "").strip()
    if switch not in ("", "0", "1"):
        raise ValueError(f"SPECULATIVE_KERNELS_BUILD_CUDA must be 0, 1 or unset, got {switch!r}")
    if switch == "0":
        return False
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        if switch == "1":
            raise RuntimeError("SPECULATIVE_KERNELS_BUILD_CUDA=1 but torch is not installed")
        return False
    reason = _cuda_toolkit().build_blocker(torch.version.cuda, CUDA_HOME) if CUDA_SOURCES else "csrc/ is missing"
    if reason is None:
        return True
    if switch == "1":
        raise RuntimeError(f"SPECULATIVE_KERNELS_BUILD_CUDA=1 but the CUDA extension cannot be built: {reason}")
    print(f"speculative-kernels: not building the CUDA extension: {reason}", file=sys.stderr)
    return False


def _extensions():
    if not _want_cuda_build():
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(min(8, os.cpu_count() or 1)))
    nvcc_threads = os.environ.get("NVCC_THREADS", "4")
    archs = [a.strip() for a in os.environ.get("SPECULATIVE_KERNELS_CUDA_ARCHS", "80;90").split(";") if a.strip()]
    if not archs:
        raise ValueError("SPECULATIVE_KERNELS_CUDA_ARCHS must name at least one architecture, e.g. '80;90'")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")  # PTX for newer GPUs
    toolkit = _cuda_toolkit()  # the flags the JIT build (ops/cuda_ext.py) uses too
    ext = CUDAExtension(
        name="speculative_kernels._C",
        sources=CUDA_SOURCES,
        include_dirs=[str(CSRC)],
        extra_compile_args={
            "cxx": list(toolkit.CXX_FLAGS),
            "nvcc": [*toolkit.NVCC_FLAGS, f"--threads={nvcc_threads}", *gencode],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


class BuildPyWithCudaSources(build_py):
    """Also copy ``csrc/`` into the built package (``speculative_kernels/csrc``), so that a non-editable install
    without the prebuilt extension can still JIT-compile it on a CUDA machine. Editable installs use the repository's
    ``csrc/`` directly."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or self.dry_run:
            return
        target = Path(self.build_lib) / "speculative_kernels" / "csrc"
        target.mkdir(parents=True, exist_ok=True)
        for source in CSRC_FILES:
            shutil.copy2(source, target / source.name)


ext_modules, cmdclass = _extensions()
cmdclass = {"build_py": BuildPyWithCudaSources, **cmdclass}

setup(
    name="speculative-kernels",
    version="0.1.0",
    description="Exact speculative decoding with fused Triton/CUDA verification kernels; drop-in for HF generate",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8") if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["speculative_kernels", "speculative_kernels.*"]),
    package_data={"speculative_kernels": ["csrc/*", "demo_models/README.md", "demo_models/*/*"]},
    include_package_data=True,
    # Minimum versions, each for a reason: torch 2.6 brought torch.library.triton_op/wrap_triton, through which the
    # Triton kernels register (the newest API the package uses; register_fake 2.4, assume_constant_result and
    # is_compiling older), and ships with triton 3.2; where either is missing, backend="auto" falls back to torch
    # with the reason logged (ops/backends.py). transformers 5.17 is the oldest CI runs the generation tests on
    # (.ci/run), and the GPU image's. Run on: torch 2.13, triton 3.9 (interpreter), transformers 5.24 and 5.17 (CI);
    # torch 2.11, triton 3.6, transformers 5.17 (the GPU image, benchmarks/RESULTS.md). Older ones are untested.
    # transformers is capped at the newest release the suite and the architecture sweep have run on: exactness rests
    # on transformers' internals (cache classes, masks, processors, the source rules of generation/capabilities.py),
    # and a release can change them without notice (5.24 renamed past_key_values to cache in every model, which
    # made every model look cache-less; a fresh install failed the whole suite). Raise the cap after running both.
    # torch is capped the same way, at the newest release the whole suite has passed on: exactness under compile=True
    # rests on dynamo's internals too (generation/dynamo_options.py sets config options by each torch's names and
    # refuses compile=True where skip_nnmodule_hook_guards is missing, whose loss would drop hooks from captured
    # steps; a renamed option is caught that way, a changed meaning is not), and torch 2.14 made its
    # headers refuse C++17. Run on CPU (TRITON_INTERPRET=1, transformers 5.24): 2026-11-27, torch 2.14.1 with its
    # triton 3.8, the whole suite (2458 passed, 768 skipped; its 2 failures were the C++17 header checks, fixed in the
    # tests), the demo (outputs identical) and triton_aot --quick; 2026-11-28, torch 2.15.0 (+cu132 wheel, triton
    # 3.9), the whole suite (2488 passed, 769 skipped, 0 failed: skips are CUDA-only or optional packages, and the
    # C++17 header check), the demo (outputs identical, the same text as under 2.13) and triton_aot --quick (all 11
    # variants compiled for sm_90). Raise the cap after the same runs under the next release.
    install_requires=[
        "torch>=2.6,<2.16",
        "triton>=3.2; platform_system=='Linux'",
        "transformers>=5.17,<5.25",
        "tokenizers>=0.20",
        "safetensors",
        "ninja",
        "packaging",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-benchmark>=4", "pytest-xdist", "scipy", "peft", "accelerate"],
        "bench": ["pytest-benchmark>=4", "matplotlib"],
    },
    entry_points={"console_scripts": ["speculative-kernels=speculative_kernels.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
