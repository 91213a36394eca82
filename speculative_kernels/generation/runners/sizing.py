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


def captured_capacity(capacity: int) -> int:
    """``capacity`` rounded up to a bucket, for captured steps (``compile=True``): they are specialised to the cache's
    slot count, so every new prompt length or max_new_tokens would compile them again (and dynamo's per-function
    limit ends a process's compiled calls after a few dozen). Buckets are multiples of a quarter of the capacity's
    power of two (at least 64 slots): at most 25 % more slots, four buckets per doubling of the length."""
    quantum = max(64, 1 << max(0, capacity.bit_length() - 3))
    return -(-capacity // quantum) * quantum


def static_memory_bytes(layouts: list[CacheLayout], batch: int, capacity: int, gamma: int) -> dict:
    """Bytes the static path allocates beyond the models: K/V caches, slot masks, and the largest per-forward mask."""
    caches = sum(layout.bytes(batch, capacity) for layout in layouts)
    masks = len(layouts) * batch * capacity * 8  # slot_mask, int64
    element = max(torch.empty((), dtype=layout.dtype).element_size() for layout in layouts)
    attention = batch * (gamma + 1) * capacity * (element + 2)  # the additive mask and its bool precursor
    return {"kv_caches": caches, "slot_masks": masks, "attention_mask": attention, "total": caches + masks + attention}
