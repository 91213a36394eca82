"""``Seq2SeqRunner``: one encoder-decoder model (``capabilities.POSITION_KINDS``: T5-like, BART-like, M2M100,
Pegasus-X, FSMT, T5Gemma and T5Gemma 2; HF's generic wrappers by the decoder they wrap, ``wrapped_seq2seq.py``) over a
hole-free, right-aligned decoder cache.

These decoders take no per-row position ids (T5 derives its bias from slot offsets, BART its learned positions from
the cache length; T5Gemma's, which takes them, is given each row's own), so a hole would shift every later position.
Each row's tokens therefore fill the last ``next_position[b]`` slots of a rectangular cache; rollbacks and fillers
shift rows right by what they dropped (one gather, batch > 1 only; batch 1 crops its tail) and the columns every row
has left behind are cut on the left. BART's decoder (and Marian's, Pegasus's, ...) reads its position table at each
row's true positions through a forward hook; M2M100's (NLLB's) and FSMT's too, numbered from its token ids as HF's
one-token steps number them; Pegasus-X's sinusoids are recomputed by its own module at those positions. FSMT's
decoder is called directly (its model forward passes no causal mask under use_cache). The cross-attention cache,
filled by the first decoder forward, is kept for the whole request.
Details: ``docs/architecture.md``.
"""

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput
from transformers.utils import ModelOutput

from ..buffers import grow_columns
from ..capabilities import MERGED_ATTENTION, ModelSpec
from ..wrapped_seq2seq import decoder_pad_id, passes_input_mask
from .attention_backends import without_cudnn_attention
from .dynamic_cache import crop_cache
from .masks import additive_mask, attention_dtype, causal_slots, cross_attention_mask
from .seq2seq_positions import DecoderPositions


def _shift_right(tensor: torch.Tensor, shift: torch.Tensor, dim: int) -> torch.Tensor:
    """Row b of ``tensor`` (batch on dim 0) moved ``shift[b]`` slots towards the end along ``dim`` (the last
    shift[b] slots fall off, the first ones repeat slot 0 and must be masked by the caller)."""
    width = tensor.shape[dim]
    source = (torch.arange(width, device=shift.device).unsqueeze(0) - shift.unsqueeze(1)).clamp(min=0)  # [B, W]
    shape = [tensor.shape[0]] + [1] * (tensor.dim() - 1)
    shape[dim] = width
    return tensor.gather(dim, source.view(shape).expand_as(tensor))


def same_output_class(encoder_outputs, last_hidden_state: torch.Tensor):
    """An encoder output of the class of ``encoder_outputs`` holding last_hidden_state [B, S, H] alone: a forward
    may read another of its fields (Switch Transformers reads ``router_logits``, None here as in an output without
    them)."""
    cls = type(encoder_outputs) if isinstance(encoder_outputs, ModelOutput) else BaseModelOutput
    return cls(last_hidden_state=last_hidden_state)


class Seq2SeqRunner:
    """A ``Runner`` for one encoder-decoder model with its encoder output.

    The loop's slot numbering is kept in ``slot_mask`` (which of its slots held a real token, to count what a
    rollback drops). The first forward is the decoder prompt (or its first chunk, the others are forwards with
    ``prompt=True``): there ``real`` is the decoder attention mask and every token keeps its position (pads are
    masked but counted, as in HF). Later, ``real`` False marks a filler, which takes no position and is dropped right
    after the forward.
    spec: from ``capabilities.check_model``; encoder_outputs: BaseModelOutput with last_hidden_state [B, S, H];
    encoder_mask: [B, S] or None.
    """

    def __init__(self, model, spec: ModelSpec, batch: int, max_slots: int, device: torch.device, encoder_outputs,
                 encoder_mask):
        self.model, self.spec, self.batch = model, spec, batch
        self._flags = dict(spec.forward_flags)  # (capabilities.forward_flags: output_router_logits=False)
        self.encoder_outputs = encoder_outputs
        # No config: layers are created as used (a config may count the encoder's layers, e.g. T5).
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        self.slot_mask = torch.zeros(batch, max_slots, dtype=torch.int64, device=device)  # the loop's view [B, S]
        self.num_slots = 0
        # The cache's view: width W, row b's tokens in its last next_position[b] slots (a row's token count is
        # its next position), attend [B, W] (0 left of them and at decoder prompt pads).
        self.width = 0
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.attend = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        self._bound = {0: 0}  # loop slot count -> host upper bound on max(next_position) at that point
        self._tail_only = batch == 1  # batch 1 and no filler since the last rollback: rollback is a tail crop
        # RoBERTa inside a wrapper: its position ids skip pad tokens from its pad id (``_position_ids``)
        self._position_pad = decoder_pad_id(model) if spec.positions == "position_ids_skipping_pads" else None
        self._positions = None  # [B, T]: the true positions of the forward running now
        self._position_hooks = DecoderPositions(model, spec.positions, lambda: self._positions)
        self._dtype = attention_dtype(model)
        self._four_d = spec.mask != "2d"  # additive 4-D masks; otherwise (flash attention) the 2-D ones
        # (kept as given where a speech wrapper derives its cross-attention mask from it, and for FSMT's decoder,
        #  which takes the 2-D one)
        self._cross_mask = encoder_mask
        if self._four_d and getattr(model.config, "model_type", None) in MERGED_ATTENTION:
            source = encoder_outputs.last_hidden_state.shape[:2]
            real = encoder_mask if encoder_mask is not None else torch.ones(source, dtype=torch.int64, device=device)
            self._cross_mask = additive_mask(real.bool().unsqueeze(1), self._dtype)  # [B, 1, 1, S]
        elif (self._four_d and encoder_mask is not None and not passes_input_mask(model)
                and spec.positions != "absolute_fsmt"):
            self._cross_mask = cross_attention_mask(model, encoder_mask, self._dtype)

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False,
                prompt: bool = False):
        """Run tokens [B, T] after each row's tokens. Returns logits [B, T, V] (or [B, 1, V] with last_only) in the
        loop's order. prompt: (a chunk of) the decoder prompt, as the first forward always is: its False ``real``
        are pads, which keep their positions."""
        width = tokens.shape[1]
        start, end = self.num_slots, self.num_slots + width
        self.slot_mask = grow_columns(self.slot_mask, end)
        prompt = prompt or start == 0
        self._cover_positions(self._bound[start] + width)
        fillers = real is not None and not prompt
        occupied = real.to(torch.int64) if fillers else torch.ones_like(tokens)
        attend_new = real.to(torch.int64) if (real is not None and prompt) else occupied
        if fillers:  # fillers go last, so each row's real tokens follow its cache without a gap
            order = torch.argsort(1 - occupied, dim=1, stable=True)
            tokens, attend_new = tokens.gather(1, order), attend_new.gather(1, order)
        count = occupied.sum(dim=1)
        logits = self._decode(tokens, attend_new, count, fillers)
        self.slot_mask[:, start:end] = occupied
        self.num_slots = end
        self._bound[end] = self._bound[start] + width
        if fillers:
            if last_only:
                return logits.gather(1, (count - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1]))
            logits = logits.gather(1, torch.argsort(order, dim=1).unsqueeze(-1).expand_as(logits))
        return logits[:, -1:] if last_only else logits

    def _decode(self, tokens: torch.Tensor, attend_new: torch.Tensor, count: torch.Tensor, fillers: bool):
        """The cache-specific part of ``forward``: run the decoder on tokens [B, T] (each row's real ones first,
        attend_new [B, T] 1 where attended), advance each row by count [B] and drop the fillers after it."""
        width = tokens.shape[1]
        mask = torch.cat([self.attend, attend_new], dim=1)
        self._positions = self.next_position.unsqueeze(1) + torch.arange(width, device=tokens.device)
        if self._four_d:
            query_slots = torch.arange(mask.shape[1] - width, mask.shape[1], device=mask.device)
            decoder_mask = self._self_attention_mask(causal_slots(mask, query_slots), query_slots)
        else:
            decoder_mask = mask
        logits = self._call_model(tokens, decoder_mask)
        self.attend, self.width = mask, self.width + width
        self.next_position = self.next_position + count
        if fillers:
            self._tail_only = False
            self._shift(width - count)
        return logits

    def _self_attention_mask(self, allowed: torch.Tensor, query_slots: torch.Tensor):
        """allowed [B, T, S] bool -> the additive [B, 1, T, S] mask, or with sliding-window layers (T5Gemma) a dict of
        it and the windowed one keyed by layer type. query_slots: [T] or [B, T]. A row's slots are hole-free, so slot
        distances are position distances: HF's window q - k < window holds in slots."""
        if self.spec.sliding_window is None:
            return additive_mask(allowed, self._dtype)
        keys = torch.arange(allowed.shape[-1], device=allowed.device)
        inside = keys > (query_slots - self.spec.sliding_window).unsqueeze(-1)  # [T, S] or [B, T, S]
        return {"full_attention": additive_mask(allowed, self._dtype),
                "sliding_attention": additive_mask(allowed & inside, self._dtype)}

    def _call_model(self, tokens: torch.Tensor, decoder_mask: torch.Tensor) -> torch.Tensor:
        """One decoder forward with the position hooks in place; decoder_mask: [B, W] or additive [B, 1, T, W]."""
        hooks = self._register_position_hooks()
        try:
            return self._model_forward(tokens, decoder_mask)
        finally:
            for hook in hooks:
                hook.remove()

    def _model_forward(self, tokens: torch.Tensor, decoder_mask: torch.Tensor) -> torch.Tensor:
        if self.spec.positions == "absolute_fsmt":
            return self._fsmt_decoder_forward(tokens, decoder_mask)
        cross_mask = self._cross_mask
        if cross_mask is not None and cross_mask.dim() == 4:
            # [B, 1, 1, S] -> [B, 1, T, S], a view: MVP's attention checks the mask's query dimension
            cross_mask = cross_mask.expand(-1, -1, tokens.shape[1], -1)
        with without_cudnn_attention(tokens.device):  # (the decoder's key length changes at every forward)
            out = self.model(
                attention_mask=cross_mask,
                encoder_outputs=self.encoder_outputs,
                decoder_input_ids=tokens,
                decoder_attention_mask=decoder_mask,
                **self._position_ids(tokens),
                use_cache=True,
                return_dict=True,
                **{self.spec.cache_argument: self.cache},
                **self._flags,
            )
        self.cache = getattr(out, self.spec.cache_argument)
        return out.logits

    def _position_ids(self, tokens: torch.Tensor) -> dict:
        """The ``decoder_position_ids`` keyword of a decoder that takes them: each row's true positions [B, T]; for
        one that numbers them from its pad id (RoBERTa), ``pad + 1 + position``, and ``pad`` at a pad token, as
        HF's one-token steps number them."""
        if self.spec.positions == "position_ids":
            return {"decoder_position_ids": self._positions}
        if self.spec.positions == "position_ids_skipping_pads":
            pad = self._position_pad
            return {"decoder_position_ids": pad + (self._positions + 1) * (tokens != pad).to(torch.int64)}
        return {}

    def _fsmt_decoder_forward(self, tokens: torch.Tensor, decoder_mask: torch.Tensor) -> torch.Tensor:
        """FSMT's decoder called directly (its model forward, with use_cache, passes it no causal mask, and before
        transformers 5.18 the decoder keeps only the last token under use_cache): decoder_mask [B, 1, T, W] additive
        as its causal mask, the 2-D encoder mask as its padding mask; the cache is updated in place. Returns the
        decoder's output, the logits [B, T, V] (its output projection is inside it)."""
        out = self.model.get_decoder()(
            tokens, self.encoder_outputs.last_hidden_state, self._cross_mask, None, decoder_causal_mask=decoder_mask,
            use_cache=False, return_dict=True, **{self.spec.cache_argument: self.cache})
        return out.last_hidden_state

    def _register_position_hooks(self) -> list:
        """Hooks that give the decoder each row's true positions (``self._positions``) during one forward."""
        return self._position_hooks.register()

    def _own_forward(self) -> bool:
        return self._position_hooks.own_forward()

    def _cover_positions(self, positions: int) -> None:
        self._position_hooks.cover(positions)

    # ------------------------------------------------------------------------------------------- rollback
    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int,
                    kept_host: list[int] | None = None) -> None:
        """Of the loop's last ``width`` slots, row b keeps the first kept[b]; the real tokens among the rest go."""
        start = self.num_slots - width
        offsets = torch.arange(width, device=kept.device).unsqueeze(0)
        dropped = (self.slot_mask[:, start : self.num_slots] * (offsets >= kept.unsqueeze(1))).sum(dim=1)
        self.slot_mask[:, start + max_kept : self.num_slots] = 0
        self.num_slots = start + max_kept
        self._bound = {self.num_slots: self._bound[start] + max_kept}
        self._drop(dropped, width - max_kept)

    def _drop(self, dropped: torch.Tensor, tail: int) -> None:
        """Remove the last dropped[b] tokens of row b [B]; ``tail`` (host int) slots at the end go in every row."""
        self.next_position = self.next_position - dropped
        if self._tail_only:  # one row, all real: it drops exactly its last `tail` tokens
            self._crop_right(self.width - tail)
        else:
            self._shift(dropped)
            self._crop_left(min(self.width, self._bound[self.num_slots]))
        self._tail_only = self.batch == 1

    def _shift(self, shift: torch.Tensor) -> None:
        """Move row b right by shift[b] slots (its last shift[b] slots are dropped); shift: [B] int64."""
        for layer in self.cache.self_attention_cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.keys = _shift_right(layer.keys, shift, dim=2)
            layer.values = _shift_right(layer.values, shift, dim=2)
        valid = torch.arange(self.width, device=shift.device).unsqueeze(0) >= shift.unsqueeze(1)
        self.attend = _shift_right(self.attend, shift, dim=1) * valid

    def _crop_left(self, keep: int) -> None:
        """Keep the last ``keep`` slots (no row has a token left of them)."""
        cut = self.width - keep
        if cut <= 0:
            return
        for layer in self.cache.self_attention_cache.layers:
            if layer.keys is None or layer.keys.numel() == 0:
                continue
            layer.keys, layer.values = layer.keys[..., cut:, :], layer.values[..., cut:, :]
        self.attend = self.attend[:, cut:]
        self.width = keep

    def _crop_right(self, keep: int) -> None:
        if keep < self.width:
            crop_cache(self.cache.self_attention_cache, keep)
            self.attend = self.attend[:, :keep]
            self.width = keep

    # ------------------------------------------------------------------------------------------- rows
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of both caches, the encoder output, the masks and the positions."""
        self._select_cache(index)
        self.encoder_outputs = same_output_class(
            self.encoder_outputs, self.encoder_outputs.last_hidden_state.index_select(0, index))
        if self._cross_mask is not None:
            self._cross_mask = self._cross_mask.index_select(0, index)
        self.slot_mask = self.slot_mask.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)
        self.batch = index.shape[0]

    def add_rows(self, other: "Seq2SeqRunner") -> None:
        """Not supported: encoder-decoder rows are right-aligned in a rectangular cache with their encoder outputs;
        joining two batches would need both realigned (``SpeculativeDecoder.add_request`` takes decoder-only
        targets)."""
        self.check_add_rows(other)

    def check_add_rows(self, other: "Seq2SeqRunner") -> None:
        """Always NotImplementedError (see ``add_rows``)."""
        raise NotImplementedError("rows cannot join an encoder-decoder runner's batch (continuous batching supports "
                                  "decoder-only targets)")

    def _select_cache(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.attend = self.attend.index_select(0, index)

    def lengths_to_read(self) -> torch.Tensor | None:
        """[B]: the rows' token counts, read with the iteration's tokens (before its rollback) to tighten the width
        bound; batch 1 crops its tail exactly and needs none."""
        return None if self.batch == 1 else self.next_position

    def lengths_read(self, lengths: list[int]) -> None:
        """The host bounds add the batch's largest kept count at each rollback, which outgrows every row when rows
        keep different counts (BART's table was then indexed past its end): the rows' longest count, read now,
        bounds every slot count since the last rollback (a row's count only grows until then)."""
        longest = max(lengths, default=0)
        self._bound = {slots: min(bound, longest) for slots, bound in self._bound.items()}

    @property
    def compactions(self) -> int:
        return 0  # no holes
