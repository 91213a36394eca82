"""``compact_kv``: squeeze the holes out of KV-cache rows, in place (the rollback kernel of batched decoding).

For every K/V tensor [B, H, S, D] and slot_mask [B, S] (nonzero = real), per row b with n_b real slots:

    kv[b, :, j] <- kv[b, :, s_j]   for j < n_b, s_j = index of the j-th real slot of row b
    kv[b, :, j]    unchanged        for j >= n_b

returning n [B] int64; values are copied bit for bit, so every backend gives identical tensors. Backends
(``backends.implementation(..., family="compaction")``): ``torch`` (the reference below), ``triton``
(``compaction_triton.py``) and ``cuda`` (``csrc/rollback_kernels.cu``). How they work: ``docs/batching.md``.
"""

from collections.abc import Sequence

import torch

from . import backends

__all__ = ["compact_kv", "compact_kv_reference", "compaction_lengths", "compaction_sources"]

_AS_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integers: bits unchanged


def compaction_lengths(slot_mask: torch.Tensor) -> torch.Tensor:
    """n [B] int64: real slots per row of slot_mask [B, S]."""
    return (slot_mask != 0).sum(dim=1)


def compaction_sources(slot_mask: torch.Tensor) -> torch.Tensor:
    """source [B, S] int64: the slot each slot j of a row takes its value from (the j-th real slot for j < n_b,
    itself after), for slot_mask [B, S] (any dtype, nonzero = real)."""
    real = slot_mask != 0
    lengths = real.sum(dim=1, keepdim=True)
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)  # real slots first, in slot order
    j = torch.arange(slot_mask.shape[1], device=slot_mask.device).unsqueeze(0)
    return torch.where(j < lengths, order, j)


def compact_kv_reference(kv: torch.Tensor, slot_mask: torch.Tensor, source: torch.Tensor | None = None) -> None:
    """In place on kv [B, H, S, D] (any strides), slot_mask [B, S] (any dtype, nonzero = real); source: the
    mask's ``compaction_sources`` when the caller has them (every layer's K and V share one mask)."""
    if source is None:
        source = compaction_sources(slot_mask)
    if kv.is_floating_point() or kv.is_complex():
        # Move the bits: gather has no float8 kernel, and torch's CPU gather converts fp16 / bf16 through float32
        # (an fp16 signaling NaN comes back quiet, every bf16 NaN as 0xffff or 0x7fc0 by the CPU's instruction set)
        kv = kv.view(_AS_INT.get(kv.element_size(), kv.dtype))
    index = source[:, None, :, None].expand(kv.shape)
    kv.copy_(kv.gather(2, index))


def _check(tensors: Sequence[torch.Tensor], slot_mask: torch.Tensor) -> None:
    if not isinstance(slot_mask, torch.Tensor) or slot_mask.dim() != 2:
        raise ValueError(f"slot_mask must be a [B, S] tensor, got {getattr(slot_mask, 'shape', slot_mask)}")
    if slot_mask.is_floating_point() or slot_mask.is_complex():
        raise TypeError(f"slot_mask must be an integer or bool tensor, got {slot_mask.dtype}")
    for i, kv in enumerate(tensors):
        if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
            raise ValueError(f"kv[{i}] must be a [B, H, S, D] tensor, got {getattr(kv, 'shape', kv)}")
        if (kv.shape[0], kv.shape[2]) != tuple(slot_mask.shape):
            raise ValueError(
                f"kv[{i}] has shape {tuple(kv.shape)} but slot_mask is {tuple(slot_mask.shape)} ([B, S] must match)"
            )
        if kv.device != slot_mask.device:
            raise ValueError(f"kv[{i}] is on {kv.device} but slot_mask is on {slot_mask.device}")
        if any(stride == 0 and size > 1 for size, stride in zip(kv.shape, kv.stride())):
            raise ValueError(f"kv[{i}] has a stride-0 (expanded) dimension, shape {tuple(kv.shape)} strides "
                             f"{kv.stride()}: its elements alias each other, so it cannot be compacted in place")
    if torch.compiler.is_compiling():  # (data pointers are not traceable; the eager call checked the same tensors)
        return
    seen = {}
    for i, kv in enumerate(tensors):  # the same memory twice would be compacted twice
        key = (kv.data_ptr(), tuple(kv.shape), kv.stride(), kv.dtype)
        if kv.numel() and key in seen:
            raise ValueError(f"kv[{i}] is the same memory as kv[{seen[key]}]: pass each tensor once")
        seen.setdefault(key, i)


def compact_kv(
    kv: torch.Tensor | Sequence[torch.Tensor], slot_mask: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Move each row's real slots to the left, in place, in every tensor of ``kv``; returns n [B] int64.

    kv: one tensor [B, H, S, D] or a sequence of them (e.g. every layer's K and V; any strides, the slot axis may be a
    view of a longer buffer); slot_mask: [B, S], nonzero = real. See the module docstring for the exact semantics.
    """
    if not isinstance(kv, (torch.Tensor, Sequence)):
        raise TypeError(f"kv must be a [B, H, S, D] tensor or a sequence of them, got {type(kv).__name__}")
    tensors = [kv] if isinstance(kv, torch.Tensor) else list(kv)
    _check(tensors, slot_mask)
    impl = backends.implementation(backend, slot_mask.device.type, family="compaction")
    impl.compact_kv(tensors, slot_mask)
    return compaction_lengths(slot_mask)
