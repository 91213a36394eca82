"""pytest-benchmark suite for the verification op (a few configs of ``bench_verify.py``).

    python -m pytest benchmarks/test_bench_verify.py --benchmark-group-by=param:config

GPU configs need a CUDA device (they skip without one); the tiny CPU case of the torch reference always runs, so the
suite itself stays exercised. Each timed call ends with a device synchronisation, so the numbers are wall-clock
latencies of one call (launch overhead included).
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the package, when it is not installed
from bench_verify import load_backend, make_inputs  # noqa: E402

from speculative_kernels.ops.randomness import Randomness  # noqa: E402
from speculative_kernels.ops.sampling import Sampling  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
GPU_CONFIGS = {
    "B1-K4-V128256-sampling": (1, 4, 128256, "sampling"),
    "B1-K4-V128256-greedy": (1, 4, 128256, "greedy"),
    "B16-K4-V151936-sampling": (16, 4, 151936, "sampling"),
    "B64-K8-V32000-sampling": (64, 8, 32000, "sampling"),
}


def _run_benchmark(benchmark, backend, device, batch, k, vocab, mode):
    fn, reason = load_backend(backend, device)
    if fn is None:
        pytest.skip(f"backend {backend!r} unavailable: {reason}")
    target, draft, tokens, seeds, offsets = make_inputs(batch, k, vocab, mode, torch.bfloat16, device, seed=0)
    sampling = Sampling(1.0 if mode == "sampling" else 0.0, 0, 1.0)
    randomness = Randomness(seeds, offsets, True)

    def call():
        out = fn(target, draft, tokens, sampling, randomness)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    call()  # compile / JIT outside the timed region
    tokens_out, num_accepted = benchmark(call)
    assert tokens_out.shape == (batch, k + 1) and num_accepted.shape == (batch,)
    assert bool(((num_accepted >= 0) & (num_accepted <= k)).all())


@pytest.mark.skipif(not HAS_CUDA, reason="GPU benchmarks need a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton", "torch", "torch-compile"])
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
def test_verify_gpu(benchmark, backend, config):
    benchmark.group = config
    _run_benchmark(benchmark, backend, "cuda", *GPU_CONFIGS[config])


@pytest.mark.parametrize("mode", ["greedy", "sampling"])
def test_verify_cpu_reference_tiny(benchmark, mode):
    benchmark.group = f"cpu-B2-K2-V1000-{mode}"
    _run_benchmark(benchmark, "torch", "cpu", 2, 2, 1000, mode)
