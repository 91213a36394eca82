"""Logit warping with Hugging Face's sampling semantics, in the form the kernels consume.

HF's sampling path (``do_sample=True``) casts the logits to float32 and applies, in order,
``TemperatureLogitsWarper`` (z = l / T), ``TopKLogitsWarper`` (keep z >= the k-th largest z; ties kept) and
``TopPLogitsWarper`` (ascending sort of the surviving z, cumulative softmax; drop every entry whose cumulative
probability is <= 1 - top_p, always keeping the largest). Both filters remove a prefix of the vocabulary in
(value, index) order, so the surviving set of one row is exactly

    keep(v)  <=>  (z_v, v) >= (cut_value, cut_index)   lexicographically.

``warp_thresholds`` computes that pair per row with the same torch operations HF uses (so the masks agree bit for
bit); the kernels then apply it while streaming the logits, without writing a warped copy.

One difference, at ties only: HF's top-p sorts without ``stable=True``, so when equal logits straddle the top-p cut,
which of them it drops is up to the sort implementation (it differs between torch's CPU and CUDA sorts, and
between sizes). Here the sort is stable: of tokens tied at the cut, the lower ids are dropped first, the same on
every backend and device. Ties are rare in float32 logits and common in bfloat16/float16 ones
(docs/half_precision.md).
"""

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
    """Per-row cut (value, index) for top-k then top-p, HF semantics.

    z: [..., V] float32 scaled logits. Returns (cut_value [...] float32, cut_index [...] int32); with neither
    filter active the cut is (-inf, 0), which keeps every finite entry.
    """
    lead = z.shape[:-1]
    V = z.shape[-1]
    cut_value = torch.full(lead, NO_CUT, dtype=torch.float32, device=z.device)
    cut_index = torch.zeros(lead, dtype=torch.int32, device=z.device)
    if top_k > 0 and top_k < V:
        cut_value = torch.topk(z, top_k, dim=-1).values[..., -1]
    if top_p >= 1.0:
        return cut_value, cut_index
    # (Sorting the masked z, mostly -inf with a top-k, is cheaper than sorting z: ``row_thresholds``, whose k differs
    # per row, sorts z once instead.)
    masked = z.masked_fill(z < cut_value.unsqueeze(-1), float("-inf")) if top_k > 0 else z
    sorted_z, order = torch.sort(masked, dim=-1, descending=False, stable=True)
    # Entries below the top-k cut are -inf and removed by top-p too, so the top-p cut is the stricter one.
    return _top_p_cut(sorted_z, order, 1.0 - top_p)


def _top_p_cut(sorted_z: torch.Tensor, order: torch.Tensor, threshold) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p cut from the ascending stable sort of z (sorted_z, order: [..., V]; entries below a top-k cut already
    -inf in sorted_z): drop every entry whose cumulative probability is <= threshold (1 - top_p), always keeping the
    largest. The first kept position defines the cut; the -inf entries before it are removed whatever their order.
    Returns (cut_value [...] float32, cut_index [...] int32)."""
    cumulative = sorted_z.softmax(dim=-1).cumsum(dim=-1)
    removed = cumulative <= threshold
    removed[..., -1] = False
    first_kept = removed.to(torch.int32).sum(dim=-1, keepdim=True).to(torch.int64)
    return sorted_z.gather(-1, first_kept).squeeze(-1), order.gather(-1, first_kept).squeeze(-1).to(torch.int32)


def kth_largest_index(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[..., V] logits in their own dtype, 0 < k < V -> [...] int64: an element holding the k-th largest warped logit
    z = float32(x) / T, for any T > 0. The conversion is exact and a correctly rounded division by a positive number
    is non-decreasing (NaN stays NaN, which topk ranks above everything either way), so the element of the k-th
    largest x holds the k-th largest z: one topk over the raw logits, without a float32 copy of z."""
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


def row_thresholds(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``warp_thresholds`` with a top_k and a top_p per row: z [..., V] float32; top_k int64 and top_p float64,
    both broadcast to z.shape[:-1]. A row's cut equals ``warp_thresholds`` of that row alone with the scalars
    (top_k, float(top_p)): the k-th largest value, the same stable sort, softmax and cumulative sum, and the threshold
    1 - top_p computed in float64 and rounded to float32, as torch rounds the scalar path's python float.
    top_k <= 0 or >= V, and top_p >= 1 (or NaN), switch the filter off for that row."""
    lead = z.shape[:-1]
    vocab = z.shape[-1]
    top_k, top_p = top_k.expand(lead), top_p.expand(lead)
    use_k = (top_k > 0) & (top_k < vocab)
    # One ascending stable sort serves both filters: the k-th largest value is at V - k, and masking the sorted
    # values below it gives the sort of the masked z in every position that ``_top_p_cut`` reads (the kept ones).
    sorted_z, order = torch.sort(z, dim=-1, descending=False, stable=True)
    kth = sorted_z.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(-1))
    cut_value = torch.where(use_k, kth.squeeze(-1), NO_CUT)
    cut_index = torch.zeros(lead, dtype=torch.int32, device=z.device)
    sorted_z = sorted_z.masked_fill(sorted_z < cut_value.unsqueeze(-1), float("-inf"))
    p_value, p_index = _top_p_cut(sorted_z, order, (1.0 - top_p).to(torch.float32).unsqueeze(-1))
    use_p = top_p < 1.0
    return torch.where(use_p, p_value, cut_value), torch.where(use_p, p_index, cut_index)
