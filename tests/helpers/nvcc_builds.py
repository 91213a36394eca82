"""The CUDA sources' compile checks (``tests/ops/test_cuda_build.py``): each case's nvcc command, and a record of the
cases that compiled, kept in pytest's cache and keyed by everything the outcome depends on (the command, nvcc's and
the host compiler's versions, every file in ``csrc/``), so that an unchanged case is not compiled again, as ccache
does. A case with no record compiles; a failure is never recorded, so a failing case fails every time.

Needs neither torch nor pytest: ``python tests/helpers/nvcc_builds.py`` compiles every case into the record (CI runs
it while the package installs, on the core pip leaves idle; the suite then finds the records).
"""

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
# pytest's cache directory (the default cache_dir under the rootdir), subdirectory "nvcc-compiles":
# request.config.cache.mkdir(RECORD_NAME) is this path
RECORD_NAME = "nvcc-compiles"
RECORD_DIR = ROOT / ".pytest_cache" / "d" / RECORD_NAME
# Each architecture once; the two language standards torch's extension builder may pick (by torch version) are spread
# over them so that each file compiles twice, not four times. sm_80's case stops at the PTX (code=compute_80): the
# standard (front end, host compiler) and the architecture (cicc's device code) are both checked, and ptxas, a third
# of verify_kernels.cu's ~35 s, runs once, for sm_90 (the sources have no inline PTX, so ptxas checks the compiler's
# own output there; what it could refuse for one architecture, such as static shared memory past 48 KiB, has the same
# limit on both and is far below it here). The PTX-only case also builds its PTX unoptimised (-Xcicc -O0): what it
# checks (the C++17 front end, sm_80's intrinsics and NVVM's code generation for that architecture) does not depend on
# NVVM's optimisation, which was ~80% of verify_kernels.cu's 27 s there (5 s unoptimised); sm_90's case is the
# build as the extension's (optimised NVVM and ptxas).
ARCH_STD = (("80", "c++17", "compute_80"), ("90", "c++20", "sm_90"))
UNOPTIMISED_PTX = ("-Xcicc", "-O0")
NVCC = shutil.which("nvcc")
# What torch.utils.cpp_extension passes to nvcc besides the gencode flags.
TORCH_NVCC_FLAGS = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)
TIMEOUT_S = 600


def kernel_files() -> list[Path]:
    return sorted(CSRC.glob("*.cu"))


def compile_command(path: Path, arch: str, std: str, code: str, out: Path) -> list[str]:
    """nvcc compiling ``path`` for one architecture, as torch's extension builder does, into the object ``out``."""
    return [
        NVCC, f"-std={std}", "-O3", f"-gencode=arch=compute_{arch},code={code}", *TORCH_NVCC_FLAGS,
        *(UNOPTIMISED_PTX if code.startswith("compute_") else ()),
        "-Xcompiler", "-Wall", f"-I{CSRC}", "-c", str(path), "-o", str(out),
    ]


@functools.lru_cache(maxsize=None)  # (once per process: every case's key reads both compilers' versions)
def _version(program: str | None) -> str:
    if program is None:
        return "absent"
    proc = subprocess.run([program, "--version"], capture_output=True, text=True, timeout=60)
    return f"{program}\n{proc.stdout}{proc.stderr}"


def _key(command: list[str]) -> str:
    """What decides the case's outcome: the command (its object path aside), nvcc's version (the toolkit's headers
    with it), the host compiler nvcc calls (g++ on PATH) and the bytes of every file in csrc/ (each source's
    includes among them)."""
    digest = hashlib.sha256()
    for part in command[:-1]:  # (the last argument is the object's path: a temporary directory)
        digest.update(part.encode() + b"\0")
    digest.update(_version(NVCC).encode())
    digest.update(_version(shutil.which("g++")).encode())
    for path in sorted(CSRC.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(CSRC)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def compile_or_recall(path: Path, arch: str, std: str, code: str, work_dir: Path, record_dir: Path | None) -> bool:
    """Compile ``path`` for (arch, std, code) into ``work_dir`` unless ``record_dir`` records that the same case
    compiled; True when recalled. AssertionError with nvcc's output when it fails (nothing is recorded then).
    record_dir None: no record read or written (pytest run with ``-p no:cacheprovider``, as gpu.py's tests phase)."""
    command = compile_command(path, arch, std, code, work_dir / f"{path.stem}.sm{arch}.o")
    record = None if record_dir is None else record_dir / f"{_key(command)}.ok"
    if record is not None and record.is_file():
        return True
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(command)}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    if record is None:
        return False
    record_dir.mkdir(parents=True, exist_ok=True)
    partial = record.with_suffix(f".{os.getpid()}.tmp")  # (written whole, then renamed: another process reads all or none)
    partial.write_text(" ".join(command) + "\n" + proc.stdout + proc.stderr)
    partial.replace(record)
    return False


def main() -> int:
    """Compile every case into RECORD_DIR, the slowest first; the failures are reported (the suite fails on them)."""
    if NVCC is None:
        print("nvcc_builds: nvcc not found on PATH: nothing compiled")
        return 0
    cases = [(path, arch, std, code) for arch, std, code in reversed(ARCH_STD) for path in kernel_files()]
    cases.sort(key=lambda case: (case[0].name != "verify_kernels.cu", case[3].startswith("compute_")))
    failed = 0
    with tempfile.TemporaryDirectory() as work:
        for case in cases:
            try:
                compile_or_recall(*case, Path(work), RECORD_DIR)
            except (AssertionError, subprocess.TimeoutExpired) as error:
                failed += 1
                print(f"nvcc_builds: {case[0].name} for sm_{case[1]} failed (the suite's case will fail):\n{error}",
                      file=sys.stderr)
    print(f"nvcc_builds: {len(cases) - failed} of {len(cases)} cases compiled or already recorded in {RECORD_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
