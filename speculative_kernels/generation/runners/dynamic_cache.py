"""HF's dynamic KV cache as the runners use it: every slot kept (``RollbackCache``), the tail cut by a view
(``crop_cache``; transformers' own ``crop`` changed meaning across 5.x)."""

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class RollbackCache(DynamicCache):
    """HF's ``DynamicCache(config=...)`` with every sliding-window layer replaced by a full ``DynamicLayer``.

    A sliding-window layer evicts keys older than its window, and a rollback could not bring back what a rejected
    draft pushed out; keeping every slot lets a rollback cut the tail as for full attention, while the window itself
    is applied by the runner's masks (``masks.window_mask``). Memory grows as for full attention. Other layer kinds
    (cache-less layers of MoE-only or KV-sharing models) stay as HF builds them; ``capabilities.check_model`` refuses
    the kinds a rollback cannot handle before this is built.
    """

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                       for layer in self.layers]


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
