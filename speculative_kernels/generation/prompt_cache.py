"""A cache of the prompt's first tokens (HF's "re-use a prompt cache" recipe: ``prompt_cache = DynamicCache();
model(prefix_ids, past_key_values=prompt_cache)``, then ``generate(full_ids, past_key_values=prompt_cache)``; the
argument is named ``cache`` from transformers 5.24).

``model.generate`` forwards only the prompt's tokens past the cache (``GenerationMixin._prefill``), at the positions
the whole prompt's attention mask gives them, and attends to the cached keys as the mask's first P columns say. The
target's runner does the same: it starts from a copy of the cached keys and values (``DecoderRunner``'s ``prefix``),
with the mask's first P columns as its first P slots, and the loop prefills the rest. The draft has no such cache:
it prefills the whole prompt. The runner writes to its own copy, which it rolls back; when the call returns, the
caller's cache is extended as ``model.generate`` extends it in place (``extend_caller_cache``: at batch 1; at batch > 1
it is left as it was, with a warning), so HF's multi-turn recipe (one cache passed to every turn) goes on as in HF.

Supported: a ``DynamicCache`` (its full-attention layers, and sliding-window layers that have dropped nothing yet),
one row per prompt row, fewer tokens than the prompt, on the dynamic-cache path of a decoder-only model. Everything
else is refused by name before anything runs (``check_prompt_cache``).
"""

import warnings

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .runners.dynamic_cache import CachedPrefix, RollbackCache, cache_slots

# The generate keywords of a cache of the prompt's first tokens: transformers 5.24 names it cache (before:
# past_key_values, which 5.24 still takes, deprecated)
PROMPT_CACHE_ARGUMENTS = ("past_key_values", "cache")


def take_prompt_cache(kwargs: dict) -> tuple[str, object] | None:
    """Pop the cache keywords from a call's kwargs: (the keyword, the object), or None when none was given. Raises
    ValueError when both names are given."""
    given = [(name, kwargs.pop(name)) for name in PROMPT_CACHE_ARGUMENTS if kwargs.get(name) is not None]
    for name in PROMPT_CACHE_ARGUMENTS:
        kwargs.pop(name, None)
    if len(given) > 1:
        raise ValueError("pass either past_key_values or cache (transformers 5.24's name for it), not both")
    return given[0] if given else None


def check_prompt_path(name: str, *, encoder_decoder: bool, cache_implementation, compiled: bool,
                      rows: bool) -> None:
    """ValueError naming ``name`` where a prompt cache cannot be used: an encoder-decoder model, a
    cache_implementation (HF refuses it beside a cache too), compile=True (the static cache), a batch of separate
    requests (rows: they join one batch, each prefilled on its own)."""
    if encoder_decoder:
        raise ValueError(f"{name} is not supported for encoder-decoder models (an EncoderDecoderCache of the decoder "
                         "prompt's first tokens): pass the whole decoder prompt without it (the output is the same, "
                         "its prefill is not skipped)")
    if cache_implementation is not None:
        raise ValueError(f"{name} and cache_implementation={cache_implementation!r} cannot be combined "
                         "(model.generate refuses both together too; with a generation_config.json that sets "
                         "cache_implementation, pass cache_implementation=None)")
    if compiled:
        raise ValueError(f"{name} is not supported with compile=True: the compiled steps run on the static cache, "
                         "which does not start from a cache of the prompt's first tokens; use compile=False")
    if rows:
        raise ValueError(f"{name} is not supported for a batch of separate requests (continuous batching): pass it "
                         "to speculative_kernels.generate or SpeculativeDecoder.start")


def check_prompt_cache(name: str, cache, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       num_return_sequences: int = 1) -> CachedPrefix | None:
    """The ``CachedPrefix`` of ``cache`` (the call's ``name`` argument) for prompts input_ids [B, L] with
    attention_mask [B, L], or None when it holds no token (then model.generate prefills the whole prompt, as
    without it). ValueError, naming ``name``, for a cache that is not a ``DynamicCache``, whose layers do not match
    the model's, whose batch differs from B, or that holds L tokens or more (at least the prompt's last token must
    be forwarded, for the first new token's logits)."""
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"{name} must be a transformers DynamicCache holding the prompt's first tokens (HF's "
                         f"prompt-cache recipe), got {type(cache).__name__}: other caches (static, quantized, "
                         "encoder-decoder, ...) are not supported")
    if getattr(cache, "offloading", False):
        raise ValueError(f"{name} is an offloaded DynamicCache (offloading=True), which is not supported: pass one "
                         "whose layers are on the model's devices")
    ours = RollbackCache(model.config).layers  # the layers the target's runner uses (no tensors yet)
    if cache.layers and len(cache.layers) != len(ours):  # (an empty one too: it is extended after the call)
        raise ValueError(f"{name} holds {len(cache.layers)} layers and the model ({type(model).__name__}) has "
                         f"{len(ours)}: it is not a cache of this model")
    if not any(_filled(layer) for layer in cache.layers):
        return None
    layers = tuple(_layer_kv(name, i, theirs, mine) for i, (theirs, mine) in enumerate(zip(cache.layers, ours)))
    _check_extent(name, [kv[0] for kv in layers if kv is not None], input_ids.shape, num_return_sequences)
    return CachedPrefix(layers, attention_mask[:, : _prefix_length(layers)].to(torch.bool))


def _prefix_length(layers) -> int:
    """P: the tokens held by ``CachedPrefix.layers`` (checked alike by ``_check_extent``)."""
    return next(kv[0].shape[-2] for kv in layers if kv is not None)


def _check_extent(name: str, keys: list[torch.Tensor], prompt_shape, num_return_sequences: int) -> None:
    """ValueError unless every layer's keys [B, H, P, D] hold the same P < L tokens for the prompts' B rows
    (prompt_shape: (B, L))."""
    batch, width = prompt_shape
    lengths, rows = {k.shape[-2] for k in keys}, {k.shape[0] for k in keys}
    if len(lengths) > 1:
        raise ValueError(f"{name}'s layers hold different numbers of tokens ({sorted(lengths)}): not the cache of one "
                         "forward over the prompt's first tokens")
    length = lengths.pop()
    if length >= width:
        raise ValueError(f"{name} holds {length} tokens and the prompt (input_ids) has {width}: the cache must hold "
                         "fewer tokens than the prompt (its first ones; the rest, at least the last token, are "
                         "forwarded for the first new token's logits)")
    if rows != {batch}:
        more = (f" (num_return_sequences={num_return_sequences} repeats each prompt; model.generate does not "
                "repeat the cache, and fails)" if num_return_sequences > 1 else "")
        raise ValueError(f"{name} holds {sorted(rows)} rows and the prompts are {batch}{more}: the cache needs one "
                         "row per prompt row")


def _filled(layer) -> bool:
    """Whether a cache layer holds keys."""
    keys = getattr(layer, "keys", None)
    return isinstance(keys, torch.Tensor) and keys.numel() > 0


def _layer_kv(name: str, index: int, theirs, mine) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer ``index`` of the caller's cache (which holds tokens) as (keys, values) [B, H, P, D] for the runner's
    layer ``mine``, or None for a layer with no cache of its own."""
    keys, filled = getattr(theirs, "keys", None), _filled(theirs)
    if type(mine) is not DynamicLayer:  # (a layer without a cache of its own: DummyLayer)
        if filled:
            raise ValueError(f"{name}'s layer {index} holds keys where the model's layer {index} keeps no cache: "
                             "not a cache of this model")
        return None
    if type(theirs) not in (DynamicLayer, DynamicSlidingWindowLayer):
        raise ValueError(f"{name}'s layer {index} is a {type(theirs).__name__}; only full-attention and "
                         "sliding-window DynamicCache layers are supported")
    if not filled:
        raise ValueError(f"{name}'s layer {index} holds no tokens where other layers do: not the cache of one "
                         "forward over the prompt's first tokens")
    if keys.dim() != 4:
        raise ValueError(f"{name}'s layer {index} holds keys of shape {tuple(keys.shape)}, not [B, H, P, D]")
    if isinstance(theirs, DynamicSlidingWindowLayer) and theirs.get_seq_length() != keys.shape[-2]:
        raise ValueError(f"{name}'s layer {index} is a sliding-window layer that has dropped its oldest tokens (it "
                         f"keeps {keys.shape[-2]} of {theirs.get_seq_length()}): speculative decoding needs every "
                         "cached token (its rollbacks); build the cache over a prefix shorter than the window, or "
                         "pass the whole prompt without it")
    return keys, theirs.values


def extend_caller_cache(name: str, cache: DynamicCache, runner_cache, batch: int, cached: int, end: int,
                        stacklevel: int = 2) -> bool:
    """After a call that returned: extend the caller's ``cache`` (the call's ``name`` argument, holding the prompt's
    first ``cached`` tokens) as model.generate leaves it, holding the K/V of the prompt and of every generated token
    but the last: slots [0, end), end = L + n - 1. Returns whether it was extended.

    At batch 1 the target's runner (``runner_cache``, its ``RollbackCache``) holds them as model.generate does, one
    slot per token from the sequence's start (the prompt's pads included; its rollbacks cut, leaving no holes): its
    slots [cached, end) are appended through each layer's own ``update`` (a sliding-window layer keeps its last
    window - 1 tokens, as HF's); slots past end (drafts verified past the last token) are never written. At batch > 1
    HF's cache also holds the K/V of the pad tokens it feeds rows that finished early, which we never compute: the
    cache is left as it was, and a UserWarning says so (``stacklevel``: the caller's frame, as ``warnings.warn``'s)."""
    if batch > 1:
        warnings.warn(f"{name} was not extended: model.generate extends the cache passed to it in place (with the K/V "
                      "of the prompts and of the generated tokens, and of the pad tokens it feeds rows that finished "
                      f"early), speculative_kernels at batch 1 only: this batch of {batch} rows left it as it was "
                      "before the call", UserWarning, stacklevel=stacklevel + 1)
        return False
    slots = cache_slots(runner_cache, cached, end)
    if any(kv is not None and kv[0].shape[-2] != end - cached for kv in slots):  # (before any layer is written)
        raise RuntimeError(f"the target's cache holds fewer than the {end} tokens {name} is to be extended to "
                           "(an internal error: please report it)")
    for index, kv in enumerate(slots):
        if kv is not None:  # (a layer with no cache of its own: HF's forwards do not update it either)
            cache.update(*kv, index)
    return True
