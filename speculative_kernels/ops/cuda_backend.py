"""The CUDA-extension backend: ``verify`` / ``sample`` with the contract of ``reference.py``, run by the fused kernels
of ``csrc/`` (``torch.ops.speculative_kernels_cuda``).

Importing this module loads the extension (prebuilt or JIT, ``cuda_ext.py``) and raises ``RuntimeError`` with the
reason where it cannot; ``backends.py`` imports it only after ``cuda_ext.unavailable_reason()`` returned None. The fake
implementations registered here give the ops' output shapes to ``torch.compile`` (fullgraph) and to tracing.

Top-k alone (one temperature): the cut's element comes from ``kth_largest_index`` (``csrc/topk_kernels.cuh``: a
multi-block radix select over the raw logits' bits, 2 kernels for fp16/bf16 and 4 for float32 after a memset), not
from ``torch.topk``, whose radix select runs on a few blocks when the rows are few (B * (2K + 1) = 9 at B = 1).

Per-row parameters (``Sampling.rows``): the kernels read the temperatures from a device tensor (``temperature_rows``),
greedy rows (0) and sampled rows in one launch; top_k/top_p only shape the cut computed on the host side
(``cuda_host.py``, with torch on the device). ``num_draft_tokens`` is passed through as a device tensor too.

Top-k / top-p: the per-row lexicographic cut (value, index) comes from ``warping.warp_thresholds`` (HF's masks;
top-p after top-k to float32 rounding, warping.py).
The kernels receive it as (source, index), the vocabulary id whose warped logit is the cut value, and recompute that
value with their own arithmetic (z = x / T, a true division), so the elements on either side of the cut are decided by
one arithmetic: a cut value computed by torch could differ from the kernel's z of the same element by an ulp (PyTorch's
CUDA ``tensor / python_float`` multiplies by the reciprocal; Triton's fp32 ``/`` under torch.compile is approximate)
and drop the cut element itself. ``cuda_host.py`` computes z with a true division too (0-dim device tensor divisor).
"""

import torch

from . import cuda_ext
from .cuda_host import sample_with, verify_with
from .randomness import Randomness
from .sampling import Sampling

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


@torch.library.register_fake("speculative_kernels_cuda::kth_largest_index")
def _kth_largest_index_fake(logits, k):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int32)


@torch.library.register_fake("speculative_kernels_cuda::sample")
def _sample_fake(logits, temperature, temperature_rows, cut_source, cut_index, seed, offset, seed_per_row):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def verify(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_tokens: torch.Tensor,
           sampling: Sampling, randomness: Randomness,
           num_draft_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits: [B, K+1, V]; draft_logits: [B, K, V] or None (one-hot q); draft_tokens: [B, K];
    num_draft_tokens: [B] int64 or None. Returns (tokens [B, K+1] int64 with -1 padding, num_accepted [B] int64)."""
    return verify_with(torch.ops.speculative_kernels_cuda.verify, target_logits, draft_logits, draft_tokens, sampling,
                       randomness, num_draft_tokens, kth_largest=torch.ops.speculative_kernels_cuda.kth_largest_index)


def sample(logits: torch.Tensor, sampling: Sampling, randomness: Randomness) -> torch.Tensor:
    """logits: [B, V]. Returns [B] int64 (-1 for an invalid row)."""
    return sample_with(torch.ops.speculative_kernels_cuda.sample, logits, sampling, randomness,
                       kth_largest=torch.ops.speculative_kernels_cuda.kth_largest_index)
