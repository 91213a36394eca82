"""How many slots the static caches need, and how many bytes the static path allocates (checked before
allocating: ``memory.check_free_memory``)."""

import math

import torch

from .slot_cache import CacheLayout


def static_capacity(prompt_width: int, max_new_tokens: int, gamma: int, batch: int, slack: float) -> int:
    """Slots per row of each static cache.

    A row holds at most prompt_width + max_new_tokens real slots (finished rows keep no new slots), one iteration
    writes at most gamma + 1 more, and right after a compaction up to gamma + 1 rejected slots of the last iteration
    may remain; so ``minimum`` always leaves room after compacting. Batches add ``slack`` * minimum slots so that holes
    accumulate between compactions (batch 1, and caches without holes, get no slack).
    """
    minimum = prompt_width + max_new_tokens + 2 * (gamma + 1) + 2
    return minimum if batch == 1 else minimum + math.ceil(slack * minimum)


def static_memory_bytes(layouts: list[CacheLayout], batch: int, capacity: int, gamma: int) -> dict:
    """Bytes the static path allocates beyond the models: K/V caches, slot masks, and the largest per-forward mask."""
    caches = sum(layout.bytes(batch, capacity) for layout in layouts)
    masks = len(layouts) * batch * capacity * 8  # slot_mask, int64
    element = max(torch.empty((), dtype=layout.dtype).element_size() for layout in layouts)
    attention = batch * (gamma + 1) * capacity * (element + 2)  # the additive mask and its bool precursor
    return {"kv_caches": caches, "slot_masks": masks, "attention_mask": attention, "total": caches + masks + attention}
