"""The plain-PyTorch backend of ``compact_kv``: the reference itself (any device, traceable by torch.compile)."""

from .compaction import compact_kv_reference, compaction_sources

__all__ = ["compact_kv"]


def compact_kv(tensors, slot_mask) -> None:
    """tensors: list of [B, H, S, D]; slot_mask: [B, S]. In place; the gather index is computed once for all."""
    source = compaction_sources(slot_mask)
    for kv in tensors:
        compact_kv_reference(kv, slot_mask, source)
