"""Version-independent operations on HF KV caches (transformers' own ``crop`` changed meaning across 5.x)."""

from transformers import DynamicCache


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: it has no per-layer storage to roll back")
    return layers


def crop_cache(cache, num_slots: int) -> None:
    """Keep the first ``num_slots`` positions of every layer of a dynamic cache (views, no copy)."""
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"crop_cache expects a DynamicCache, got {type(cache).__name__}")
    for layer in _layers(cache):
        kind = type(layer).__name__
        if kind == "DummyLayer":  # no cache of its own (MoE-only layer, KV-sharing consumer)
            continue
        if kind != "DynamicLayer":
            raise ValueError(
                f"cannot roll back a cache layer of type {kind} (sliding-window or state-space layers drop the "
                "history a rollback needs); this architecture is not supported by speculative_kernels yet"
            )
        keys = getattr(layer, "keys", None)
        if keys is None or keys.numel() == 0:
            continue
        layer.keys = layer.keys[..., :num_slots, :]
        layer.values = layer.values[..., :num_slots, :]
