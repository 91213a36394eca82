"""The plain-PyTorch backend of ``compact_kv``: the reference itself (any device, traceable by torch.compile)."""

from .compaction import compact_kv_reference

__all__ = ["compact_kv"]


def compact_kv(tensors, slot_mask) -> None:
    """tensors: list of [B, H, S, D]; slot_mask: [B, S]. In place."""
    for kv in tensors:
        compact_kv_reference(kv, slot_mask)
