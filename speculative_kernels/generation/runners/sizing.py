"""How many slots the static caches need, and how many bytes the static path allocates (checked before
allocating: ``memory.check_free_memory``)."""

import math

import torch

from ..capabilities import ModelSpec
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


def mask_entry_bytes(spec: ModelSpec, element: int) -> int:
    """Bytes per (row, query, key slot) of one forward's transient attention masks (``masks.decoder_mask``, or the
    seq2seq decoder's): the bool of allowed slots and the additive mask (``element`` bytes), plus one for the
    [T, S] causal bool (at most one row's worth); with a sliding window also the window's bool and the conjunction,
    and with both layer kinds a second additive mask. "2d" models get the slot mask itself (nothing more)."""
    if spec.mask == "2d":
        return 0
    if spec.sliding_window is None:
        return element + 2
    return 4 + element * (2 if spec.mask == "4d-by-layer-type" else 1)


def static_memory_bytes(layouts: list[CacheLayout], specs: list[ModelSpec], batch: int, capacity: int,
                        queries: int) -> dict:
    """Bytes the static path allocates beyond the models: K/V caches, slot masks (and the additive mirror of models
    that take a plain 4-D mask, ``SlotMask._init_additive``), and the largest forward's transient masks.
    queries: the most query tokens of one forward, max(gamma + 1, the prefill's prompt width): a bound on the
    prefill's masks, [B, 1, P, C] at most, which for long prompts outweigh the K/V (they grow as P * C). (An eager
    forward's masks span the slots written so far, ``SlotCache.reading``, and an unpadded prompt's first forward
    passes none; '2d'-mask models get the [B, C] slot mask: the bound is kept for all.)"""
    caches = sum(layout.bytes(batch, capacity) for layout in layouts)
    masks = 0
    attention = 0
    for layout, spec in zip(layouts, specs):
        element = torch.empty((), dtype=layout.dtype).element_size()
        mirror = element if spec.mask == "4d" and spec.sliding_window is None and not spec.encoder_decoder else 0
        masks += batch * capacity * (8 + mirror)  # slot_mask (int64) and the mirror
        attention = max(attention, batch * queries * capacity * mask_entry_bytes(spec, element))
    return {"kv_caches": caches, "slot_masks": masks, "attention_mask": attention, "total": caches + masks + attention}
