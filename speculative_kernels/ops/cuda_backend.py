"""The CUDA-extension backend: ``verify`` / ``sample`` with the contract of ``reference.py``, run by the fused kernels
of ``csrc/`` (``torch.ops.speculative_kernels_cuda``).

Importing this module loads the extension (prebuilt or JIT, ``cuda_ext.py``) and raises ``RuntimeError`` with the
reason where it cannot; ``backends.py`` imports it only after ``cuda_ext.unavailable_reason()`` returned None. The fake
implementations registered here give the ops' output shapes to ``torch.compile`` (fullgraph) and to tracing.

Per-row parameters (``Sampling.rows``): the kernels read the temperatures from a device tensor (``temperature_rows``),
greedy rows (0) and sampled rows in one launch; top_k/top_p only shape the cut computed here. ``num_draft_tokens`` is
passed through as a device tensor too.

Top-k / top-p: the per-row lexicographic cut (value, index) comes from ``warping.warp_thresholds`` (HF's exact masks).
The kernels receive it as (source, index), the vocabulary id whose warped logit is the cut value, and recompute that
value with their own arithmetic (z = x / T, a true division), so the elements on either side of the cut are decided by
one arithmetic: a cut value computed here could differ from the kernel's z of the same element by an ulp (PyTorch's
CUDA ``tensor / python_float`` multiplies by the reciprocal; Triton's fp32 ``/`` under torch.compile is approximate)
and drop the cut element itself. z is computed here with a true division too (0-dim device tensor divisor).
"""

import torch

from . import cuda_ext
from .randomness import Randomness
from .sampling import Sampling
from .warping import row_thresholds, warp_thresholds

cuda_ext.load()  # the ops must exist before their fake implementations can be registered

__all__ = ["sample", "verify"]


@torch.library.register_fake("speculative_kernels_cuda::verify")
def _verify_fake(
    target_logits, draft_logits, draft_tokens, temperature, temperature_rows, target_cut_source, target_cut_index,
    draft_cut_source, draft_cut_index, seed, offset, seed_per_row, num_draft_tokens,
):
    batch, num_positions, _ = target_logits.shape
    tokens = target_logits.new_empty((batch, num_positions), dtype=torch.int64)
    return tokens, target_logits.new_empty((batch,), dtype=torch.int64)


@torch.library.register_fake("speculative_kernels_cuda::sample")
def _sample_fake(logits, temperature, temperature_rows, cut_source, cut_index, seed, offset, seed_per_row):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def _cut(logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """(cut_source [...] int32, cut_index [...] int32) of logits [B, ..., V]: keep v iff (z_v, v) >= (z_source, index).

    Per-row parameters: z = x / (the row's temperature, 1 for a greedy row) and the row's top_k/top_p (none for a
    greedy row); a row without a cut gets its minimum (source) and index 0, which keeps every element."""
    rows = sampling.rows
    if rows is None:
        divisor = torch.full((), sampling.temperature, dtype=torch.float32, device=logits.device)
        z = logits.to(torch.float32) / divisor
        cut_value, cut_index = warp_thresholds(z, sampling.top_k, sampling.top_p)
    else:
        shape = (-1, *([1] * (logits.dim() - 1)))
        z = logits.to(torch.float32) / rows.safe_temperature().view(shape)
        lead = (-1, *([1] * (logits.dim() - 2)))
        cut_value, cut_index = row_thresholds(z, rows.sampled_top_k().view(lead), rows.sampled_top_p().view(lead))
    # With top-p the cut is an element, (z_i, i); with top-k alone it is (k-th largest z, 0): take the first element
    # holding that value; with no cut (-inf, 0): the row's minimum.
    at_index = z.gather(-1, cut_index.to(torch.int64).unsqueeze(-1)).squeeze(-1)
    first_equal = (z == cut_value.unsqueeze(-1)).to(torch.int32).argmax(dim=-1)
    source = torch.where(at_index == cut_value, cut_index.to(torch.int64), first_equal)
    source = torch.where(cut_value == float("-inf"), z.argmin(dim=-1), source)
    return source.to(torch.int32), cut_index.to(torch.int32)


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


def verify(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_tokens: torch.Tensor,
           sampling: Sampling, randomness: Randomness,
           num_draft_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits: [B, K+1, V]; draft_logits: [B, K, V] or None (one-hot q); draft_tokens: [B, K];
    num_draft_tokens: [B] int64 or None. Returns (tokens [B, K+1] int64 with -1 padding, num_accepted [B] int64)."""
    target_cut = draft_cut = (None, None)
    if sampling.cuts(target_logits.shape[-1]):
        target_cut = _cut(target_logits, sampling)
        if draft_logits is not None:
            draft_cut = _cut(draft_logits, sampling)
    tokens, num_accepted = torch.ops.speculative_kernels_cuda.verify(
        target_logits, draft_logits, draft_tokens, *_temperature(sampling), *target_cut, *draft_cut,
        randomness.seed, randomness.offset, bool(randomness.seed_per_row), num_draft_tokens,
    )
    _row_flags(sampling, tokens, num_accepted)
    return tokens, num_accepted


def sample(logits: torch.Tensor, sampling: Sampling, randomness: Randomness) -> torch.Tensor:
    """logits: [B, V]. Returns [B] int64 (-1 for an invalid row)."""
    cut = _cut(logits, sampling) if sampling.cuts(logits.shape[-1]) else (None, None)
    tokens = torch.ops.speculative_kernels_cuda.sample(
        logits, *_temperature(sampling), *cut, randomness.seed, randomness.offset, bool(randomness.seed_per_row)
    )
    _row_flags(sampling, tokens)
    return tokens
