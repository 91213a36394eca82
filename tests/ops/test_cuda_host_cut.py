"""The CUDA host's top-k cut from the raw logits (``cuda_host._top_k_cut``) keeps exactly what the float32 element cut
(``cuda_host._element_cut``, torch's topk of z = x / T, then an element of that value) keeps: the kernels keep v iff
(z_v, v) >= (z_source, index), so two cuts agree iff those sets agree. Small integer logits (ties everywhere), +-inf,
overflow to inf at a small temperature; rows with a NaN are left to the ops' check (test_cuda_emulated.py: the
kernels flag them whatever the cut), since there the two sources may differ."""

import pytest
import torch

from speculative_kernels.ops.cuda_host import _cut, _element_cut, _top_k_cut, _top_k_top_p_cut
from speculative_kernels.ops.sampling import Sampling
from speculative_kernels.ops.warping import kth_largest_index

INF = float("inf")


def tied_logits(shape, dtype, seed, nan=True, stride=1):
    """[..., V] logits of few distinct values; the flattened rows stride * (1..7) hold +inf, -inf, overflow (and
    optionally NaN) entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).to(torch.float32).view(-1, shape[-1])
    row = [stride * i for i in range(8)]
    x[row[1], ::5] = INF
    x[row[2], 1::2] = -INF
    x[row[3], :-2] = -INF  # fewer finite entries than most k
    x[row[4]] = -INF
    x[row[5]] *= 1e36  # overflows to +-inf at a small temperature (and in float16 at once)
    x[row[6], ::3] = INF
    x[row[6], 1::3] = -INF
    if nan:
        x[row[7], 3] = float("nan")
    return x.view(shape).to(dtype)


def kept(logits, temperature, cut):
    """[..., V] bool: what the kernels keep with the cut (source, index): (z_v, v) >= (z_source, index)."""
    z = logits.to(torch.float32) / torch.full((), temperature)  # (a true division, as the kernels')
    source, index = (c.to(torch.int64).unsqueeze(-1) for c in cut)
    z_source = z.gather(-1, source)
    ids = torch.arange(z.shape[-1])
    return (z > z_source) | ((z == z_source) & (ids >= index))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-3])
def test_top_k_cut_keeps_what_the_element_cut_keeps(dtype, temperature):
    vocab = 37
    logits = tied_logits((2, 4, vocab), dtype, seed=0, nan=False)
    for top_k in (1, 2, 5, 36, vocab - 1):
        sampling = Sampling(temperature, top_k, 1.0)
        fast = _top_k_cut(logits, top_k)
        assert torch.equal(kept(logits, temperature, fast), kept(logits, temperature, _element_cut(logits, sampling)))
        assert torch.equal(fast[1], torch.zeros(2, 4, dtype=torch.int32))
        assert [c.dtype for c in fast] == [torch.int32, torch.int32]


def test_cut_takes_the_fast_path_only_for_one_temperature_and_top_k_alone():
    logits = tied_logits((2, 4, 37), torch.bfloat16, seed=1, nan=False)
    for warp in [(0.7, 5, 1.0), (1.0, 1, 1.0)]:  # the fast path: (source, 0) of the k-th largest raw logit
        assert torch.equal(_cut(logits, Sampling(*warp), kth_largest_index)[0], _top_k_cut(logits, warp[1])[0])
    for warp in [(0.7, 5, 0.9), (1.0, 36, 0.5)]:  # top-k with top-p: the cut's own element as its source
        assert all(torch.equal(a, b) for a, b in zip(_cut(logits, Sampling(*warp), kth_largest_index),
                                                    _top_k_top_p_cut(logits, Sampling(*warp))))
    # top-p alone, or top-k switched off (0, k >= V: no cut, the row's minimum as the source): the element cut
    for warp in [(1.0, 0, 0.8), (1.0, 37, 0.9), (1.0, 40, 0.9), (0.7, 37, 1.0), (0.7, 40, 1.0),
                 (0.7, 0, 1.0)]:
        assert all(torch.equal(a, b) for a, b in zip(_cut(logits, Sampling(*warp), kth_largest_index),
                                                    _element_cut(logits, Sampling(*warp))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-3])
def test_top_k_top_p_cut_keeps_what_the_element_cut_keeps(dtype, temperature):
    """``_top_k_top_p_cut`` (the cut's element as its source) against ``_element_cut`` over the whole-vocabulary
    definition of the cut (a V-length sort): the same index and the same kept set."""
    from test_top_k_top_p_cut import whole_vocabulary_cut
    from speculative_kernels.ops import cuda_host

    vocab = 37
    logits = tied_logits((2, 4, vocab), dtype, seed=3, nan=False)
    for top_k, top_p in [(1, 0.5), (2, 0.9), (5, 0.3), (20, 1e-9), (vocab - 1, 0.9999999)]:
        sampling = Sampling(temperature, top_k, top_p)
        fast = _top_k_top_p_cut(logits, sampling)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cuda_host, "warp_thresholds", whole_vocabulary_cut)
            slow = _element_cut(logits, sampling)
        assert torch.equal(fast[1], slow[1]), (top_k, top_p)
        assert torch.equal(kept(logits, temperature, fast), kept(logits, temperature, slow)), (top_k, top_p)


def _bench_cut():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cut.py"
    spec = importlib.util.spec_from_file_location("bench_cut", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bench_cuts_two_stage_topk_keeps_what_the_element_cut_keeps(dtype):
    """benchmarks/bench_cut.py's two-stage variant (per-chunk topk, then topk over the candidates) is exact on tied
    logits with +-inf and overflow rows, chunk sizes from k to V/2 (its check before timing sees random logits only)."""
    two_stage = _bench_cut().two_stage_top_k_cut
    vocab = 60
    logits = tied_logits((2, 4, vocab), dtype, seed=7, nan=False)
    for top_k, chunk in [(1, 6), (5, 5), (5, 30), (12, 12), (12, 20)]:
        for temperature in (1.0, 1e-3):
            want = kept(logits, temperature, _element_cut(logits, Sampling(temperature, top_k, 1.0)))
            assert torch.equal(kept(logits, temperature, two_stage(logits, top_k, chunk)), want), (top_k, chunk)
