"""The host side of the CUDA backends (``cuda_backend.py``, ``compaction_cuda.py``), apart from the extension: what
it computes on the device with torch before a launch (the top-k/top-p cut as (source, index), the ops' temperature
arguments, the int8 slot mask) and after it (the rows flagged for invalid per-row parameters). ``verify_with`` /
``sample_with`` / ``compact_kv_with`` take the op to launch (the first two also the k-th largest select of the top-k
cut), so that the same host code also drives the CPU build of ``csrc/`` that the tests run without a GPU
(``tests/helpers/cuda_emulation``). Why the cut is passed as an element rather than a value: ``cuda_backend.py``."""

import torch

from .randomness import Randomness
from .sampling import Sampling
from .warping import kth_largest_index, row_thresholds, warp_thresholds

__all__ = ["compact_kv_with", "sample_with", "verify_with"]


def _cut(logits: torch.Tensor, sampling: Sampling, kth_largest) -> tuple[torch.Tensor, torch.Tensor]:
    """(cut_source [...] int32, cut_index [...] int32) of logits [B, ..., V]: keep v iff (z_v, v) >= (z_source, index).

    Per-row parameters: z = x / (the row's temperature, 1 for a greedy row) and the row's top_k/top_p (none for a
    greedy row); a row without a cut gets its minimum (source) and index 0, which keeps every element. One
    temperature with top-k alone takes ``_top_k_cut`` (``kth_largest`` of the raw logits), with top-k and top-p
    ``_top_k_top_p_cut`` (no V-length sort); the rest ``_element_cut``."""
    if sampling.top_k_alone(logits.shape[-1]):
        return _top_k_cut(logits, sampling.top_k, kth_largest)
    if sampling.top_k_with_top_p(logits.shape[-1]):
        return _top_k_top_p_cut(logits, sampling)
    return _element_cut(logits, sampling)


def _element_cut(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``_cut`` of any sampling, from the float32 z: the cut (value, index) of ``warping``, then an element holding
    that value (~7 passes over [B, ..., V] besides the topk/sort)."""
    rows = sampling.rows
    if rows is None:
        divisor = torch.full((), sampling.temperature, dtype=torch.float32, device=logits.device)
        z = logits.to(torch.float32) / divisor
        cut_value, cut_index = warp_thresholds(z, sampling.top_k, sampling.top_p)
    else:
        shape = (-1, *([1] * (logits.dim() - 1)))
        z = logits.to(torch.float32) / rows.safe_temperature().view(shape)
        lead = (-1, *([1] * (logits.dim() - 2)))
        cut_value, cut_index = row_thresholds(z, rows.sampled_top_k().view(lead), rows.sampled_top_p().view(lead),
                                              rows.top_k_bound)
    # With top-p the cut is an element, (z_i, i); with top-k alone it is (k-th largest z, 0): take the first element
    # holding that value; with no cut (-inf, 0): the row's minimum.
    at_index = z.gather(-1, cut_index.to(torch.int64).unsqueeze(-1)).squeeze(-1)
    first_equal = (z == cut_value.unsqueeze(-1)).to(torch.int32).argmax(dim=-1)
    source = torch.where(at_index == cut_value, cut_index.to(torch.int64), first_equal)
    source = torch.where(cut_value == float("-inf"), z.argmin(dim=-1), source)
    return source.to(torch.int32), cut_index.to(torch.int32)


def _top_k_cut(logits: torch.Tensor, top_k: int, kth_largest=kth_largest_index) -> tuple[torch.Tensor, torch.Tensor]:
    """``_cut`` for one temperature and top-k alone (0 < top_k < V), from the raw logits [B, ..., V]: an element of
    the k-th largest z, and with cut index 0 any element of that value is a valid source. ``kth_largest``:
    (logits [B, ..., V], k) -> [B, ...] integer ids, an element holding the k-th largest raw logit (which holds the
    k-th largest z: ``warping.kth_largest_index``): the CUDA backend's radix select
    (``torch.ops.speculative_kernels_cuda.kth_largest_index``), or that torch.topk. One select over the raw logits
    instead of a float32 copy, a topk over it and five more passes."""
    source = kth_largest(logits, top_k)
    return source.to(torch.int32), torch.zeros_like(source, dtype=torch.int32)


def _top_k_top_p_cut(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """``_cut`` for one temperature with top-k and top-p: ``warp_thresholds`` of z (a topk of k, no V-length sort),
    whose cut is an element (z_i, i): i is its own source. [B, ..., V] -> (source, index) [B, ...] int32."""
    divisor = torch.full((), sampling.temperature, dtype=torch.float32, device=logits.device)
    cut_index = warp_thresholds(logits.to(torch.float32) / divisor, sampling.top_k, sampling.top_p)[1]
    return cut_index, cut_index


def _row_flags(sampling: Sampling, tokens: torch.Tensor, num_accepted: torch.Tensor | None = None):
    """Rows with an invalid per-row parameter come back flagged (-1), as from every backend (reference.py)."""
    if sampling.rows is None:
        return
    bad = sampling.rows.out_of_range()
    tokens.masked_fill_(bad.view(-1, *([1] * (tokens.dim() - 1))), -1)
    if num_accepted is not None:
        num_accepted.masked_fill_(bad, -1)


def _temperature(sampling: Sampling) -> tuple[float, torch.Tensor | None]:
    """The ops' (temperature, temperature_rows) arguments."""
    if sampling.rows is None:
        return float(sampling.temperature), None
    return 1.0, sampling.rows.temperature


def verify_with(op, target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_tokens: torch.Tensor,
                sampling: Sampling, randomness: Randomness, num_draft_tokens: torch.Tensor | None = None, *,
                kth_largest) -> tuple[torch.Tensor, torch.Tensor]:
    """``cuda_backend.verify`` launching ``op`` (the signature of ``torch.ops.speculative_kernels_cuda.verify``), its
    top-k cut from ``kth_largest`` (``_top_k_cut``)."""
    target_cut = draft_cut = (None, None)
    if sampling.cuts(target_logits.shape[-1]):
        target_cut = _cut(target_logits, sampling, kth_largest)
        if draft_logits is not None:
            draft_cut = _cut(draft_logits, sampling, kth_largest)
    tokens, num_accepted = op(
        target_logits, draft_logits, draft_tokens, *_temperature(sampling), *target_cut, *draft_cut,
        randomness.seed, randomness.offset, bool(randomness.seed_per_row), num_draft_tokens,
    )
    _row_flags(sampling, tokens, num_accepted)
    return tokens, num_accepted


def sample_with(op, logits: torch.Tensor, sampling: Sampling, randomness: Randomness, *, kth_largest) -> torch.Tensor:
    """``cuda_backend.sample`` launching ``op`` (the signature of ``torch.ops.speculative_kernels_cuda.sample``), its
    top-k cut from ``kth_largest`` (``_top_k_cut``)."""
    cut = _cut(logits, sampling, kth_largest) if sampling.cuts(logits.shape[-1]) else (None, None)
    tokens = op(logits, *_temperature(sampling), *cut, randomness.seed, randomness.offset, bool(randomness.seed_per_row))
    _row_flags(sampling, tokens)
    return tokens


def compact_kv_with(op, tensors, slot_mask: torch.Tensor) -> None:
    """``compaction_cuda.compact_kv`` launching ``op`` (the signature of
    ``torch.ops.speculative_kernels_cuda.compact_kv_``): the mask as contiguous int8 (nonzero = real), computed once
    for all the tensors, each compacted in place."""
    mask = (slot_mask != 0).to(torch.int8).contiguous()
    for kv in tensors:
        op(kv, mask)
