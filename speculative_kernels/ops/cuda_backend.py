"""The CUDA-extension backend: ``verify`` / ``sample`` with the contract of ``reference.py``, run by the fused kernels
of ``csrc/`` (``torch.ops.speculative_kernels_cuda``).

Importing this module loads the extension (prebuilt or JIT, ``cuda_ext.py``) and raises ``RuntimeError`` with the
reason where it cannot; ``backends.py`` imports it only after ``cuda_ext.unavailable_reason()`` returned None. The fake
implementations registered here give the ops' output shapes to ``torch.compile`` (fullgraph) and to tracing.

Top-k / top-p: the per-row cut (value, index) comes from ``warping.warp_thresholds`` (HF's exact masks), computed on
z = float32(logits) / temperature as a true division, the same arithmetic the kernels use to compare against the cut.
(PyTorch's CUDA ``tensor / python_float`` multiplies by the reciprocal instead, which can differ by one ulp and would
move the cut by one element; the divisor is therefore a 0-dim device tensor.)
"""

import torch

from . import cuda_ext
from .warping import warp_thresholds

cuda_ext.load()  # the ops must exist before their fake implementations can be registered

__all__ = ["sample", "verify"]


@torch.library.register_fake("speculative_kernels_cuda::verify")
def _verify_fake(
    target_logits, draft_logits, draft_tokens, temperature, target_cut_value, target_cut_index, draft_cut_value,
    draft_cut_index, seed, offset, seed_per_row,
):
    batch, num_positions, _ = target_logits.shape
    tokens = target_logits.new_empty((batch, num_positions), dtype=torch.int64)
    return tokens, target_logits.new_empty((batch,), dtype=torch.int64)


@torch.library.register_fake("speculative_kernels_cuda::sample")
def _sample_fake(logits, temperature, cut_value, cut_index, seed, offset, seed_per_row):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def _cut_active(top_k: int, top_p: float, vocab: int) -> bool:
    return 0 < top_k < vocab or top_p < 1.0


def _cut(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cut_value [...] float32, cut_index [...] int32) of logits [..., V], on z = float32(logits) / T (true division)."""
    divisor = torch.full((), temperature, dtype=torch.float32, device=logits.device)
    return warp_thresholds(logits.to(torch.float32) / divisor, top_k, top_p)


def verify(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor | None,
    draft_tokens: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: torch.Tensor,
    offset: torch.Tensor,
    seed_per_row: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits: [B, K+1, V]; draft_logits: [B, K, V] or None (one-hot q); draft_tokens: [B, K];
    seed, offset: [B] int64. Returns (tokens [B, K+1] int64 with -1 padding, num_accepted [B] int64)."""
    target_cut = draft_cut = (None, None)
    if temperature > 0.0 and _cut_active(top_k, top_p, target_logits.shape[-1]):
        target_cut = _cut(target_logits, temperature, top_k, top_p)
        if draft_logits is not None:
            draft_cut = _cut(draft_logits, temperature, top_k, top_p)
    return torch.ops.speculative_kernels_cuda.verify(
        target_logits, draft_logits, draft_tokens, float(temperature), *target_cut, *draft_cut, seed, offset,
        bool(seed_per_row),
    )


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: torch.Tensor,
    offset: torch.Tensor,
    seed_per_row: bool,
) -> torch.Tensor:
    """logits: [B, V]; seed, offset: [B] int64. Returns [B] int64 (-1 for an invalid row)."""
    cut = (None, None)
    if temperature > 0.0 and _cut_active(top_k, top_p, logits.shape[-1]):
        cut = _cut(logits, temperature, top_k, top_p)
    return torch.ops.speculative_kernels_cuda.sample(
        logits, float(temperature), *cut, seed, offset, bool(seed_per_row)
    )
