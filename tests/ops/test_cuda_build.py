"""Compile checks of the CUDA extension's sources (no GPU needed; skipped only where nvcc / a C++ compiler is absent).

Every ``csrc/*.cu`` is compiled with plain nvcc (no torch headers) for sm_90 (C++20: the whole build, ptxas included)
and compute_80 (C++17: PTX only, ptxas skipped), one case per file and architecture so each stays short; the flags
are those torch's extension builder adds (no implicit half/bf16 conversions), so the check is at least as strict as
the real build. A case that compiled is recorded in pytest's cache (helpers/nvcc_builds.py) and not compiled again
while nothing it depends on changes. ``bindings.cpp`` is syntax-checked against the
installed torch's headers.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from helpers import nvcc_builds
from helpers.cuda_toolkit import fake_cuda_home, torch_header_standards

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
# (the cases and their commands: helpers/nvcc_builds.py)
ARCH_STD, NVCC, TIMEOUT_S = nvcc_builds.ARCH_STD, nvcc_builds.NVCC, nvcc_builds.TIMEOUT_S
KERNEL_FILES = nvcc_builds.kernel_files()
CXX = shutil.which("g++") or shutil.which("c++")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found on PATH: the CUDA sources cannot be compiled here")


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def _cuda_include_dir() -> str:
    """The CUDA toolkit include directory that nvcc itself uses (parsed from ``nvcc --dryrun``)."""
    proc = subprocess.run(
        [NVCC, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True, text=True, timeout=60
    )
    for line in (proc.stdout + proc.stderr).splitlines():
        match = re.search(r'INCLUDES="-I([^"\s]+)', line)
        if match and (Path(match.group(1)) / "cuda_runtime_api.h").is_file():
            return match.group(1)
    raise AssertionError(f"could not find the CUDA include directory in nvcc --dryrun output:\n{proc.stderr}")


def test_sources_present():
    names = {p.name for p in CSRC.iterdir()}
    assert {"verify_kernels.cu", "verify_kernels.cuh", "bindings.cpp"} <= names, names


@pytest.mark.parametrize("path", KERNEL_FILES + sorted(CSRC.glob("*.cuh")), ids=lambda p: p.name)
def test_kernel_sources_are_framework_free(path):
    """The kernel tier includes no torch / ATen / c10 / pybind headers (FlashInfer-style three tiers)."""
    includes = re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', path.read_text(), flags=re.M)
    framework = [h for h in includes if re.match(r"(torch|ATen|c10|pybind11|Python)", h)]
    assert not framework, f"{path.name} includes framework headers: {framework}"


def test_no_fast_math_in_builds():
    """--use_fast_math would replace the true division and expf/logf the reference's arithmetic needs. Both builds
    take their flags from ``cuda_toolkit`` (written once)."""
    from speculative_kernels.ops import cuda_ext, cuda_toolkit

    assert "--use_fast_math" not in cuda_toolkit.NVCC_FLAGS
    assert cuda_ext.NVCC_FLAGS is cuda_toolkit.NVCC_FLAGS and cuda_ext.CXX_FLAGS is cuda_toolkit.CXX_FLAGS
    setup_text = (ROOT / "setup.py").read_text()
    setup_calls = [node for node in ast.walk(ast.parse(setup_text)) if isinstance(node, ast.Constant)]
    assert not any(node.value == "--use_fast_math" for node in setup_calls), "setup.py passes --use_fast_math"
    assert "toolkit.NVCC_FLAGS" in setup_text and "toolkit.CXX_FLAGS" in setup_text
    assert not any(node.value in ("-O3", "-lineinfo") for node in setup_calls), "setup.py writes its own flags"


@needs_nvcc
@pytest.mark.parametrize("arch,std,code", ARCH_STD)
@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_kernel_compiles(path, arch, std, code, tmp_path, request):
    """nvcc compiles the source for the architecture (helpers/nvcc_builds.py's command), or a record in pytest's
    cache says that the same command compiled the same csrc/ with the same nvcc and host compiler (CI's install
    step compiles the cases on a core pip leaves idle, ``python tests/helpers/nvcc_builds.py``)."""
    cache = getattr(request.config, "cache", None)  # (None under -p no:cacheprovider: gpu.py's tests phase)
    nvcc_builds.compile_or_recall(path, arch, std, code, tmp_path,
                                  None if cache is None else cache.mkdir(nvcc_builds.RECORD_NAME))


@needs_nvcc
@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++/c++) on PATH")
@pytest.mark.parametrize("std", ["c++17", "c++20"])  # torch's extension builder picks one or the other by version
def test_bindings_syntax(std, tmp_path):
    """Every csrc/*.cpp (bindings.cpp, rollback_bindings.cpp, topk_bindings.cpp) against this torch's headers, as one
    translation unit that includes them all: torch's headers are parsed once per standard (~15 s of a core each time),
    and each file is checked in both standards. A CPU-only torch ships the c10/cuda headers but not the generated
    c10/cuda/impl/cuda_cmake_macros.h; torch's own escape hatch C10_CUDA_NO_CMAKE_CONFIGURE_FILE skips it. A standard
    the headers refuse (C++17 from torch 2.14 on) is skipped: no build of this torch can use it."""
    from torch.utils.cpp_extension import include_paths

    if std not in torch_header_standards():
        pytest.skip(f"torch {torch.__version__}'s headers refuse {std} (ATen/ATen.h), and its builder does not use it")

    sources = sorted(CSRC.glob("*.cpp"))
    assert {"bindings.cpp", "rollback_bindings.cpp", "topk_bindings.cpp"} <= {p.name for p in sources}
    unit = tmp_path / "all_bindings.cpp"
    unit.write_text("".join(f'#include "{p}"\n' for p in sources))
    includes = [*include_paths(), sysconfig.get_paths()["include"], _cuda_include_dir()]
    flags = [f"-std={std}", "-fsyntax-only", "-Wall", "-Wextra", f"-I{CSRC}"]
    flags += [f"-isystem{p}" for p in includes]
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").is_file() for p in include_paths()):
        flags.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    _run([CXX, *flags, str(unit)])


PHILOX_HOST_SHIM = r"""
// Host build of csrc/philox.cuh: the CUDA intrinsics it uses, as exactly rounded host operations.
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#define __device__
#define __forceinline__ inline
static inline uint32_t __umulhi(uint32_t a, uint32_t b) { return static_cast<uint32_t>((uint64_t(a) * b) >> 32); }
static inline float __uint2float_rn(uint32_t x) { return static_cast<float>(x); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
#include "philox.cuh"
using namespace speculative_kernels;
int main() {
  uint64_t seed;
  uint32_t c0, c1, c2, c3;
  while (std::scanf("%" SCNu64 " %" SCNu32 " %" SCNu32 " %" SCNu32 " %" SCNu32, &seed, &c0, &c1, &c2, &c3) == 5) {
    const uint32_t x = philox_first_word(seed, c0, c1, c2, c3);
    const PhiloxWords w = philox_words(seed, c0, c1, c2, c3);
    std::printf("%" PRIu32 " %.9g %.9g %" PRIu32 " %" PRIu32 " %" PRIu32 " %" PRIu32 "\n", x, uniform_from_bits(x),
                exponential_from_bits(x), w.w[0], w.w[1], w.w[2], w.w[3]);
  }
  return 0;
}
"""


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++/c++) on PATH")
def test_philox_header_matches_reference_on_host(tmp_path):
    """csrc/philox.cuh, built for the host, against ops/philox.py: words (the first, and all four of philox_words)
    and uniforms bit for bit, the exponential bit for bit on the series branch (u < 2^-8) and to 1 ulp elsewhere (host
    logf vs CUDA's)."""
    from speculative_kernels.ops import philox

    source = tmp_path / "philox_host.cpp"
    source.write_text(PHILOX_HOST_SHIM)
    binary = tmp_path / "philox_host"
    _run([CXX, "-std=c++17", "-O1", "-ffp-contract=off", f"-I{CSRC}", str(source), "-o", str(binary)])
    g = torch.Generator().manual_seed(0)
    n = 4000
    seed = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    counters = [torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64) for _ in range(4)]
    counters[0][:64] = torch.arange(64)  # small element ids, row 0, stream constants as the kernels use them
    counters[1][:64] = 0
    counters[3][:64] = torch.tensor([philox.STREAM_ACCEPT, philox.STREAM_POSITION, philox.STREAM_DRAFT, 7] * 16)
    # row 64: a word >= 2**32 - 128, where u rounds to 1 and is capped at 1 - 2**-24 (a finite exponential)
    seed[64] = 34143421
    for counter, value in zip(counters, (7, 0, 0, philox.STREAM_DRAFT)):
        counter[64] = value
    lines = [f"{int(s) & (2**64 - 1)} {' '.join(str(int(c[i])) for c in counters)}" for i, s in enumerate(seed)]
    proc = subprocess.run([str(binary)], input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert len(rows) == n
    words = torch.tensor([int(r[0]) for r in rows], dtype=torch.int64)
    host_uniform = torch.tensor([float(r[1]) for r in rows], dtype=torch.float32)
    host_exp = torch.tensor([float(r[2]) for r in rows], dtype=torch.float32)
    want = philox.philox_first_word(seed, *counters)
    assert torch.equal(words, want)
    all_words = torch.tensor([[int(w) for w in r[3:7]] for r in rows], dtype=torch.int64)
    assert torch.equal(all_words, philox.philox_words(seed, *counters))  # the races' four words of a call
    assert torch.equal(host_uniform, philox.uniform_from_bits(want))
    want_exp = philox.exponential_from_bits(want)
    series = want.to(torch.float32) * philox.U32_SCALE < philox.EXP_SERIES_CUTOFF
    assert torch.equal(host_exp[series], want_exp[series])
    ulp = torch.finfo(torch.float32).eps * want_exp.abs().clamp(min=torch.finfo(torch.float32).tiny)
    assert ((host_exp - want_exp).abs() <= ulp).all()


def _op_schemas() -> dict[str, str]:
    """name -> schema string of every m.def(...) in bindings.cpp (adjacent string literals joined)."""
    text = (CSRC / "bindings.cpp").read_text()
    schemas = {}
    for call in re.findall(r"m\.def\(\s*((?:\"[^\"]*\"\s*)+)\)", text):
        schema = "".join(re.findall(r"\"([^\"]*)\"", call))
        schemas[schema.split("(", 1)[0]] = schema
    return schemas


def test_op_schemas_parse_and_match_fakes():
    """The schemas in bindings.cpp are valid and the fake implementations in cuda_backend.py take the same arguments."""
    schemas = _op_schemas()
    assert set(schemas) == {"verify", "sample"}, schemas
    tree = ast.parse((ROOT / "speculative_kernels/ops/cuda_backend.py").read_text())
    fakes = {node.name: [a.arg for a in node.args.args] for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    for name, schema in schemas.items():
        parsed = torch._C.parse_schema(f"speculative_kernels_cuda::{schema}")
        assert [a.name for a in parsed.arguments] == fakes[f"_{name}_fake"], name


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


# ---- whether to build at all: nvcc's CUDA major version must be torch's ---------------------------------------------
@pytest.mark.parametrize("torch_cuda,release,blocked", [("12.8", "13.0", True), ("13.0", "12.9", True),
                                                        ("13.0", "13.0", False), ("13.2", "13.0", False)])
def test_toolkit_major_version_must_match_torch(tmp_path, torch_cuda, release, blocked):
    from speculative_kernels.ops.cuda_toolkit import build_blocker

    reason = build_blocker(torch_cuda, fake_cuda_home(tmp_path, release))
    if blocked:
        assert f"CUDA {release}" in reason and torch_cuda in reason, reason
    else:
        assert reason is None


def test_toolkit_missing_or_cpu_torch(tmp_path):
    from speculative_kernels.ops.cuda_toolkit import build_blocker

    assert "without CUDA" in build_blocker(None, fake_cuda_home(tmp_path, "13.0"))
    assert "nvcc not found" in build_blocker("13.0", str(tmp_path / "nowhere"))
    assert "nvcc not found" in build_blocker("13.0", None)


@pytest.fixture
def setup_py(monkeypatch):
    """setup.py's namespace, executed with setuptools.setup stubbed out (nothing is built or installed)."""
    import runpy

    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)
    monkeypatch.delenv("SPECULATIVE_KERNELS_BUILD_CUDA", raising=False)
    return runpy.run_path(str(ROOT / "setup.py"))


@pytest.mark.parametrize("release,switch,want", [("13.0", "", False), ("13.0", "0", False), ("13.0", "1", "raise"),
                                                 ("12.4", "", True), ("12.4", "0", False)])
def test_setup_skips_a_mismatched_toolkit_with_the_reason(setup_py, monkeypatch, tmp_path, capsys, release, switch,
                                                          want):
    """torch built with CUDA 12.8: nvcc 13.0 is skipped with the reason (pip install must not fail), or refused when
    SPECULATIVE_KERNELS_BUILD_CUDA=1 forces the build; nvcc 12.4 builds (torch allows another minor version)."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", fake_cuda_home(tmp_path, release))
    monkeypatch.setenv("SPECULATIVE_KERNELS_BUILD_CUDA", switch)
    if want == "raise":
        with pytest.raises(RuntimeError, match=r"BUILD_CUDA=1 .*CUDA 13\.0 but torch was built with CUDA 12\.8"):
            setup_py["_want_cuda_build"]()
        return
    assert setup_py["_want_cuda_build"]() is want
    if switch == "" and not want:
        assert "not building the CUDA extension" in capsys.readouterr().err
