"""A preallocated KV cache with a write pointer, and the runner that drives an HF decoder-only model over it.

Why our own ``Cache`` subclass rather than HF's ``StaticCache``: in transformers 5.x (5.17 to 5.23 alike) every
``StaticLayer`` keeps its own ``cumulative_length`` tensor and writes at ``cumulative_length + arange(T)``. It could be
rolled back by refilling that counter in every layer (2 x num_layers scalar writes per iteration, one kernel launch
each); ``SlotCache`` instead shares one write pointer between all layers, so a rollback of both models is two scalar
writes. It also allocates eagerly, so the memory check (``check_free_memory``, ``docs/batching.md``) runs before
anything is allocated, and checks every write's shape (an architecture whose K/V layout the config does not describe
is refused with its name instead of silently misbehaving).

Slots. As in ``runner.py``, every row writes the same slots at each forward; ``slot_mask`` [B, C] marks which are
real (1) and which are holes (0: left padding, rejected drafts, filler). The model gets an explicit 4-D additive mask
over all C slots (causal over slot indices, AND the slot mask) and per-row position ids over real slots, so a row
with holes computes exactly what it would compute without them, and HF never reads the mask on the host.

Rollback is O(1): the rejected slots of a row become holes (a mask write) and the write pointer moves back to the
first slot nobody needs (a scalar write; the stale K/V there is masked and overwritten later). No K/V is copied.

The forward is written with device-side indices only (write pointer, positions, mask), so one captured graph per
input width serves every step: ``compile_steps`` wraps it in ``torch.compile`` (CUDA graphs with
``mode="reduce-overhead"``). Compaction of holes and dropping of finished rows live in ``compaction.py``.
"""

import dataclasses
import functools
import inspect
import math
import time

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .capabilities import check_model
from .compaction import SlotCompactor
from .memory import check_free_memory  # noqa: F401 (also imported from here by seq2seq_static and tests)
from .runner import DecoderRunner, hole_rejected_slots, window_mask

SUPPORTED_ATTENTION = ("sdpa", "eager")


class CacheLayout:
    """What one model's static cache holds: per-layer (kv_heads, head_dim), the dtype, and its byte size.

    sizes: (num_layers, kv_heads, head_dim) when the caller knows them better than the config (an encoder-decoder's
    decoder, ``seq2seq_static.py``); None reads the decoder-only config.
    """

    def __init__(self, model, sizes: tuple[int, int, int] | None = None):
        self.architecture = type(model).__name__
        config = model.config.get_text_config(decoder=True)
        if sizes is not None:
            layers, kv_heads, head_dim = sizes
        else:
            heads = getattr(config, "num_attention_heads", None)
            hidden = getattr(config, "hidden_size", None)
            layers = getattr(config, "num_hidden_layers", None)
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)
        if not (layers and kv_heads and head_dim):
            raise ValueError(
                f"{self.architecture}: the static cache cannot size its K/V buffers from the config (num_hidden_layers"
                f"={layers}, num_key_value_heads={kv_heads}, head_dim={head_dim}); use the dynamic cache"
            )
        self.num_layers, self.kv_heads, self.head_dim = int(layers), int(kv_heads), int(head_dim)
        self.dtype = next(model.parameters()).dtype
        self.layer_types = list(getattr(config, "layer_types", None) or [])
        self.sliding_window = getattr(config, "sliding_window", None)

    def bytes(self, batch: int, capacity: int) -> int:
        """K and V of every layer: 2 * layers * B * H_kv * C * D * element size."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * batch * self.kv_heads * capacity * self.head_dim * element


def check_attention(model) -> None:
    """Raise ValueError naming the architecture unless ``model`` takes explicit 4-D masks (sdpa, eager)."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={attention!r}; the static cache passes explicit 4-D "
            f"masks, which only {SUPPORTED_ATTENTION} take; use the dynamic cache"
        )


def check_drivable(model, capacity: int, batch: int = 1, path: str = "static"):
    """The ``capabilities.ModelSpec`` of ``model`` on the static path, or ValueError naming the architecture (the one
    check every path shares, ``capabilities.py``), after checking that the config sizes the K/V buffers."""
    if model.config.is_encoder_decoder:
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; the decoder-only static runner cannot "
                         "drive it (seq2seq_static.py drives T5/MT5 and BART/mBART)")
    spec = check_model(model, path=path, batch=batch)
    CacheLayout(model)
    return spec


class SlotCacheLayer(CacheLayerMixin):
    """One layer's preallocated K/V [B, H_kv, C, D], written at the cache's write pointer: ``position`` is a 0-dim
    tensor (one pointer shared by every row) or [B] (a pointer per row: row b writes at position[b] + [0, T))."""

    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, architecture: str):
        super().__init__()
        self.keys, self.values, self.position = keys, values, position
        self.max_cache_len = keys.shape[2]
        self.architecture = architecture
        self.is_initialized = True
        self.dtype, self.device = keys.dtype, keys.device

    def lazy_initialization(self, key_states, value_states) -> None:
        raise AssertionError("SlotCacheLayer is allocated eagerly")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write key/value_states [B, H_kv, T, D] at slots position + [0, T); return the whole buffers."""
        expected = (self.keys.shape[0], self.keys.shape[1], key_states.shape[2], self.keys.shape[3])
        if tuple(key_states.shape) != expected or key_states.dtype != self.dtype:
            raise ValueError(
                f"{self.architecture}: the static cache expected keys of shape {expected} and dtype {self.dtype}, got "
                f"{tuple(key_states.shape)} {key_states.dtype}; this K/V layout is not supported, use the dynamic cache"
            )
        steps = torch.arange(key_states.shape[2], device=self.device)
        if self.position.dim() == 0:
            slots = self.position + steps
            self.keys.index_copy_(2, slots, key_states)
            self.values.index_copy_(2, slots, value_states)
        else:
            slots = (self.position.unsqueeze(1) + steps).view(key_states.shape[0], 1, -1, 1)  # [B, 1, T, 1]
            self.keys.scatter_(2, slots.expand_as(key_states), key_states)
            self.values.scatter_(2, slots.expand_as(value_states), value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self):
        """The write pointer; with a pointer per row, the shortest row's (HF wants one length; a per-row runner gives
        the model its positions itself)."""
        return self.position if self.position.dim() == 0 else self.position.amin()

    def get_max_length(self) -> int:
        return self.max_cache_len


class SlotCache(Cache):
    """Preallocated K/V for every layer of one model, with one write pointer shared by all layers.

    batch: B; capacity: C slots. ``position`` is an int64 device tensor (a static address, so captured graphs read it
    at replay time): 0-dim, or [B] with ``per_row`` (``point_at`` replaces it). layout: None reads the config.
    """

    def __init__(self, model, batch: int, capacity: int, device: torch.device, *, layout: CacheLayout | None = None,
                 per_row: bool = False):
        layout = layout or CacheLayout(model)
        self.position = torch.zeros(batch if per_row else (), dtype=torch.int64, device=device)
        shape = (batch, layout.kv_heads, capacity, layout.head_dim)
        layers = [
            SlotCacheLayer(torch.zeros(shape, dtype=layout.dtype, device=device),
                           torch.zeros(shape, dtype=layout.dtype, device=device), self.position, layout.architecture)
            for _ in range(layout.num_layers)
        ]
        super().__init__(layers=layers)
        self.capacity = capacity

    def tensors(self) -> list[torch.Tensor]:
        """Every K and V buffer [B, H_kv, C, D]."""
        return [t for layer in self.layers for t in (layer.keys, layer.values)]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of the K/V buffers (a copy into smaller buffers; a per-row pointer is the
        caller's to select and ``point_at``)."""
        for layer in self.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)

    def point_at(self, position: torch.Tensor) -> None:
        """Use ``position`` [B] as every layer's per-row write pointer (after rows were selected)."""
        self.position = position
        for layer in self.layers:
            layer.position = position


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed: [B, T, C] bool (query t may see slot c) -> the additive mask [B, 1, T, C] that HF takes as given."""
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, blocked).unsqueeze(1)


# Every captured step shares ``_step``'s code object, and dynamo keeps one cache per code object: each model, width
# and batch size is an entry. Raise the per-code limit (default 8), and fail instead of silently running eager past it.
_DYNAMO_LIMITS = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}


def _dynamo_limits():
    config = torch._dynamo.config
    return config.patch(**{k: v for k, v in _DYNAMO_LIMITS.items() if hasattr(config, k)})


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How ``generate(..., compile=...)`` captures the draft and verification steps.

    mode: ``torch.compile`` mode; None picks "reduce-overhead" (CUDA graphs) on CUDA and "default" elsewhere.
    backend: ``torch.compile`` backend ("inductor"; "aot_eager" traces without code generation, for debugging).
    """

    mode: str | None = None
    backend: str = "inductor"

    def torch_compile_kwargs(self, device: torch.device) -> dict:
        mode = self.mode or ("reduce-overhead" if device.type == "cuda" else "default")
        kwargs = {"backend": self.backend, "dynamic": False}
        if self.backend == "inductor":
            kwargs["mode"] = mode
        return kwargs


class StaticDecoderRunner:
    """``DecoderRunner``'s interface over a ``SlotCache``: forward(tokens, real, last_only), keep_prefix(...).

    model: an HF causal LM; batch: B; capacity: C cache slots (``static_capacity``); reserve: the most slots one
    iteration writes (gamma + 1), kept free by compacting early; compaction_threshold / compaction_backend: see
    ``compaction.BatchingOptions``.
    """

    def __init__(self, model, batch: int, capacity: int, device: torch.device, *, reserve: int = 0,
                 compaction_threshold: float = 0.25, compaction_backend: str = "auto"):
        self.spec = check_drivable(model, capacity, batch)
        self.model = model
        self.cache = SlotCache(model, batch, capacity, device)
        self.capacity, self.reserve = capacity, reserve
        self.slot_mask = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.num_slots = 0  # host copy of the write pointer
        self.compactor = SlotCompactor(batch, compaction_threshold, compaction_backend)
        self._logits_to_keep = _accepts(model, "logits_to_keep")
        self._dtype = next(model.parameters()).dtype
        self._compiled = {}  # (width, last_only) -> compiled step

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False):
        """Run tokens [B, T] at the next T slots; real [B, T] bool marks real tokens (None: all real).

        Returns logits [B, T, V] (or [B, 1, V] with last_only).
        """
        width = tokens.shape[1]
        if self.num_slots + width > self.capacity:
            raise RuntimeError(f"static cache exhausted ({self.num_slots + width} > {self.capacity} slots)")
        real_i = torch.ones_like(tokens) if real is None else real.to(torch.int64)
        compiled = self._compiled.get((width, last_only))
        if compiled is not None:
            torch.compiler.cudagraph_mark_step_begin()
            fresh = torch.contiguous_format  # fresh tensors: one inference mode and one stride per shape for the guards
            with _dynamo_limits():
                logits = compiled(tokens.clone(memory_format=fresh), real_i.clone(memory_format=fresh))
            logits = logits.clone()  # a captured graph's outputs are overwritten by its next replay
        else:
            logits = self._step(tokens, real_i, last_only)
        self.num_slots += width
        return logits

    def _step(self, tokens: torch.Tensor, real_i: torch.Tensor, last_only: bool) -> torch.Tensor:
        """The captured part: mask/position bookkeeping with device indices, the model forward, pointer advance."""
        width = tokens.shape[1]
        slots = self.cache.position + torch.arange(width, device=tokens.device)  # [T]
        self.slot_mask.index_copy_(1, slots, real_i)
        positions = (self.next_position.unsqueeze(1) + real_i.cumsum(dim=1) - 1).clamp(min=0)
        kwargs = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        out = self.model(
            input_ids=tokens,
            attention_mask=self._attention_mask(slots),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        self.next_position.add_(real_i.sum(dim=1))
        self.cache.position.add_(width)
        logits = out.logits
        return logits[:, -1:] if last_only else logits

    def _attention_mask(self, slots: torch.Tensor):
        """Additive [B, 1, T, C]: the query at slot q sees slot s iff s <= q and s is real in its row. Sliding-window
        layers also need s inside q's window (``runner.window_mask``); a model mixing full and sliding layers gets
        both masks in a dict keyed by layer type."""
        if self.spec.mask == "2d":  # ALiBi models build their bias and causal mask from the slot mask
            return self.slot_mask
        capacity = self.slot_mask.shape[1]
        causal = torch.arange(capacity, device=slots.device).unsqueeze(0) <= slots.unsqueeze(1)  # [T, C]
        allowed = causal.unsqueeze(0) & self.slot_mask.unsqueeze(1).bool()  # [B, T, C]
        if self.spec.sliding_window is None:
            return additive_mask(allowed, self._dtype)
        sliding = additive_mask(allowed & window_mask(self.slot_mask, slots, self.spec.sliding_window), self._dtype)
        if self.spec.mask == "4d-by-layer-type":
            return {"full_attention": additive_mask(allowed, self._dtype), "sliding_attention": sliding}
        return sliding

    # ------------------------------------------------------------------------------------------ compile
    def compile_steps(self, shapes, options: CompileOptions) -> None:
        """Capture ``_step`` for each (width, last_only) in ``shapes`` (other widths, e.g. the prefill, stay eager)."""
        kwargs = options.torch_compile_kwargs(self.slot_mask.device)
        for tensor in (self.slot_mask, self.next_position, self.cache.position, *self.cache.tensors()):
            torch._dynamo.mark_static_address(tensor)
        for width, last_only in shapes:
            self._compiled[(width, last_only)] = torch.compile(functools.partial(self._step, last_only=last_only),
                                                               **kwargs)

    def warm_up(self, calls: int = 3) -> None:
        """Run every captured step ``calls`` times on filler tokens and roll back (compiles; records CUDA graphs)."""
        start, positions = self.num_slots, self.next_position.clone()
        batch = self.slot_mask.shape[0]
        for width, last_only in self._compiled:
            tokens = torch.zeros(batch, width, dtype=torch.int64, device=self.slot_mask.device)
            for _ in range(calls):
                self.forward(tokens, None, last_only)
                self.truncate(start)
                self.next_position.copy_(positions)

    # ------------------------------------------------------------------------------------------ rollback
    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int) -> None:
        """Of the last ``width`` slots, row b keeps its first kept[b]; the rest become holes (O(1): a mask write
        and a pointer move). kept: [B] int64 on device; max_kept: max over rows (host int). Then compacts if the
        holes pass the threshold or the next iteration would not fit."""
        start = hole_rejected_slots(self.slot_mask, self.next_position, self.num_slots, width, kept)
        self.truncate(start + max_kept)
        self.compactor.maybe_compact(self, self.reserve, self.capacity)

    def truncate(self, num_slots: int) -> None:
        """Drop every slot at index >= num_slots (no row may still need them): a mask write and a pointer move."""
        if num_slots < self.num_slots:
            self.slot_mask[:, num_slots : self.num_slots] = 0
            self.num_slots = num_slots
            self.cache.position.fill_(num_slots)

    # ------------------------------------------------------------------------------------------ compaction
    def kv_tensors(self, num_slots: int) -> list[torch.Tensor]:
        """Every K/V buffer restricted to the first ``num_slots`` slots ([B, H, num_slots, D] views)."""
        return [t[:, :, :num_slots] for t in self.cache.tensors()]

    def select_cache_rows(self, index: torch.Tensor) -> None:
        self.cache.select_rows(index)


# ---------------------------------------------------------------------------------------------- sizing and memory
def static_capacity(prompt_width: int, max_new_tokens: int, gamma: int, batch: int, slack: float) -> int:
    """Slots per row of each static cache.

    A row holds at most prompt_width + max_new_tokens real slots (finished rows keep no new slots), one iteration
    writes at most gamma + 1 more, and right after a compaction up to gamma + 1 rejected slots of the last iteration may
    remain; so ``minimum`` always leaves room after compacting. Batches add ``slack`` * minimum slots so that holes
    accumulate between compactions (batch 1 has no holes and gets no slack).
    """
    minimum = prompt_width + max_new_tokens + 2 * (gamma + 1) + 2
    return minimum if batch == 1 else minimum + math.ceil(slack * minimum)


def static_memory_bytes(models, batch: int, capacity: int, gamma: int) -> dict:
    """Bytes the static path allocates beyond the models: K/V caches, slot masks, and the largest per-forward mask.
    models: models or their ``CacheLayout``s."""
    layouts = [m if isinstance(m, CacheLayout) else CacheLayout(m) for m in models]
    caches = sum(layout.bytes(batch, capacity) for layout in layouts)
    masks = len(layouts) * batch * capacity * 8  # slot_mask, int64
    element = max(torch.empty((), dtype=layout.dtype).element_size() for layout in layouts)
    attention = batch * (gamma + 1) * capacity * (element + 2)  # the additive mask and its bool precursor
    return {"kv_caches": caches, "slot_masks": masks, "attention_mask": attention, "total": caches + masks + attention}


def static_runner_factory(target, draft, *, batch: int, prompt_width: int, max_new_tokens: int, gamma: int,
                          options, device: torch.device):
    """Check both models and the memory, then return ``runner_factory(model, batch, max_slots, device)`` for
    ``SpeculativeLoop``. options: a ``compaction.BatchingOptions``."""
    capacity = static_capacity(prompt_width, max_new_tokens, gamma, batch, options.slack)
    for model in (target, draft):
        check_drivable(model, capacity, batch)
    required = static_memory_bytes((target, draft), batch, capacity, gamma)
    check_free_memory(required, device, f"the static caches ({batch} rows x {capacity} slots, target and draft)")

    def factory(model, batch, max_slots, device):
        return StaticDecoderRunner(model, batch, capacity, device, reserve=gamma + 1,
                                   compaction_threshold=options.compaction_threshold,
                                   compaction_backend=options.compaction_backend)

    return factory


# ---------------------------------------------------------------------------------------------- wiring
def compile_options_from(compile) -> CompileOptions | None:
    """``generate``'s ``compile`` argument (False, True or a CompileOptions) as CompileOptions or None."""
    if compile is None or compile is False:
        return None
    if compile is True:
        return CompileOptions()
    if isinstance(compile, CompileOptions):
        return compile
    raise TypeError(f"compile must be a bool or a CompileOptions, got {type(compile).__name__}")


def wants_static(plan, compile_options) -> bool:
    """Whether the request runs on the static cache: ``cache_implementation="static"`` or compiling (captured steps
    need the static cache's fixed shapes). Raises ValueError for combinations that cannot work."""
    if compile_options is not None and plan.cache_implementation == "dynamic":
        raise ValueError("compile=True captures fixed shapes and needs the static cache; "
                         "do not combine it with cache_implementation='dynamic'")
    if plan.cache_implementation != "static" and compile_options is None:
        return False
    if not isinstance(plan.num_speculative_tokens, int):  # "auto": gamma changes while decoding
        raise ValueError(f"cache_implementation='static' and compile=True need a fixed num_speculative_tokens (the "
                         f"cache is sized and the steps are captured for it), got {plan.num_speculative_tokens!r}")
    return True


def choose_runner_factory(target, draft, plan, input_ids: torch.Tensor, batching, compile_options):
    """The ``runner_factory`` for ``SpeculativeLoop``: the dynamic ``DecoderRunner``, or the static runner when
    ``wants_static``."""
    if not wants_static(plan, compile_options):
        return functools.partial(DecoderRunner, compaction_threshold=batching.compaction_threshold,
                                 compaction_backend=batching.compaction_backend)
    batch, prompt_width = input_ids.shape
    return static_runner_factory(target, draft, batch=batch, prompt_width=prompt_width,
                                 max_new_tokens=plan.max_new_tokens, gamma=plan.num_speculative_tokens,
                                 options=batching, device=input_ids.device)


def compile_loop(loop, options: CompileOptions) -> float:
    """Capture the draft step (pending widths 1 and 2) and the verification step (gamma + 1) of a loop built with
    static runners, and warm them up (compile, record CUDA graphs). Returns the warm-up seconds."""
    runners = (loop.target_runner, loop.draft_runner)
    if not all(callable(getattr(r, "compile_steps", None)) for r in runners):
        raise ValueError("compile=True needs the static cache runners")
    if loop.device.type == "cuda":
        torch.cuda.synchronize(loop.device)
    start = time.perf_counter()
    loop.target_runner.compile_steps([(loop.gamma + 1, False)], options)
    loop.draft_runner.compile_steps([(1, True), (2, True)], options)
    for runner in runners:
        runner.warm_up()
    if loop.device.type == "cuda":
        torch.cuda.synchronize(loop.device)
    return time.perf_counter() - start
