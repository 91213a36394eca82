"""``SlotCache``: a preallocated KV cache written at a write pointer, which a rollback moves back (no K/V copy).

Why not HF's ``StaticCache``: in transformers 5.x (5.17 to 5.23 alike) every ``StaticLayer`` keeps its own
``cumulative_length``, so rolling it back would be one scalar write per layer and model; here all layers share one
pointer. It also allocates eagerly (the memory check runs first) and checks every write's shape, so a K/V layout the
config does not describe fails with the architecture's name (``docs/batching.md``).
"""

import contextlib
import dataclasses

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..capabilities import ModelSpec
from .masks import attention_dtype


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """What one model's static cache holds: per layer, K [B, H_kv, C, D_k] and V [B, H_kv, C, D_v], with
    ``layers[i]`` = (H_kv, D_k, D_v) of layer i (the head sizes differ where multi-head latent attention caches its
    two latents, the layers where a heterogeneous config sizes each layer), or None for a layer without a cache of
    its own (a KV-sharing consumer: HF's ``DummyLayer``, no buffers)."""

    architecture: str
    layers: tuple[tuple[int, int, int] | None, ...]
    dtype: torch.dtype

    @staticmethod
    def of(model, spec: ModelSpec) -> "CacheLayout":
        """The layout of ``model``'s static cache, from its static-path spec (``capabilities.check_model``)."""
        device = next(model.parameters()).device
        return CacheLayout(spec.architecture, tuple(spec.kv_sizes), _buffer_dtype(attention_dtype(model), device))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def shapes(self, rows: int, capacity: int) -> list[tuple[tuple[int, ...], tuple[int, ...]] | None]:
        """The shapes of each layer's K and V buffers, [rows, H_kv, C, D_k] and [rows, H_kv, C, D_v] (None: no
        cache of its own)."""
        return [None if sizes is None else ((rows, sizes[0], capacity, sizes[1]), (rows, sizes[0], capacity, sizes[2]))
                for sizes in self.layers]

    def bytes(self, batch: int, capacity: int) -> int:
        """K and V of every layer: the sum of B * H_kv * C * (D_k + D_v) * element size."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return sum(batch * heads * capacity * (key_dim + value_dim) * element
                   for heads, key_dim, value_dim in filter(None, self.layers))


def _buffer_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The K/V buffers' dtype: the model's, or float32 for a half-precision model run under ``torch.autocast`` to
    the other half type (a float16 model under CPU autocast's bfloat16): its keys come out of the rotary embedding
    in float32 and its values in the autocast dtype, which HF's static cache keeps as given and the model's dtype
    holds neither; float32 holds both exactly, and the attention's autocast casts them as HF's hands them over."""
    device = device.type
    if (dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(device)
            and torch.get_autocast_dtype(device) != dtype):
        return torch.float32
    return dtype


def _autocast_states(states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V states in the buffers' ``dtype``, where ``torch.autocast`` made them in its lower precision (a linear
    under autocast returns bfloat16/float16; rotary embeddings return float32 keys beside those values): stored
    upcast, which is exact, and cast back by the attention's autocast exactly as HF's cache hands them over
    (HF's static cache allocates each in the dtype it first gets). Other dtypes are left for the check to refuse."""
    if states.dtype == dtype or not states.is_floating_point() or not dtype.is_floating_point:
        return states
    device = states.device.type
    if (torch.is_autocast_enabled(device) and states.dtype == torch.get_autocast_dtype(device)
            and torch.finfo(dtype).bits > torch.finfo(states.dtype).bits):
        return states.to(dtype)
    return states


class SlotCacheLayer(CacheLayerMixin):
    """One layer's preallocated K [B, H_kv, C, D_k] and V [B, H_kv, C, D_v], written at the cache's write pointer: ``position`` is a 0-dim
    tensor (one pointer shared by every row) or [B] (a pointer per row: row b writes at position[b] + [0, T)).
    ``read_to`` (host int, or None: all C slots): the slots [0, read_to) that ``update`` hands the attention and
    ``get_mask_sizes`` reports, set for one eager forward by ``SlotCache.reading``."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, architecture: str):
        super().__init__()
        self.keys, self.values, self.position = keys, values, position
        self.max_cache_len = keys.shape[2]
        self.architecture = architecture
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device
        self.read_to: int | None = None

    def lazy_initialization(self, key_states, value_states) -> None:
        raise AssertionError("SlotCacheLayer is allocated eagerly")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key_states [B, H_kv, T, D_k] and value_states [B, H_kv, T, D_v] at slots position + [0, T); return
        the buffers' slots [0, read_to) ([B, H_kv, read_to, D_k] and [.., D_v] views; all C slots where read_to is
        None)."""
        steps = key_states.shape[2]
        expected = [(*buffer.shape[:2], steps, buffer.shape[3]) for buffer in (self.keys, self.values)]
        key_states, value_states = _autocast_states(key_states, self.dtype), _autocast_states(value_states, self.dtype)
        got = [tuple(key_states.shape), tuple(value_states.shape)]
        if got != expected or key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise ValueError(
                f"{self.architecture}: the static cache expected keys and values of shapes {expected[0]}, "
                f"{expected[1]} and dtype {self.dtype}, got {got[0]} {key_states.dtype}, {got[1]} "
                f"{value_states.dtype}; this K/V layout is not supported, use the dynamic cache"
            )
        steps = torch.arange(steps, device=self.device)
        if self.position.dim() == 0:
            slots = self.position + steps
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
        else:
            slots = (self.position.unsqueeze(1) + steps).view(key_states.shape[0], 1, -1, 1)  # [B, 1, T, 1]
            self.keys.scatter_(2, slots.expand_as(key_states), key_states)  # (expand_as: D_k and D_v alike)
            self.values.scatter_(2, slots.expand_as(value_states), value_states)
        if self.read_to is not None:
            return self.keys[:, :, : self.read_to], self.values[:, :, : self.read_to]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(key length, key offset) of the attention: the slots ``update`` hands it, from slot 0."""
        return (self.max_cache_len if self.read_to is None else self.read_to), 0

    def get_seq_length(self):
        """The write pointer; with a pointer per row, the shortest row's (HF wants one length; a per-row runner gives
        the model its positions itself)."""
        return self.position if self.position.dim() == 0 else self.position.amin()

    def get_max_length(self) -> int:
        return self.max_cache_len


def _dummy_layer():
    """HF's layer for a layer without a cache of its own (transformers 5.24 makes KV-sharing consumers such layers;
    5.17 has none, and gives them ordinary layers that they never write)."""
    from transformers.cache_utils import DummyLayer

    return DummyLayer()


class SlotCache(Cache):
    """Preallocated K/V for every layer of one model, with one write pointer shared by all layers.

    batch: B; capacity: C slots; rows: rows allocated (default B; more for a batch that rows join in place, whose
    layers then use the first B rows of the buffers, ``use_rows``). ``position`` is an int64 device tensor (a static
    address, so captured graphs read it at replay time): 0-dim, or [B] with ``per_row`` (``point_at`` replaces it).
    """

    def __init__(self, layout: CacheLayout, batch: int, capacity: int, device: torch.device, *,
                 per_row: bool = False, rows: int | None = None):
        self.position = torch.zeros(batch if per_row else (), dtype=torch.int64, device=device)
        shapes = layout.shapes(batch if rows is None else rows, capacity)
        self._buffers = [(torch.zeros(key_shape, dtype=layout.dtype, device=device),
                          torch.zeros(value_shape, dtype=layout.dtype, device=device))
                         for key_shape, value_shape in filter(None, shapes)]
        self._slot_layers = [SlotCacheLayer(keys[:batch], values[:batch], self.position, layout.architecture)
                             for keys, values in self._buffers]  # the layers with buffers, in order
        slot_layers = iter(self._slot_layers)
        super().__init__(layers=[_dummy_layer() if shape is None else next(slot_layers) for shape in shapes])
        self.capacity = capacity
        self._row_views = {batch: [(layer.keys, layer.values) for layer in self._slot_layers]}  # B -> views

    @contextlib.contextmanager
    def reading(self, end: int):
        """A context for one eager forward that writes slots below ``end`` (host int) and attends to nothing past
        it: every layer hands its attention K/V slots [0, end) only, and reports that key length to the model's mask
        code, so the attention costs what it would over a cache of ``end`` slots (the forward's mask, if it passes
        one, spans ``end`` keys). Not for captured steps, whose shapes stay [.., C, ..]; one write pointer only."""
        if self.position.dim() != 0 or not 0 < end <= self.capacity:
            raise ValueError(f"reading({end}) needs one write pointer and 0 < end <= {self.capacity}")
        for layer in self._slot_layers:
            layer.read_to = end
        try:
            yield
        finally:
            for layer in self._slot_layers:
                layer.read_to = None

    def tensors(self) -> list[torch.Tensor]:
        """Every K and V buffer [B, H_kv, C, D_k or D_v] (the rows in use)."""
        return [t for layer in self._slot_layers for t in (layer.keys, layer.values)]

    def buffers(self) -> list[torch.Tensor]:
        """Every K and V buffer as allocated, [rows, H_kv, C, D_k or D_v]."""
        return [t for pair in self._buffers for t in pair]

    def use_rows(self, batch: int) -> None:
        """The layers use the first ``batch`` rows of the allocated buffers (views: no copy; made once per batch
        size and reused)."""
        views = self._row_views.get(batch)
        if views is None:
            views = self._row_views[batch] = [(keys[:batch], values[:batch]) for keys, values in self._buffers]
        for layer, (keys, values) in zip(self._slot_layers, views):
            layer.keys, layer.values = keys, values

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of the K/V buffers (a copy into smaller buffers; a per-row pointer is the
        caller's to select and ``point_at``)."""
        for layer in self._slot_layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self._buffers = [(layer.keys, layer.values) for layer in self._slot_layers]
        self._row_views = {index.shape[0]: list(self._buffers)}

    def point_at(self, position: torch.Tensor) -> None:
        """Use ``position`` [B] as every layer's per-row write pointer (after rows were selected)."""
        self.position = position
        for layer in self._slot_layers:
            layer.position = position
