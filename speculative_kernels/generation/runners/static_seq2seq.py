"""``StaticSeq2SeqRunner``: an encoder-decoder model over a preallocated decoder self-attention cache with a write
pointer per row (``cache_implementation="static"`` and ``compile=True`` for the types of ``capabilities.POSITION_KINDS``).

The cache is ``EncoderDecoderCache(SlotCache, DynamicCache)``, HF's structure with two differences speculation needs:
row b's tokens fill slots [0, next_position[b]) of its row, hole-free and left-aligned, so a token's position is its
slot and a rollback subtracts what each row dropped from its pointer (O(1), no K/V moved; stale slots past a pointer
are overwritten before any query can see them); and the cross-attention cache is filled once, by the first decoder
forward. Rows sit at different lengths while HF derives one offset from the cache, so hooks give the decoder each
row's own positions: BART's position table, T5's relative bias [B, H, T, C] (computed with the model's own bucket
function and table: T5's first layer is given it, UMT5's layers, which each compute their own, compute it so).
No holes, so no compaction and no slack.
"""

import functools
import inspect
from collections.abc import Sequence

import torch
from transformers import DynamicCache, EncoderDecoderCache

from ..capabilities import ModelSpec
from ..options import CompileOptions
from ..wrapped_seq2seq import passes_input_mask
from .captured import call_captured, compile_step
from .masks import causal_slots
from .sizing import captured_capacity
from .seq2seq import Seq2SeqRunner, same_output_class
from .slot_cache import CacheLayout, SlotCache


class StaticSeq2SeqRunner(Seq2SeqRunner):
    """A ``CapturableRunner``: ``Seq2SeqRunner``'s loop bookkeeping over the preallocated cache. capacity: C slots
    per row; spec: the model's static-path spec; the other arguments are ``Seq2SeqRunner``'s."""

    def __init__(self, model, spec: ModelSpec, batch: int, max_slots: int, device: torch.device, encoder_outputs,
                 encoder_mask, *, capacity: int):
        super().__init__(model, spec, batch, max_slots, device, encoder_outputs, encoder_mask)
        self.capacity = capacity
        self_attention = SlotCache(CacheLayout.of(model, spec), batch, capacity, device, per_row=True)
        self.cache = EncoderDecoderCache(self_attention, DynamicCache())
        self.next_position = self_attention.position  # [B]: one tensor, the rows' lengths and the write pointers
        self.attend = torch.zeros(batch, capacity, dtype=torch.int64, device=device)  # 0: a decoder prompt pad
        self._keys = torch.arange(capacity, device=device)
        self._cover_positions(capacity)
        self._bias_module, self._own_bias_modules = None, []
        if spec.positions == "relative":
            self._bias_module, self._own_bias_modules = _relative_bias_modules(model)
            self._row_bias = {id(m): functools.partial(self._own_relative_bias, m) for m in self._own_bias_modules}
        # id(module) -> whether its bucket function reads its own settings (UMT5's method) rather than taking them
        # (T5's static function): read once here, not in every forward
        self._bucket_reads_own = {id(m): len(inspect.signature(m._relative_position_bucket).parameters) == 1
                                  for m in [self._bias_module, *self._own_bias_modules] if m is not None}
        self._compiled = {}  # width -> compiled _step
        self._host_lengths = None  # the rows' lengths from the loop's host read (keeps the capacity bound tight)

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
            return call_captured(compiled, tokens, attend_new, count)
        finally:
            for hook in hooks:
                hook.remove()

    def _step(self, tokens: torch.Tensor, attend_new: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """The captured part: write the attend flags, build the mask and positions, run the decoder, advance.
        tokens, attend_new: [B, T] (real tokens first in each row); count: [B] real tokens per row."""
        slots = self.next_position.unsqueeze(1) + self._keys[: tokens.shape[1]]  # [B, T]
        self.attend.scatter_(1, slots, attend_new)
        self._positions = slots
        logits = self._model_forward(tokens, self._self_attention_mask(causal_slots(self.attend, slots), slots))
        self.next_position.add_(count)
        return logits

    def _register_position_hooks(self) -> list:
        hooks = super()._register_position_hooks()
        if self._bias_module is not None:
            hooks.append(self._bias_module.register_forward_pre_hook(self._relative_bias, with_kwargs=True))
        hooks.extend(_BiasOverride(module, self._row_bias[id(module)]) for module in self._own_bias_modules)
        return hooks

    def _relative_bias(self, module, args, kwargs):
        """Forward pre-hook on T5's first decoder self-attention: position_bias [B, H, T, C] for each row's query
        positions ``self._positions`` [B, T] (HF: one shared offset, [1, H, T, C])."""
        if not self._own_forward():
            return None
        kwargs["position_bias"] = self._bias_at_rows(module, self.capacity)
        return args, kwargs

    def _own_relative_bias(self, module, query_length, key_length, device=None, past_seen_tokens=0):
        """``compute_bias`` of a UMT5 decoder self-attention while this runner's forward runs: [B, H, T, K] at each
        row's positions (HF: [1, H, T, K] from the cache's one offset); another thread's forward gets HF's own."""
        if not self._own_forward():
            return type(module).compute_bias(module, query_length, key_length, device, past_seen_tokens)
        return self._bias_at_rows(module, key_length)

    def _bias_at_rows(self, module, key_length: int) -> torch.Tensor:
        """module's relative position bias [B, H, T, K] for the query positions ``self._positions`` [B, T] and key
        slots 0..K-1 (a slot is a position: rows are hole-free), by the module's own bucket function and table."""
        relative = self._keys[:key_length].view(1, 1, -1) - self._positions.unsqueeze(2)  # [B, T, K]: key - query
        if self._bucket_reads_own[id(module)]:  # UMT5: reads its own settings
            buckets = module._relative_position_bucket(relative)
        else:  # T5: a static function of the settings
            buckets = module._relative_position_bucket(
                relative, bidirectional=not module.is_decoder, num_buckets=module.relative_attention_num_buckets,
                max_distance=module.relative_attention_max_distance)
        return module.relative_attention_bias(buckets).permute(0, 3, 1, 2)

    # ------------------------------------------------------------------------------------------- rollback
    def _drop(self, dropped: torch.Tensor, tail: int) -> None:
        """O(1): each row's pointer moves back by what it dropped (dropped [B])."""
        self.next_position.sub_(dropped)
        if self._host_lengths:  # lengths before this rollback bound those after it
            self._bound[self.num_slots] = min(self._bound[self.num_slots], max(self._host_lengths))
        self._host_lengths = None

    # ------------------------------------------------------------------------------------------- rows
    def select_rows(self, index: torch.Tensor) -> None:
        super().select_rows(index)
        self.cache.self_attention_cache.point_at(self.next_position)

    def _select_cache(self, index: torch.Tensor) -> None:
        self.cache.self_attention_cache.select_rows(index)
        self.cache.cross_attention_cache.batch_select_indices(index)
        self.attend = self.attend.index_select(0, index)

    def lengths_to_read(self) -> torch.Tensor | None:
        return self.next_position

    def lengths_read(self, lengths: list[int]) -> None:
        self._host_lengths = lengths

    # ------------------------------------------------------------------------------------------- capture
    def capture(self, shapes: Sequence[tuple[int, bool]], options: CompileOptions) -> None:
        """The cross-attention cache is filled first (by a rewound eager forward when no forward has run yet), so the
        captured steps only read it; the source is padded to a bucket before (``_pad_source``)."""
        if not self.cache.cross_attention_cache.layers:
            self._pad_source()
            self._rewound(self.forward, torch.zeros(self.batch, 1, dtype=torch.int64, device=self.attend.device))
        cross = [t for layer in self.cache.cross_attention_cache.layers for t in (layer.keys, layer.values)]
        static = (self.attend, self.next_position, *self.cache.self_attention_cache.tensors(), *cross)
        compiled = compile_step(self._step, options, self.attend.device, static)
        self._compiled.update({width: compiled for width, _ in shapes})

    def _pad_source(self) -> None:
        """Pad the encoder output (zeros) and the cross-attention mask (not attended; FSMT's 2-D one with zeros) along
        the source to a bucket (``sizing.captured_capacity``): the captured steps are specialised to the
        cross-attention K/V's source length, which would compile them again for every new source length (and end a
        process's compiled calls at dynamo's limit). Padded keys are never attended, so nothing else changes; not
        padded: a source without a mask (HF passes none: a mask could select another attention kernel), and a batch
        with a row of no real source token (an attention that adds the mask, eager's or T5's, weighs every source
        state alike there; one host read, before decoding). A speech wrapper's mask is over its audio samples
        (``_pad_speech_source``)."""
        mask, states = self._cross_mask, self.encoder_outputs.last_hidden_state
        extra = captured_capacity(states.shape[1]) - states.shape[1]
        if passes_input_mask(self.model):
            if mask is not None:
                self._pad_speech_source(mask, states, extra)
            return
        fsmt = self.spec.positions == "absolute_fsmt"
        if extra == 0 or mask is None or mask.dim() != (2 if fsmt else 4):
            return
        flags = mask.dtype == torch.bool or fsmt  # (FSMT's decoder takes the 2-D 0/1 mask)
        if not bool((mask.bool() if flags else mask == 0).any(dim=-1).all()):
            return
        filler = 0 if flags else torch.finfo(mask.dtype).min
        self.encoder_outputs = same_output_class(self.encoder_outputs,
                                                 torch.nn.functional.pad(states, (0, 0, 0, extra)))
        self._cross_mask = torch.cat([mask, mask.new_full((*mask.shape[:-1], extra), filler)], dim=-1)

    def _pad_speech_source(self, audio_mask: torch.Tensor, states: torch.Tensor, extra: int) -> None:
        """A speech wrapper's source padded to buckets: its forward derives the cross-attention mask over the
        encoder's frames from the mask over the audio samples (audio_mask [B, L], which the captured steps read too,
        so its width specialises them as the frames' does): the audio mask is padded with zeros to a bucket of L,
        the frames (states [B, S, H]) with zeros to a bucket of S. Done only where the encoder's own derivation
        (``_get_feature_vector_attention_mask``, from each row's count of audio samples) gives the padded frames 0
        and the real ones the mask it gave unpadded, every row with a real frame (one host read, before decoding);
        otherwise the source is left as it is (each new length compiles the steps again)."""
        derive = self.model.get_encoder()._get_feature_vector_attention_mask
        audio = torch.nn.functional.pad(audio_mask, (0, captured_capacity(audio_mask.shape[1]) - audio_mask.shape[1]))
        if audio.shape == audio_mask.shape and extra == 0:
            return
        frames, padded = derive(states.shape[1], audio_mask), derive(states.shape[1] + extra, audio)
        if not (torch.equal(padded[:, : states.shape[1]], frames) and not bool(padded[:, states.shape[1]:].any())
                and bool(frames.bool().any(dim=-1).all())):
            return
        self.encoder_outputs = same_output_class(self.encoder_outputs,
                                                 torch.nn.functional.pad(states, (0, 0, 0, extra)))
        self._cross_mask = audio

    def warm_up(self, calls: int = 3) -> None:
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


def _relative_bias_modules(model) -> tuple:
    """(the decoder self-attention given T5's bias through ``position_bias``, or None; the decoder self-attentions
    that compute their own, UMT5's, from one offset in ``compute_bias`` and take no ``position_bias``)."""
    attentions = [block.layer[0].SelfAttention for block in model.get_decoder().block]
    biased = [a for a in attentions if getattr(a, "has_relative_attention_bias", False)]
    takes = [a for a in biased if "position_bias" in inspect.signature(a.forward).parameters]
    if len(takes) > 1 or (takes and takes[0] is not attentions[0]):
        raise ValueError(f"{type(model).__name__}: unexpected relative position bias layout in the decoder")
    return (takes[0] if takes else None), [a for a in biased if a not in takes]


class _BiasOverride:
    """``module.compute_bias`` replaced by ``compute`` on the instance until ``remove()`` (a hook handle's
    interface): UMT5's attention computes its bias inside its forward from the cache's one offset, where no hook
    reaches."""

    def __init__(self, module, compute):
        self.module = module
        module.compute_bias = compute

    def remove(self) -> None:
        vars(self.module).pop("compute_bias", None)
