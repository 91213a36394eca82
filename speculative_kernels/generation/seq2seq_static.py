"""The static cache (and ``compile=True``) for encoder-decoder models: T5/MT5, BART/mBART.

HF 5.23 generates with ``EncoderDecoderCache(StaticCache, StaticCache)``: both caches preallocated, the decoder
self-attention written at one shared ``cumulative_length`` per layer. Here the structure is the same,
``EncoderDecoderCache(SlotCache, DynamicCache)``, with two differences that speculation needs:

* Self-attention: a ``SlotCache`` (``static_runner.py``) with a write pointer *per row*, ``next_position`` [B]. Row
  b's tokens fill slots [0, next_position[b]) of its row, hole-free and left-aligned, so a token's position is its
  slot. A forward writes row b's T tokens at next_position[b] + [0, T) (a scatter); a rollback subtracts what each
  row dropped from its pointer: O(1), no K/V is moved. Stale slots past a pointer are never read before they are
  overwritten, since a query at slot q sees only slots <= q of its row and the forward writing q wrote every slot
  between the pointer and q. A filler (a row with nothing real to feed) is written after the row's real tokens and
  not counted, so the next forward overwrites it. No holes, so no compaction and no slack: the capacity is the
  longest row plus one iteration (``static_capacity`` with batch 1).
* Cross-attention: a ``DynamicCache`` filled by the first decoder forward (the decoder prompt, or a rewound filler
  forward before compiling) and kept, never rolled back, for the whole request.

Positions. Rows sit at different lengths, while HF derives one shared offset from the cache, so the runner gives the
decoder each row's own positions through hooks active during its forwards: BART/mBART read the learned position
table at each row's positions (``Seq2SeqRunner._true_positions``); T5/MT5 get ``position_bias`` [B, H, T, C] from
each row's query positions, passed to the first decoder self-attention (which shares it with the other layers, as HF
does), computed with T5's own bucket function and table, so the values are the very ones HF would add.

``compile_steps`` wraps the decoder step (mask, hooks' positions, model forward, pointer advance, all with device
indices) in ``torch.compile`` for the draft and verification widths, as ``StaticDecoderRunner`` does.
"""

import torch
from transformers import DynamicCache, EncoderDecoderCache

from .seq2seq import Seq2SeqRunner, Seq2SeqRunnerFactory, position_kind
from .static_runner import (
    CacheLayout,
    SlotCache,
    _dynamo_limits,
    additive_mask,
    check_attention,
    check_free_memory,
    static_capacity,
    static_memory_bytes,
)


def decoder_layout(model) -> CacheLayout:
    """The decoder self-attention's K/V sizes, read from the modules (a T5 config's head count times d_kv need not
    be d_model, and its layer count is the encoder's)."""
    decoder = model.get_decoder()
    if position_kind(model) == "relative":  # T5/MT5
        attention = decoder.block[0].layer[0].SelfAttention
        sizes = (len(decoder.block), attention.n_heads, attention.key_value_proj_dim)
    else:  # BART/mBART
        attention = decoder.layers[0].self_attn
        sizes = (len(decoder.layers), attention.num_heads, attention.head_dim)
    return CacheLayout(model, sizes)


class StaticSeq2SeqRunner(Seq2SeqRunner):
    """``Seq2SeqRunner`` over a preallocated decoder self-attention cache with a write pointer per row (see the
    module docstring). capacity: C slots per row; the other arguments are ``Seq2SeqRunner``'s."""

    def __init__(self, model, batch: int, max_slots: int, device: torch.device, encoder_outputs, encoder_mask, *,
                 capacity: int):
        check_attention(model)
        super().__init__(model, batch, max_slots, device, encoder_outputs, encoder_mask)
        self.capacity = capacity
        self_attention = SlotCache(model, batch, capacity, device, layout=decoder_layout(model), per_row=True)
        self.cache = EncoderDecoderCache(self_attention, DynamicCache())
        self.next_position = self_attention.position  # one tensor: the rows' lengths and the write pointers
        self.attend = torch.zeros(batch, capacity, dtype=torch.int64, device=device)  # 0: a decoder prompt pad
        self._keys = torch.arange(capacity, device=device)
        self._bias_module = None
        if position_kind(model) == "relative":
            self._bias_module = model.get_decoder().block[0].layer[0].SelfAttention
        self._compiled = {}  # width -> compiled _step
        # The loop's host read brings each row's length (before the rollback) here, to keep the capacity check's
        # host bound tight without a read of its own.
        self.wants_host_lengths, self.host_lengths = True, None

    @property
    def next_position(self) -> torch.Tensor:
        """[B] int64: each row's token count, which is also its write pointer and its next position."""
        return self._next_position

    @next_position.setter
    def next_position(self, value: torch.Tensor) -> None:  # compaction.drop_rows selects rows by assignment
        self._next_position = value
        self_attention = getattr(getattr(self, "cache", None), "self_attention_cache", None)
        if isinstance(self_attention, SlotCache):
            self_attention.point_at(value)

    # ------------------------------------------------------------------------------------------- forward
    def _decode(self, tokens: torch.Tensor, attend_new: torch.Tensor, count: torch.Tensor, fillers: bool):
        width = tokens.shape[1]
        if self._bound[self.num_slots] + width > self.capacity:
            # Without the loop's lengths (a runner driven on its own) the host bound sums each iteration's longest
            # row and at batch > 1 outgrows every row: read the true lengths (the capacity holds the longest row plus
            # one iteration).
            self._bound[self.num_slots] = int(self.next_position.max())
            if self._bound[self.num_slots] + width > self.capacity:
                raise RuntimeError(f"static cache exhausted ({self._bound[self.num_slots] + width} > "
                                   f"{self.capacity} slots)")
        hooks = self._register_position_hooks()
        try:
            compiled = self._compiled.get(width)
            if compiled is None:
                return self._step(tokens, attend_new, count)
            torch.compiler.cudagraph_mark_step_begin()
            fresh = torch.contiguous_format  # fresh tensors: one inference mode and one stride per shape for the guards
            with _dynamo_limits():
                logits = compiled(tokens.clone(memory_format=fresh), attend_new.clone(memory_format=fresh),
                                  count.clone(memory_format=fresh))
            return logits.clone()  # a captured graph's outputs are overwritten by its next replay
        finally:
            for hook in hooks:
                hook.remove()

    def _step(self, tokens: torch.Tensor, attend_new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The captured part: write the attend flags, build the mask and positions, run the decoder, advance.
        tokens, attend_new: [B, T] (real tokens first in each row); count: [B] real tokens per row."""
        slots = self.next_position.unsqueeze(1) + self._keys[: tokens.shape[1]]  # [B, T]
        self.attend.scatter_(1, slots, attend_new)
        self._positions = slots
        allowed = (self._keys.view(1, 1, -1) <= slots.unsqueeze(2)) & self.attend.unsqueeze(1).bool()  # [B, T, C]
        logits = self._model_forward(tokens, additive_mask(allowed, self._dtype))
        self.next_position.add_(count)
        return logits

    def _register_position_hooks(self) -> list:
        hooks = super()._register_position_hooks()
        if self._bias_module is not None:
            hooks.append(self._bias_module.register_forward_pre_hook(self._relative_bias, with_kwargs=True))
        return hooks

    def _relative_bias(self, module, args, kwargs):
        """Forward pre-hook on T5's first decoder self-attention: position_bias [B, H, T, C] for each row's query
        positions ``self._positions`` [B, T] (HF: one shared offset, [1, H, T, C])."""
        relative = self._keys.view(1, 1, -1) - self._positions.unsqueeze(2)  # [B, T, C]: key - query position
        buckets = module._relative_position_bucket(
            relative, bidirectional=not module.is_decoder, num_buckets=module.relative_attention_num_buckets,
            max_distance=module.relative_attention_max_distance)
        kwargs["position_bias"] = module.relative_attention_bias(buckets).permute(0, 3, 1, 2)
        return args, kwargs

    # ------------------------------------------------------------------------------------------- rollback
    def _drop(self, dropped: torch.Tensor, tail: int) -> None:
        """O(1): each row's pointer moves back by what it dropped (dropped [B])."""
        self.next_position.sub_(dropped)
        if self.host_lengths:  # lengths before this rollback bound those after it
            self._bound[self.num_slots] = min(self._bound[self.num_slots], max(self.host_lengths))
        self.host_lengths = None

    def _select_cache(self, index: torch.Tensor) -> None:
        """Rows ``index`` of both caches and the attend flags; ``drop_rows`` then assigns the selected pointers."""
        self.cache.self_attention_cache.select_rows(index)
        self.cache.cross_attention_cache.batch_select_indices(index)
        self.attend = self.attend.index_select(0, index)

    # ------------------------------------------------------------------------------------------- compile
    def compile_steps(self, shapes, options) -> None:
        """Capture ``_step`` for each (width, last_only) in ``shapes`` (a ``static_runner.CompileOptions``). The
        cross-attention cache is filled first (by a rewound eager forward when no forward has run yet), so the
        captured steps only read it."""
        if not self.cache.cross_attention_cache.layers:
            self._rewound(self.forward, torch.zeros(self.batch, 1, dtype=torch.int64, device=self.attend.device))
        cross = [t for layer in self.cache.cross_attention_cache.layers for t in (layer.keys, layer.values)]
        for tensor in (self.attend, self.next_position, *self.cache.self_attention_cache.tensors(), *cross):
            torch._dynamo.mark_static_address(tensor)
        compiled = torch.compile(self._step, **options.torch_compile_kwargs(self.attend.device))
        self._compiled.update({width: compiled for width, _ in shapes})

    def warm_up(self, calls: int = 3) -> None:
        """Run every captured step ``calls`` times on filler tokens and rewind (compiles; records CUDA graphs)."""
        for width in self._compiled:
            tokens = torch.zeros(self.batch, width, dtype=torch.int64, device=self.attend.device)
            for _ in range(calls):
                self._rewound(self.forward, tokens)

    def _rewound(self, forward, tokens: torch.Tensor) -> None:
        """Call forward(tokens) and put the loop's view and the pointers back as they were."""
        start, bound, positions = self.num_slots, self._bound[self.num_slots], self.next_position.clone()
        forward(tokens)
        self.slot_mask[:, start : self.num_slots] = 0
        self.num_slots, self._bound = start, {start: bound}
        self.next_position.copy_(positions)


class StaticSeq2SeqRunnerFactory:
    """``runner_factory`` for the loop: ``StaticSeq2SeqRunner``s of ``capacity`` slots over the encoder outputs of
    a ``Seq2SeqRunnerFactory``."""

    def __init__(self, dynamic: Seq2SeqRunnerFactory, capacity: int):
        self.dynamic, self.capacity = dynamic, capacity

    def __call__(self, model, batch: int, max_slots: int, device: torch.device) -> StaticSeq2SeqRunner:
        return StaticSeq2SeqRunner(model, batch, max_slots, device, self.dynamic.encoded[id(model)],
                                   self.dynamic.encoder_mask, capacity=self.capacity)


def static_seq2seq_factory(target, draft, dynamic: Seq2SeqRunnerFactory, *, batch: int, prompt_width: int,
                           max_new_tokens: int, gamma: int, device: torch.device) -> StaticSeq2SeqRunnerFactory:
    """Check both models and the memory (before the encoders run); return the static factory over ``dynamic``'s
    encoder outputs. prompt_width: the decoder prompt's width."""
    capacity = static_capacity(prompt_width, max_new_tokens, gamma, 1, 0.0)  # no holes, no slack
    for model in (target, draft):
        check_attention(model)
    layouts = [decoder_layout(m) for m in (target, draft)]
    required = static_memory_bytes(layouts, batch, capacity, gamma)
    check_free_memory(required, device, f"the static decoder caches ({batch} rows x {capacity} slots, target and "
                                        "draft)")
    return StaticSeq2SeqRunnerFactory(dynamic, capacity)
