"""Logit warping with Hugging Face's sampling semantics, in the form the kernels consume.

HF's sampling path (``do_sample=True``) casts the logits to float32 and applies, in order,
``TemperatureLogitsWarper`` (z = l / T), ``TopKLogitsWarper`` (keep z >= the k-th largest z; ties kept) and
``TopPLogitsWarper`` (ascending sort of the surviving z, cumulative softmax; drop every entry whose cumulative
probability is <= 1 - top_p, always keeping the largest). Both filters remove a prefix of the vocabulary in
(value, index) order, so the surviving set of one row is exactly

    keep(v)  <=>  (z_v, v) >= (cut_value, cut_index)   lexicographically.

``warp_thresholds`` computes that pair per row; the kernels then apply it while streaming the logits, without writing
a warped copy. Top-k alone and top-p alone use the torch operations HF uses (the masks agree bit for bit).

Top-p after top-k (HF's default top_k=50 with a generation_config's top_p) is defined over the survivors of top-k by
exact integer arithmetic instead of HF's float32 softmax and cumulative sum over V entries: each survivor weighs
max(floor(exp(z - max) * 2**b), 1) with b = 62 - bit_length(V), and a position is removed iff its cumulative weight is
<= floor(float32(1 - top_p) * float64(total)). Why: HF's float32 sums over V entries, mostly exp(-inf) = 0, depend on
where the nonzero entries sit in the reduction (a CPU vector lane, a CUDA block tree and scan), so no computation over
the k survivors alone can reproduce them bit for bit, and the cut is worth computing from a topk of k (the cut's
V-length passes cost 13-17x the verification kernel on an H200, benchmarks/RESULTS.md). Integer sums are exact in
any order: the topk path (``_top_k_top_p_cut``), the whole-vocabulary one (``_top_p_after_top_k_cut``, the per-row
path's) and the per-row topk of a bound (``_rows_top_k_cut``) give the same cut by construction on a device (the
one float step, torch's elementwise exp, rounds each element alone; two devices whose exp differs in an ulp can differ
in a weight's last unit, as HF's CPU and CUDA paths differ in their sums). The
difference from HF is rounding: the weights move the total by under 2**(2 bit_length(V) - 62) of itself (2**-28 at
V = 128256, below float32's 2**-24), and HF's own float32 cumulative probabilities differ from the
exact ones by a few ulps (and between its CPU cumsum, accumulated in float64, and its CUDA one, in float32). The kept
sets differ only when 1 - top_p lies within that rounding of a cumulative probability: none of 150k random rows
(float32, bfloat16, float16; V 50 to 128256; top_p 0.5 to 0.99) differed from the float32 computation; a top_p set
exactly on a float32 cumulative probability lands on either side about half the time.

One difference, at ties only: HF's top-p sorts without ``stable=True``, so when equal logits straddle the top-p cut,
which of them it drops is up to the sort implementation (it differs between torch's CPU and CUDA sorts, and
between sizes). Here the sort is stable: of tokens tied at the cut, the lower ids are dropped first, the same on
every backend and device. Ties are rare in float32 logits and common in bfloat16/float16 ones
(docs/half_precision.md).
"""

import struct
import typing

import torch

NO_CUT = float("-inf")


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = float32(logits) / temperature (HF's TemperatureLogitsWarper); temperature > 0."""
    z = logits.to(torch.float32)
    if temperature == 1.0:
        return z
    if z.device.type != "cpu":  # (CUDA divides by a host scalar as a multiplication by its reciprocal, an ulp off the
        # true division that the per-row path and the kernels do; a device scalar divides truly, with no host copy)
        return z / torch.full((), temperature, dtype=torch.float32, device=z.device)
    return z / temperature


def warp_thresholds(z: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cut (value, index) for top-k then top-p, HF semantics (top-p after top-k: ``_top_k_top_p_cut``).

    z: [..., V] float32 scaled logits. Returns (cut_value [...] float32, cut_index [...] int32); with neither
    filter active the cut is (-inf, 0), which keeps every finite entry.
    """
    lead = z.shape[:-1]
    V = z.shape[-1]
    if 0 < top_k < V and top_p < 1.0:
        return _top_k_top_p_cut(z, top_k, _float32(1.0 - top_p))
    cut_value = torch.full(lead, NO_CUT, dtype=torch.float32, device=z.device)
    cut_index = torch.zeros(lead, dtype=torch.int32, device=z.device)
    if 0 < top_k < V:
        cut_value = torch.topk(z, top_k, dim=-1).values[..., -1]
    if top_p >= 1.0:
        return cut_value, cut_index
    sorted_z, order = torch.sort(z, dim=-1, descending=False, stable=True)
    return _top_p_cut(sorted_z, order, 1.0 - top_p)


def _top_p_cut(sorted_z: torch.Tensor, order: torch.Tensor, threshold) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p cut (top-p alone) from the ascending stable sort of z (sorted_z, order: [..., V]): drop every entry
    whose cumulative probability (float32 softmax, cumsum: HF's operations) is <= threshold (1 - top_p), always
    keeping the largest. The first kept position defines the cut. Returns (cut_value [...] float32, cut_index [...]
    int32)."""
    cumulative = sorted_z.softmax(dim=-1).cumsum(dim=-1)
    removed = cumulative <= threshold
    removed[..., -1] = False
    first_kept = removed.to(torch.int32).sum(dim=-1, keepdim=True).to(torch.int64)
    return sorted_z.gather(-1, first_kept).squeeze(-1), order.gather(-1, first_kept).squeeze(-1).to(torch.int32)


# -- top-p after top-k: exact integer weights -------------------------------------------------------------------------


def _float32(x: float) -> float:
    """x rounded to float32 (as torch rounds a python float compared with a float32 tensor), as a python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _weight_bits(vocab: int) -> int:
    """Fixed-point bits of the weights: any V weights of at most 2**bits sum below 2**62 (no int64 overflow)."""
    return 62 - vocab.bit_length()


def _weights(z: torch.Tensor, row_max: torch.Tensor, bits: int) -> torch.Tensor:
    """max(floor(exp(z - max) * 2**bits), 1) as int64, elementwise: [..., N] -> [..., N] (1 where the exponential
    is NaN: a row holding NaN, +inf, or nothing above -inf). The floor and the minimum of 1 move a weight by less than
    one unit, 2**-bits of the largest weight: V of them move the total by under 2**(2 bit_length(V) - 62) of it."""
    scaled = torch.exp(z - row_max) * float(2**bits)  # (exact: a power of two)
    return torch.nan_to_num(scaled, nan=1.0).to(torch.int64).clamp(min=1)


def _limit(total: torch.Tensor, threshold) -> torch.Tensor:
    """[..., 1] int64: the largest cumulative weight that is removed, floor(threshold * float64(total)) (threshold:
    1 - top_p rounded to float32, as a float64 [..., 1] or a python float). A position is removed iff its cumulative
    weight is <= the limit: an integer comparison, the same on every device and for every layout of the row."""
    return (total.to(torch.float64) * threshold).to(torch.int64)  # (truncation: the floor of a product >= 0)


def _top_p_after_top_k_cut(sorted_z: torch.Tensor, order: torch.Tensor, kth: torch.Tensor,
                           threshold) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p cut after a top-k cut, over the whole vocabulary: the definition that ``_top_k_top_p_cut`` computes
    from the k largest. sorted_z, order: [..., V] the ascending stable sort of z; kth [..., 1] the k-th largest value;
    threshold: see ``_limit``. Entries below kth weigh 0 (removed, whatever their order); the survivors in (value,
    index) order weigh ``_weights``; positions whose cumulative weight is <= ``_limit`` are removed, the last (largest)
    always kept. Returns (cut_value [...] float32, cut_index [...] int32)."""
    vocab = sorted_z.shape[-1]
    q = _weights(sorted_z, sorted_z[..., -1:], _weight_bits(vocab)).masked_fill(sorted_z < kth, 0)
    cumulative = q.cumsum(dim=-1)
    # (the last position, the largest, is never removed: only the others are counted)
    first_kept = (cumulative[..., :-1] <= _limit(cumulative[..., -1:], threshold)).sum(dim=-1, keepdim=True)
    return sorted_z.gather(-1, first_kept).squeeze(-1), order.gather(-1, first_kept).squeeze(-1).to(torch.int32)


def _top_k_top_p_cut(z: torch.Tensor, top_k: int, threshold) -> tuple[torch.Tensor, torch.Tensor]:
    """``_top_p_after_top_k_cut`` of z [..., V] (0 < top_k < V) from a topk of k instead of a V-length sort: bit for
    bit the same cut, because every quantity it compares is an exact integer (``_candidates_cut``)."""
    ids = torch.topk(z, top_k, dim=-1).indices.sort(dim=-1).values  # [..., k] candidates in id order
    return _candidates_cut(ids, z.gather(-1, ids), lambda t: z == t, threshold)


def top_k_top_p_cut_of_logits(logits: torch.Tensor, temperature: float, top_k: int,
                              top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``warp_thresholds(scale_logits(logits, temperature), top_k, top_p)`` (0 < top_k < V, top_p < 1) without a
    float32 copy of z: the candidates from a topk over the raw logits [..., V] (``kth_largest_index``), z of those k
    only, and the entries tied with the k-th largest z counted in the logits' own values (``scaled_equal``)."""
    ids = torch.topk(logits, top_k, dim=-1).indices.sort(dim=-1).values
    values = scale_logits(logits.gather(-1, ids), temperature)
    return _candidates_cut(ids, values, lambda t: scaled_equal(logits, t, temperature),
                           _float32(1.0 - float(top_p)))


def _candidates_cut(ids: torch.Tensor, values: torch.Tensor, tied, threshold) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut of ``_top_k_top_p_cut`` from its k candidates: ids [..., k] in id order (the elements of the k
    largest z: any of them where ties straddle the k-th), values [..., k] their z, ``tied(t)``: [..., V] bool,
    z == t for t [..., 1]; threshold: see ``_limit``. Returns (cut_value [...] float32, cut_index [...] int32)."""
    value, index, _ = _cut_among_candidates(ids, values, tied, threshold)
    return value.squeeze(-1), index.squeeze(-1).to(torch.int32)


def _cut_among_candidates(ids: torch.Tensor, values: torch.Tensor, tied, threshold,
                          first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-p-after-top-k cut from candidates: ids [..., N] in id order, values [..., N] their z, ``tied(t)``:
    [..., V] bool, z == t for t [..., 1]; threshold: see ``_limit``. ``first`` [..., 1]: a row's candidates are the
    last N - first in (value, index) order (a k per row from a topk of a bound; the positions before weigh 0 and are
    not counted); None: all N. Returns (cut_value [..., 1] float32, cut_index [..., 1] int64, t [..., 1]: the k-th
    largest value, the top-k cut).

    The survivors are the row's candidates and the entries tied with its k-th largest value t that topk left out.
    The candidates, sorted by (value, index), carry every survivor above t; the c entries tied at t come first, each
    of weight q_t >= 1, so the j-th of them has cumulative weight j * q_t: of the c - (tied candidates) ties that
    precede the candidates, at most floor(limit / q_t) are removed, and the candidates' cumulative weights start from
    that many times q_t. When the cut falls among the ties, its index is the r-th tied id (a cumulative count over
    V)."""
    values, order = values.sort(dim=-1, stable=True)  # (value, index) ascending
    t = values[..., :1] if first is None else values.gather(-1, first)
    mask = tied(t)  # [..., V]
    vocab = mask.shape[-1]
    if _count_ties_by_chunks(mask):
        tie_counts = _chunk_counts(mask)  # ties per chunk of ids, and the ties at or before each chunk
        ties = tie_counts.before[..., -1:]
        nth_tie = (lambda n: _nth_true_index(tie_counts, n))
    else:
        tie_rank = mask.cumsum(dim=-1, dtype=torch.int32)  # [..., V]: ties at or before each id
        ties = tie_rank[..., -1:]
        nth_tie = (lambda n: (tie_rank <= n).sum(dim=-1, keepdim=True))
    tied_candidates = values == t
    q = _weights(values, values[..., -1:], _weight_bits(vocab))
    if first is not None:
        before = torch.arange(values.shape[-1], device=values.device) < first  # not the row's candidates
        tied_candidates = tied_candidates & ~before
        q = q.masked_fill(before, 0)
    outside = ties - tied_candidates.sum(dim=-1, keepdim=True)  # ties that topk left out
    q_t = q[..., :1] if first is None else q.gather(-1, first)
    cumulative = q.cumsum(dim=-1) + outside * q_t
    limit = _limit(cumulative[..., -1:], threshold)
    # removed: the first ``removed`` survivors in (value, index) order, of which ``candidate`` candidates (the largest,
    # the last candidate, never counted); the others (any at all only if candidates are) are ties left out
    counted = cumulative[..., :-1] <= limit
    if first is not None:
        counted = counted & ~before[..., :-1]
    candidate = counted.sum(dim=-1, keepdim=True)
    removed = torch.minimum(limit // q_t, outside) + candidate
    in_ties = removed < ties
    at = candidate if first is None else first + candidate
    cut_value = torch.where(in_ties, t, values.gather(-1, at))
    cut_index = torch.where(in_ties, nth_tie(removed), ids.gather(-1, order.gather(-1, at)))
    return cut_value, cut_index, t


def _count_ties_by_chunks(mask: torch.Tensor) -> bool:
    """Whether the tie count of ``_cut_among_candidates`` goes by chunks (``_chunk_counts``) rather than a cumsum over
    V: off the CPU, where torch's cumsum of a few long rows runs on one block. The CPU's cumsum is one sequential pass,
    and the chunks' ~15 more small ops a cut would cost the CPU loop more than they save (``test_op_budget.py``).
    Both give the same integers (tests run the chunks on the CPU too)."""
    return mask.device.type != "cpu"


TRUE_COUNT_CHUNK = 256  # ids per chunk in ``_chunk_counts`` (V = 128256 and 32000 are multiples: no padding)


class _ChunkCounts(typing.NamedTuple):
    """A bool mask [..., V] cut into chunks of ``TRUE_COUNT_CHUNK`` ids (padded with False): ``chunks`` [..., C,
    chunk], ``before`` [..., C] int32 the True entries up to the end of each chunk (inclusive), ``vocab`` V."""

    chunks: torch.Tensor
    before: torch.Tensor
    vocab: int


def _chunk_counts(mask: torch.Tensor) -> _ChunkCounts:
    """``_ChunkCounts`` of mask [..., V]: one reduction over V and a scan over the V / 256 chunk counts, not a scan
    over V (torch's CUDA cumsum along a few long rows runs on one block per 16 rows; the top-p part of a top-k + top-p
    verification cost ~600 us at B = 1 on an H200, seventh GPU run, and this [9, 128256] scan was its one V-length
    scan: not yet measured apart)."""
    vocab = mask.shape[-1]
    pad = -vocab % TRUE_COUNT_CHUNK
    padded = torch.nn.functional.pad(mask, (0, pad)) if pad else mask
    chunks = padded.reshape(*mask.shape[:-1], -1, TRUE_COUNT_CHUNK)
    before = chunks.sum(dim=-1, dtype=torch.int32).cumsum(dim=-1, dtype=torch.int32)
    return _ChunkCounts(chunks, before, vocab)


def _nth_true_index(counts: _ChunkCounts, n: torch.Tensor) -> torch.Tensor:
    """[..., 1] int64: the id of the (n + 1)-th True of the mask (n [..., 1] >= 0, ids in order), V where it has n or
    fewer: ``(mask.cumsum(-1) <= n).sum(-1, keepdim=True)``, from the chunk counts and a scan within one chunk. The
    chunks before the one holding it are those whose inclusive counts are <= n; within that chunk, its ids whose count
    (the chunks before plus its own scan) is <= n."""
    num_chunks = counts.before.shape[-1]
    chunk = (counts.before <= n).sum(dim=-1, keepdim=True)  # [..., 1]: num_chunks where there is none
    at = chunk.clamp(max=num_chunks - 1)
    prior = torch.where(chunk > 0, counts.before.gather(-1, (chunk - 1).clamp(min=0)), 0)
    inside = counts.chunks.gather(-2, at.unsqueeze(-1).expand(*at.shape, TRUE_COUNT_CHUNK)).squeeze(-2)
    within = (inside.cumsum(dim=-1, dtype=torch.int32) + prior <= n).sum(dim=-1, keepdim=True)
    return torch.where(chunk >= num_chunks, counts.vocab, at * TRUE_COUNT_CHUNK + within)


def scaled_equal(logits: torch.Tensor, t: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """[..., V] bool: z == t for z = float32(logits) / temperature (a correctly rounded division, as the kernels'
    and ``scale_logits``), computed without z: t [..., 1] float32. The logits' own values are not enough (at a tiny
    temperature distinct logits overflow to the same +-inf, at a large one they round to the same subnormal or 0, and
    float32 logits x != x' give the same x / 3), so z == t is tested as x in the set of reals that round to t,
    times the temperature: [lo, hi] in float64, where every bound is exact (``_rounding_interval``). temperature: a
    python float, or float32 [..., 1] (per row)."""
    if not isinstance(temperature, torch.Tensor) and temperature == 1.0:
        return logits == t  # (z = float32(x) exactly)
    lo, hi = _rounding_interval(t, temperature)
    return (logits >= lo) & (logits <= hi)


def _rounding_interval(t: torch.Tensor, temperature: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (lo, hi) of t [...] float32: x / T rounds to t in float32 (round to nearest even) iff lo <= x <= hi,
    for x of any float dtype (all exact in float64) and T = float32(temperature) > 0. The reals rounding to t are the
    interval between the midpoints to its float32 neighbours (found with nextafter in float32, so a power of two's
    lower binade and the subnormals need no case of their own), inclusive iff t's last bit is even; +inf takes
    everything from the midpoint of the largest float and 2**128 up, and +-0 everything within 2**-150 of 0. A
    midpoint has at most 25 significant bits and T 24, so their product is exact in float64; an exclusive bound
    moves to the next float64 (no float of a smaller type lies between). NaN gives NaN bounds (nothing is equal)."""
    t64 = t.to(torch.float64)
    magnitude = t.abs()  # float32: its float32 neighbours give the ulps exactly, subnormals and powers of two included
    a = magnitude.to(torch.float64)
    above = magnitude.nextafter(torch.full_like(magnitude, float("inf"))).to(torch.float64)
    below = magnitude.nextafter(torch.full_like(magnitude, -float("inf"))).to(torch.float64)
    ulp_above = torch.where(magnitude == torch.finfo(torch.float32).max, 2.0**104, above - a)  # (2**128, not inf)
    low, high = a - (a - below) / 2, a + ulp_above / 2  # (0: +-2**-150)
    low = torch.where(torch.isinf(a), 2.0**128 - 2.0**103, low)
    high = torch.where(torch.isinf(a), float("inf"), high)
    negative = torch.signbit(t64)  # (-0: the same interval, symmetric)
    lo, hi = torch.where(negative, -high, low), torch.where(negative, -low, high)
    if isinstance(temperature, torch.Tensor):
        scale = temperature.to(torch.float32).to(torch.float64)
    else:
        scale = _float32(float(temperature))  # (float(): a SymFloat under torch.compile is specialised)
    lo, hi = lo * scale, hi * scale
    odd = (t.view(torch.int32) & 1) == 1
    lo = torch.where(odd, torch.nextafter(lo, torch.full_like(lo, float("inf"))), lo)
    hi = torch.where(odd, torch.nextafter(hi, torch.full_like(hi, float("-inf"))), hi)
    return lo, hi


def kth_largest_index(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., V] logits in their own dtype, 0 < k < V -> [...] int64: an element holding the k-th largest warped logit
    z = float32(x) / T, for any T > 0. The conversion is exact and a correctly rounded division by a positive number
    is non-decreasing, so the element of the k-th largest x holds the k-th largest z: one topk over the raw logits,
    without a float32 copy of z. A row with a NaN gets an unspecified element (CUDA's bf16 topk of k = V - 1 ended on
    the NaN where the float32 one did not, H200, torch 2.11); the kernels flag such a row whatever its cut."""
    return torch.topk(logits, k, dim=-1).indices[..., -1]


def apply_thresholds(z: torch.Tensor, cut_value: torch.Tensor, cut_index: torch.Tensor) -> torch.Tensor:
    """z with every entry below the (value, index) cut set to -inf. z: [..., V]; cuts: [...]."""
    index = torch.arange(z.shape[-1], device=z.device, dtype=torch.int32)
    v, i = cut_value.unsqueeze(-1), cut_index.unsqueeze(-1)
    keep = (z > v) | ((z == v) & (index >= i))
    return z.masked_fill(~keep, float("-inf"))


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The float32 warped logits HF would sample from: temperature, then top-k, then top-p. [..., V] -> [..., V]."""
    z = scale_logits(logits, temperature)
    if top_k <= 0 and top_p >= 1.0:
        return z
    cut_value, cut_index = warp_thresholds(z, top_k, top_p)
    return apply_thresholds(z, cut_value, cut_index)


def row_thresholds(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   top_k_bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``warp_thresholds`` with a top_k and a top_p per row: z [..., V] float32; top_k int64 and top_p float64,
    both broadcast to z.shape[:-1]. A row's cut equals ``warp_thresholds`` of that row alone with the scalars
    (top_k, float(top_p)): the k-th largest value, the same stable sort, softmax and cumulative sum for top-p alone,
    the whole-vocabulary definition of top-p after top-k (``_top_p_after_top_k_cut``, which the scalar path's topk of
    k equals bit for bit), and the threshold 1 - top_p computed in float64 and rounded to float32, as torch rounds the
    scalar path's python float.
    top_k <= 0 or >= V, and top_p >= 1 (or NaN), switch the filter off for that row.

    ``top_k_bound``: a host int the caller knows from host values (serving: the requests' settings), None if unknown.
    With 0 < top_k_bound < V it promises that every row with top_p < 1 has 0 < top_k <= top_k_bound (no row needs
    top-p over the whole vocabulary), and the cut comes from one topk of top_k_bound (``_rows_top_k_cut``) instead
    of a V-length sort: the same cut bit for bit. A broken promise gives a wrong cut (it cannot be checked without
    reading the device)."""
    lead = z.shape[:-1]
    vocab = z.shape[-1]
    top_k, top_p = top_k.expand(lead), top_p.expand(lead)
    if top_k_bound is not None and 0 < top_k_bound < vocab:
        return _rows_top_k_cut(z, top_k, top_p, top_k_bound)
    use_k = (top_k > 0) & (top_k < vocab)
    # One ascending stable sort serves both filters: the k-th largest value is at V - k (entries below it weigh 0 in
    # ``_top_p_after_top_k_cut``, whatever their order). The per-row k is a device value, hence no topk of k here.
    sorted_z, order = torch.sort(z, dim=-1, descending=False, stable=True)
    kth = sorted_z.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(-1))
    cut_value = torch.where(use_k, kth.squeeze(-1), NO_CUT)
    cut_index = torch.zeros(lead, dtype=torch.int32, device=z.device)
    threshold = (1.0 - top_p).to(torch.float32)
    # top-p alone: HF's float32 softmax over the row; after a top-k: the exact integer weights of ``_top_k_top_p_cut``
    p_value, p_index = _top_p_cut(sorted_z, order, threshold.unsqueeze(-1))
    k_value, k_index = _top_p_after_top_k_cut(sorted_z, order, kth, threshold.to(torch.float64).unsqueeze(-1))
    p_value, p_index = torch.where(use_k, k_value, p_value), torch.where(use_k, k_index, p_index)
    use_p = top_p < 1.0
    return torch.where(use_p, p_value, cut_value), torch.where(use_p, p_index, cut_index)


def _rows_top_k_cut(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_thresholds`` from one topk of ``bound`` (0 < bound < V; every row with top_p < 1 has 0 < top_k <=
    bound): ``_top_k_top_p_cut`` with a k per row (``_rows_candidates_cut``). z [..., V]; top_k, top_p: [...]
    (expanded)."""
    ids = torch.topk(z, bound, dim=-1).indices.sort(dim=-1).values
    return _rows_candidates_cut(ids, z.gather(-1, ids), lambda t: z == t, top_k, top_p, z.shape[-1])


def rows_top_k_cut_of_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_rows_top_k_cut`` of z = float32(logits) / temperature without a float32 copy of z (as
    ``top_k_top_p_cut_of_logits``): logits [..., V]; temperature [...] float32 > 0 (a greedy row's 1), top_k, top_p
    [...]; 0 < bound < V with ``row_thresholds``' promise."""
    ids = torch.topk(logits, bound, dim=-1).indices.sort(dim=-1).values
    divisor = temperature.unsqueeze(-1)
    values = logits.gather(-1, ids).to(torch.float32) / divisor  # (a true division, as the kernels')
    return _rows_candidates_cut(ids, values, lambda t: scaled_equal(logits, t, divisor), top_k, top_p,
                                logits.shape[-1])


def _rows_candidates_cut(ids: torch.Tensor, values: torch.Tensor, tied, top_k: torch.Tensor, top_p: torch.Tensor,
                         vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut of ``_rows_top_k_cut`` from its ``bound`` candidates: ids [..., bound] in id order, values their z,
    ``tied(t)`` [..., V] bool: z == t for t [..., 1]. A row's k candidates are the last k of the bound candidates
    in (value, index) order (all entries above its k-th largest value t, and ties at t): ``_cut_among_candidates``
    with the row's first candidate; a row without top-p keeps its top-k cut (t, 0), one without top-k none."""
    bound = ids.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    first = (bound - top_k.clamp(1, bound)).unsqueeze(-1)  # the row's first candidate in (value, index) order
    threshold = (1.0 - top_p).to(torch.float32).to(torch.float64).unsqueeze(-1)
    p_value, p_index, t = _cut_among_candidates(ids, values, tied, threshold, first)
    k_value = torch.where(use_k, t.squeeze(-1), NO_CUT)
    use_p = use_k & (top_p < 1.0)
    p_index = p_index.squeeze(-1).to(torch.int32)
    return torch.where(use_p, p_value.squeeze(-1), k_value), torch.where(use_p, p_index, torch.zeros_like(p_index))
