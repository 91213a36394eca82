"""Top-p after top-k (``warping._top_k_top_p_cut``: a topk of k, no V-length sort) is bit for bit its definition over
the whole vocabulary (``warping._top_p_after_top_k_cut``: the stable sort of z, integer weights, their cumulative
sum), and the per-row cut (``row_thresholds``, one sort per row) is the scalar one: tied logits (bf16 and fp16 ties of
tens of entries at the k-th value), +-inf, overflow at a tiny temperature, k from 1 to V - 1, top_p from below
float32's resolution to just under 1. Rows holding NaN are left out: their cut is unspecified (every backend flags
them, ``reference.invalid_positions``)."""

import pytest
import torch

from speculative_kernels.ops import warping
from speculative_kernels.ops.warping import row_thresholds, warp_thresholds

from test_cuda_host_cut import tied_logits

TOP_P = (1e-9, 0.3, 0.9, 0.9999999)


def whole_vocabulary_cut(z: torch.Tensor, top_k: int, top_p: float):
    """The definition: the V-length sort of z, every entry weighed (the top-k cut's k-th largest value from topk)."""
    sorted_z, order = torch.sort(z, dim=-1, stable=True)
    kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
    return warping._top_p_after_top_k_cut(sorted_z, order, kth, warping._float32(1.0 - top_p))


def same_cut(a, b) -> bool:
    return torch.equal(a[0].view(torch.int32), b[0].view(torch.int32)) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-3])
def test_top_k_top_p_cut_is_its_whole_vocabulary_definition(dtype, temperature):
    vocab = 37
    x = torch.cat([tied_logits((8, vocab), dtype, seed=0, nan=False),
                   (torch.randn(8, vocab, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)])
    z = x.float() / temperature
    for top_k in (1, 2, 5, 20, vocab - 1):
        for top_p in TOP_P:
            assert same_cut(warp_thresholds(z, top_k, top_p), whole_vocabulary_cut(z, top_k, top_p)), (top_k, top_p)


def test_ties_larger_than_k_at_every_cut_position():
    """All-equal rows and rows of two levels, the k-th value tied with many more ids than topk returns: a top_p for
    each possible number of removed ties (the cut's index is the r-th tied id, found outside topk's candidates)."""
    vocab, top_k = 40, 3
    z = torch.zeros(4, vocab)
    z[1, ::4] = 1.0  # 10 ids above, 30 tied below
    z[2, 7] = 2.0
    z[3, 30:] = float("-inf")
    for top_p in [i / 41 for i in range(1, 41)] + [0.5]:
        want = whole_vocabulary_cut(z, top_k, top_p)
        assert same_cut(warp_thresholds(z, top_k, top_p), want), top_p
    # half of 40 ties; half of 10; 23 of the 39 ties of weight e**-2 below the 2 (23 e**-2 <= (39 e**-2 + 1) / 2); 15
    assert warp_thresholds(z, top_k, 0.5)[1].tolist() == [20, 20, 24, 15]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_per_row_cut_with_top_k_and_top_p_is_the_scalar_cut(dtype):
    vocab = 37
    z = tied_logits((8, vocab), dtype, seed=2, nan=False).float() / 0.7
    for top_k in (1, 5, vocab - 1):
        for top_p in TOP_P:
            rows = row_thresholds(z, torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float64))
            assert same_cut(rows, warp_thresholds(z, top_k, top_p)), (top_k, top_p)


def test_top_p_after_top_k_keeps_hfs_set_on_untied_logits():
    """The exact integer cumulative differs from HF's float32 softmax + cumsum by rounding only: on random float32
    rows (no ties) the kept sets are HF's (a top_p within float32 rounding of a cumulative probability is where they
    may differ; benchmarks/RESULTS.md and warping.py)."""
    from helpers.sampling import hf_warpers

    z = torch.randn(64, 300, generator=torch.Generator().manual_seed(3)) * 3
    for top_k, top_p in [(50, 0.9), (10, 0.5), (299, 0.95), (1, 0.2)]:
        expected = hf_warpers(1.0, top_k, top_p)(None, z.clone())
        assert torch.equal(warping.warp_logits(z, 1.0, top_k, top_p), expected)


def test_top_p_on_every_cumulative_weight():
    """top_p = 1 - c for each cumulative fraction c of the survivors (float64 of the integer weights): the float32
    threshold lands within rounding of the boundary, where the limit's float64 product must be computed alike by the
    topk path, the whole-vocabulary definition and the per-row path."""
    g = torch.Generator().manual_seed(4)
    vocab, top_k = 30, 12
    for _ in range(10):
        z = torch.randn(1, vocab, generator=g) * 2
        sorted_z, _ = torch.sort(z, stable=True)
        q = warping._weights(sorted_z, sorted_z[..., -1:], warping._weight_bits(vocab))[0, -top_k:]
        cumulative = q.cumsum(0).double() / q.sum().double()
        for top_p in {1.0 - float(c) for c in cumulative[:-1]}:
            want = whole_vocabulary_cut(z, top_k, top_p)
            assert same_cut(warp_thresholds(z, top_k, top_p), want), top_p
            rows = row_thresholds(z, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float64))
            assert same_cut(rows, want), top_p


@pytest.mark.parametrize("top_p,kept", [(0.5, 2), (0.75, 3), (0.25, 1)])
def test_top_p_after_top_k_keeps_the_entry_whose_cumulative_weight_meets_the_threshold(top_p, kept):
    """As HF (test_sampling_boundaries): with four survivors of exactly 1/4, top_p = 0.5 keeps 2 (not 3): a cumulative
    weight equal to the limit is removed."""
    z = torch.tensor([[0.0, 0.0, 0.0, 0.0, -40.0, -1.0]])
    from helpers.sampling import hf_warpers

    assert int(torch.isfinite(warping.warp_logits(z, 1.0, 4, top_p)).sum()) == kept
    assert int(torch.isfinite(hf_warpers(1.0, 4, top_p)(None, z.clone())).sum()) == kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 1e-3])
def test_per_row_cut_from_a_topk_of_the_bound_is_the_sorted_one(dtype, temperature):
    """``row_thresholds(..., top_k_bound)`` (one topk of the bound, a k per row) against the same call without a
    bound (one V-length sort per row): each row's own k in 1..bound with top_p from 1e-9 to 1 (top-k alone), and
    rows without any cut (k 0, top_p 1), on tied logits with +-inf and overflow rows."""
    vocab, bound = 37, 12
    z = tied_logits((4, 8, vocab), dtype, seed=9, nan=False).float() / temperature
    g = torch.Generator().manual_seed(10)
    for _ in range(6):
        top_k = torch.randint(1, bound + 1, (4, 8), generator=g)
        top_p = torch.tensor(TOP_P + (1.0,), dtype=torch.float64)[torch.randint(0, 5, (4, 8), generator=g)]
        top_k[0, :2], top_p[0, :2] = 0, 1.0
        top_k[1, 0] = bound
        want = row_thresholds(z, top_k, top_p)
        assert same_cut(row_thresholds(z, top_k, top_p, top_k_bound=bound), want)
        assert same_cut(row_thresholds(z, top_k, top_p, top_k_bound=vocab), want)  # (no topk of V: the sort)


def _every_value(dtype):
    """Every non-NaN value of a 16-bit float dtype, [65536 - NaNs]."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[~x.isnan()]


def _float32_runs():
    """float32 values in runs of neighbours (where x / T of distinct x collide at any T that is not a power of two):
    around 1, 3, 1e30, the smallest normal and subnormal, the largest float, 0, +-inf."""
    f = torch.tensor([1.0, 3.0, 1e30, 2.0**-126, 2.0**-149, 3.4028234663852886e38, 1e-40])
    bits = f.view(torch.int32).unsqueeze(-1) + torch.arange(-40, 41, dtype=torch.int32)
    x = bits.view(torch.float32).reshape(-1)
    x = torch.cat([x, -x, torch.tensor([0.0, -0.0, float("inf"), float("-inf")])])
    return x[~x.isnan()]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_scaled_equal_is_z_equal_without_z(dtype):
    """``warping.scaled_equal(x, t, T)`` (x in [lo, hi], float64 bounds) is z == t for z = float32(x) / T, at every
    t that z takes (some at random, some powers of two): every bf16/fp16 value (a float32 run of neighbours), T from
    2**-126 (overflow to +-inf) to 3e38 (subnormals and 0), 1, 3, 0.7, a power of two; ties of distinct x included."""
    x = _every_value(dtype) if dtype != torch.float32 else _float32_runs()
    collided = 0
    for temperature in (1.0, 0.7, 3.0, 2.0, 2.0**20, 2.0**-10, 1e-3, 2.0**-126, 1e-30, 1e30, 3e38,
                        3.4028234663852886e38):
        z = x.to(torch.float32) / temperature
        t = z.unique()
        powers = t[torch.frexp(t).mantissa.abs() == 0.5]  # (just below one, the lower binade's half ulp rounds up)
        g = torch.Generator().manual_seed(0)
        t = torch.cat([t[torch.randperm(len(t), generator=g)[:40]],
                       powers[torch.randperm(len(powers), generator=g)[:20]]])
        edges = torch.tensor([0.0, float("nan"), 3.4028234663852886e38, -3.4028234663852886e38, 2.0**-149, 2.0**-126])
        t = torch.cat([t, z.min().view(1), z.max().view(1), edges]).unsqueeze(-1)
        want = z == t  # [T's, values]
        got = warping.scaled_equal(x.unsqueeze(0), t, temperature)
        assert torch.equal(got, want), temperature
        x32 = x.to(torch.float32)
        collided += int((torch.where(want, x32, -float("inf")).amax(-1) > torch.where(want, x32, float("inf")).amin(-1))
                        .sum())
    assert collided > 0  # (some t hold distinct x: a comparison of the raw logits would miss them)



@pytest.mark.parametrize("vocab", [1, 255, 256, 257, 600, 1024])
def test_the_nth_tie_is_found_from_chunk_counts(vocab):
    """``warping._nth_true_index`` (the r-th tied id from per-chunk counts: no scan over V) equals its definition,
    ``(mask.cumsum(-1) <= n).sum(-1)``, for every n from 0 past the count: masks empty, full, sparse, dense, with
    Trues at chunk edges, V around and between multiples of the chunk, three leading dimensions."""
    from speculative_kernels.ops import warping

    g = torch.Generator().manual_seed(vocab)
    density = torch.tensor([0.0, 1.0, 0.01, 0.5, 0.9, 0.003]).view(1, 6, 1)
    mask = torch.rand(2, 6, vocab, generator=g) < density
    mask[1, 2, 255::256] = True  # (the last id of each chunk)
    mask[1, 3, ::256] = False  # (the first)
    counts = warping._chunk_counts(mask)
    assert torch.equal(counts.before[..., -1], mask.sum(-1, dtype=torch.int32))
    for n in range(0, vocab + 2, max(1, vocab // 97)):
        n_rows = torch.full((2, 6, 1), n, dtype=torch.int64)
        n_rows[0, :, 0] = torch.arange(6) * n % (vocab + 2)  # (another n per row)
        want = (mask.cumsum(-1) <= n_rows).sum(-1, keepdim=True)
        assert torch.equal(warping._nth_true_index(counts, n_rows), want), n


@pytest.mark.parametrize("by_chunks", [False, True], ids=["cumsum", "chunks"])
def test_ties_across_chunks_are_counted_alike(by_chunks, monkeypatch):
    """The tie count of top-p after top-k by chunks of ids (``warping._count_ties_by_chunks``: off the CPU) and by a
    cumsum over V (the CPU) give the whole-vocabulary cut bit for bit where the k-th value is tied across several
    256-id chunks (V = 1100: a padded last chunk), for a top_p at every tied position and with per-row top_k/top_p."""
    monkeypatch.setattr(warping, "_count_ties_by_chunks", lambda mask: by_chunks)
    vocab, top_k = 1100, 4
    z = torch.zeros(3, vocab)
    z[1, ::97] = 1.0  # 12 ids above, 1088 tied below: ties in every chunk
    z[2, 700:] = float("-inf")
    z[2, 3] = 3.0
    for top_p in [i / 13 for i in range(1, 13)] + [0.999]:
        want = whole_vocabulary_cut(z, top_k, top_p)
        assert same_cut(warp_thresholds(z, top_k, top_p), want), top_p
        rows = row_thresholds(z, torch.tensor([top_k, top_k, top_k]), torch.tensor([top_p] * 3, dtype=torch.float64),
                              top_k_bound=2 * top_k)
        assert same_cut(rows, want), top_p

