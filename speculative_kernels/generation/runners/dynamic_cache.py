"""HF's dynamic KV cache as the runners use it: every slot kept (``RollbackCache``), the tail cut by a view
(``crop_cache``; transformers' own ``crop`` changed meaning across 5.x), the rows of two batches joined
(``append_cache_rows``: requests joining a running batch)."""

import dataclasses

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


@dataclasses.dataclass(frozen=True)
class CachedPrefix:
    """The KV of the prompt's first P tokens, as the target's runner starts from it.

    layers: one entry per layer of the target's ``RollbackCache``: (keys, values) [B, H, P, D] (the caller's tensors,
    where the caller's cache holds them, not copied yet: the runner copies them), or None for a layer with no cache
    of its own; real: [B, P] bool, the attention mask's first P columns (False at a left pad)."""

    layers: tuple
    real: torch.Tensor

    @property
    def length(self) -> int:
        return self.real.shape[1]


class RollbackCache(DynamicCache):
    """HF's ``DynamicCache(config=...)`` with every sliding-window layer replaced by a full ``DynamicLayer``.

    A sliding-window layer evicts keys older than its window, and a rollback could not bring back what a rejected
    draft pushed out; keeping every slot lets a rollback cut the tail as for full attention, while the window itself
    is applied by the runner's masks (``masks.window_mask``). Memory grows as for full attention. Other layer kinds
    (cache-less layers of MoE-only or KV-sharing models) stay as HF builds them; ``capabilities.check_model`` refuses
    the kinds a rollback cannot handle before this is built.

    prefix: per layer, (keys, values) [B, H, P, D] of the prompt's first P tokens to start from (copied: the caller's
    tensors are never written), or None for a layer that holds nothing (``CachedPrefix.layers``, checked against these
    layers).
    """

    def __init__(self, config, prefix: tuple | None = None):
        super().__init__(config=config)
        self.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                       for layer in self.layers]
        for layer, kv in zip(self.layers, prefix or ()):
            if kv is not None:
                layer.update(*kv)  # (its first update concatenates onto an empty tensor: a copy)


def crop_cache(cache, num_slots: int) -> None:
    """Keep the first ``num_slots`` positions of every layer of a dynamic cache (views, no copy)."""
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"crop_cache expects a DynamicCache, got {type(cache).__name__}")
    for layer in cache.layers:
        kind = type(layer).__name__
        if kind == "DummyLayer":  # no cache of its own (MoE-only layer, KV-sharing consumer)
            continue
        if kind != "DynamicLayer":
            raise ValueError(
                f"cannot roll back a cache layer of type {kind} (sliding-window or state-space layers drop the "
                "history a rollback needs); this architecture is not supported by speculative_kernels yet"
            )
        keys = getattr(layer, "keys", None)  # (set lazily by some transformers versions)
        if keys is None or keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., :num_slots, :]
        layer.values = layer.values[..., :num_slots, :]


def _kv(layer):
    """(keys, values) [B, H, S, D] of a filled dynamic layer, else None (a layer with no cache of its own, or one
    no forward has written)."""
    keys = getattr(layer, "keys", None)
    if type(layer).__name__ == "DummyLayer" or keys is None or keys.dim() != 4:
        return None
    return keys, layer.values


def cache_slots(cache, start: int, end: int) -> list:
    """Per layer of a runner's dynamic cache, (keys, values) [B, H, end - start, D] of its slots [start, end) (views),
    or None for a layer with no cache of its own (or none written)."""
    layers = [] if cache is None else cache.layers
    return [None if kv is None else (kv[0][:, :, start:end], kv[1][:, :, start:end]) for kv in map(_kv, layers)]


def _left_padded(tensor, rows: int, pad: int, like):
    """tensor [rows, H, S, D] (None: no slots) with ``pad`` zero slots prepended; ``like`` gives H, D, dtype, device."""
    if tensor is None:
        return like.new_zeros(rows, like.shape[1], pad, like.shape[3])
    if pad == 0:
        return tensor
    return torch.cat([tensor.new_zeros(rows, tensor.shape[1], pad, tensor.shape[3]), tensor], dim=2)


def append_cache_rows(cache, rows: int, pad: int, other, other_rows: int, other_pad: int):
    """The dynamic cache of ``cache``'s rows then ``other``'s (the rows of a second batch of the same model), each
    side's slots first padded on the left with ``pad`` / ``other_pad`` zero slots so both have as many (the caller
    masks those slots as holes). cache, other: ``RollbackCache`` or None (no forward yet: no slots). rows /
    other_rows: each side's B. Returns the merged cache (one of the two objects, its layers replaced one at a time,
    so the merge holds at most one layer's extra copy), or None when neither side has one."""
    if cache is None and other is None:
        return None
    base = cache if cache is not None else other
    firsts = cache.layers if cache is not None else [None] * len(other.layers)
    seconds = other.layers if other is not None else [None] * len(cache.layers)
    if len(firsts) != len(seconds):
        raise ValueError(f"cannot merge caches of {len(firsts)} and {len(seconds)} layers (not the same model)")
    for layer, first, second in zip(base.layers, firsts, seconds):
        a, b = _kv(first), _kv(second)
        if a is None and b is None:
            continue
        like = a if a is not None else b
        kv = [torch.cat([_left_padded(None if a is None else a[i], rows, pad, like[i]),
                         _left_padded(None if b is None else b[i], other_rows, other_pad, like[i])]) for i in (0, 1)]
        if _kv(layer) is None:  # only the other side had written this layer: take its dtype and device
            layer.dtype, layer.device, layer.is_initialized = kv[0].dtype, kv[0].device, True
        layer.keys, layer.values = kv
    return base
