"""The static cache's per-layer layouts (``CacheLayout.layers``): layers without a cache of their own anywhere in the
stack, layers of their own sizes, and which multi-head latent attention forwards cache their latents. Mutants of
``slot_cache.py`` / ``capabilities.py`` that the end-to-end tests (test_architectures.py) let through: there the
cacheless layers come last and the per-layer sizes weigh the same bytes, so tokens cannot tell."""

import pytest
import torch
from torch import nn

from speculative_kernels.generation import capabilities
from speculative_kernels.generation.capabilities import check_model
from speculative_kernels.generation.runners.sizing import static_memory_bytes
from speculative_kernels.generation.runners.slot_cache import CacheLayout, SlotCache, SlotCacheLayer


def _dummy_layer_class():
    cache_utils = pytest.importorskip("transformers.cache_utils")
    if not hasattr(cache_utils, "DummyLayer"):
        pytest.skip("this transformers has no DummyLayer (it arrived in 5.23: 5.17-5.22 give no layer type "
                    "without a cache)")
    return cache_utils.DummyLayer


def test_layers_without_a_cache_anywhere_keep_their_index():
    """A layout with cacheless layers first and between (HF's "moe"/"mlp" layers become dummy layers wherever they
    are): layer i of the cache is layer i of the model, a DummyLayer or a SlotCacheLayer of layer i's sizes, and
    use_rows, select_rows, tensors and the byte count follow the layers with buffers."""
    dummy = _dummy_layer_class()
    layout = CacheLayout("TinyForCausalLM", (None, (1, 16, 8), None, (2, 4, 4)), torch.float32)
    cache = SlotCache(layout, 3, 10, torch.device("cpu"), rows=4)
    assert [type(layer) for layer in cache.layers] == [dummy, SlotCacheLayer, dummy, SlotCacheLayer]
    assert [tuple(t.shape) for t in cache.buffers()] == [(4, 1, 10, 16), (4, 1, 10, 8), (4, 2, 10, 4), (4, 2, 10, 4)]
    assert [tuple(t.shape) for t in cache.tensors()] == [(3, 1, 10, 16), (3, 1, 10, 8), (3, 2, 10, 4), (3, 2, 10, 4)]
    assert layout.bytes(4, 10) == sum(t.numel() * t.element_size() for t in cache.buffers()) == 4 * 10 * 40 * 4
    keys, values = torch.randn(3, 2, 2, 4), torch.randn(3, 2, 2, 4)
    got = cache.update(keys, values, 3)
    assert torch.equal(got[0][:, :, :2], keys) and torch.equal(got[1][:, :, :2], values)
    cache.use_rows(2)
    assert cache.layers[3].keys.shape == (2, 2, 10, 4) and cache.layers[1].values.shape == (2, 1, 10, 8)
    assert cache.layers[3].keys.data_ptr() == cache.buffers()[2].data_ptr()
    cache.use_rows(3)
    cache.select_rows(torch.tensor([2, 0]))
    assert torch.equal(cache.tensors()[2][:, :, :2], keys[[2, 0]])
    assert [tuple(t.shape) for t in cache.tensors()] == [(2, 1, 10, 16), (2, 1, 10, 8), (2, 2, 10, 4), (2, 2, 10, 4)]


def _gemma4_layers_of_their_own_sizes():
    """Gemma 4 text: sliding layers of 2 K/V heads of 8, global layers of 1 head of 32 (attention_k_eq_v), the last
    two layers reusing the earlier layers' K/V (dummy cache layers in transformers 5.24)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    kinds = ["sliding_attention", "full_attention"] * 2
    config = transformers.Gemma4TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=4, head_dim=8, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        num_kv_shared_layers=2, hidden_size_per_layer_input=4, vocab_size_per_layer_input=97, sliding_window=6,
        layer_types=kinds, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.Gemma4ForCausalLM(config).eval()


def test_shared_and_own_size_layers_are_sized_and_counted_per_layer():
    """ModelSpec.kv_sizes gives each layer its own (heads, D_k, D_v) and None for a KV-sharing consumer (no buffers
    for it), and the memory estimate sums the layers as allocated (the two kinds of layer weigh 32 and 64 values a
    slot: a per-model size, or buffers for the sharing layers, would be off)."""
    _dummy_layer_class()
    model = _gemma4_layers_of_their_own_sizes()
    spec = check_model(model, path="static", batch=2)
    assert spec.kv_sizes == ((2, 8, 8), (1, 32, 32), None, None)
    layout = CacheLayout.of(model, spec)
    cache = SlotCache(layout, 2, 12, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for t in cache.buffers())
    assert static_memory_bytes([layout], [spec], 2, 12, queries=4)["kv_caches"] == allocated == 2 * 12 * 96 * 4


def test_layers_without_a_cache_are_refused_by_name_where_transformers_has_no_dummy_layer(monkeypatch):
    """A transformers without DummyLayer (5.17) and a layout with layers that have no cache of their own: the static
    path refuses by name up front (it raised ImportError while allocating), the dynamic path still runs."""
    _dummy_layer_class()
    model = _gemma4_layers_of_their_own_sizes()
    import transformers.cache_utils

    monkeypatch.delattr(transformers.cache_utils, "DummyLayer")
    with pytest.raises(ValueError, match=r"cache_implementation='static'.*no cache of their own.*has no cache layer"):
        check_model(model, path="static", batch=2)
    check_model(model, path="dynamic", batch=2)


class _Cache:
    def update(self, keys, values, layer):
        return keys, values


class _LatentAttention(nn.Module):
    """A multi-head latent attention module as ``capabilities._latent_attention`` finds one."""

    def __init__(self):
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(4, 4)

    def expand_kv(self, latent, rotated):
        return latent, rotated


class _CachesLatents(_LatentAttention):
    def forward(self, latent, rotated, cache):
        latent, rotated = cache.update(latent, rotated, 0)
        return self.expand_kv(latent, rotated)


class _CachesExpanded(_LatentAttention):
    def forward(self, latent, rotated, cache):
        keys, values = self.expand_kv(latent, rotated)
        return cache.update(keys, values, 0)


class _NeverExpands(_LatentAttention):
    def forward(self, latent, rotated, cache):
        return cache.update(latent, rotated, 0)


@pytest.mark.parametrize("attention,caches", [(_CachesLatents, True), (_CachesExpanded, False),
                                              (_NeverExpands, False), (nn.Identity, False)])
def test_latents_are_cached_only_where_the_update_precedes_expand_kv(attention, caches):
    """``_caches_latents`` reads the MLA forward's source: the cache's update before self.expand_kv caches the latents
    (sized from kv_lora_rank / qk_rope_head_dim); expanded K/V cached after expand_kv, or no expand_kv at all, is
    not that layout (refused on the static cache); a model without an MLA module caches no latents."""
    assert capabilities._caches_latents(nn.Sequential(attention())) is caches
