"""Encoder-decoder models (T5/MT5, BART/mBART): encode once, speculate and verify with the decoders.

Each model's encoder runs once per request. The loop (``loop.py``) then drives the two decoders exactly as it drives
decoder-only models, through ``Seq2SeqRunner``: the decoder self-attention cache is rolled back after verification,
the cross-attention cache (filled by the first decoder forward) is kept for the whole request.

Why not the decoder-only runner's holes: these decoders take no per-row position ids. T5 derives its relative
attention bias from slot indices, BART/mBART their learned positions from the cache length, so a rejected token left
as a hole in the middle of a row would shift every later position. The runner therefore keeps each row *hole-free
and right-aligned* in a rectangular cache: row b's tokens fill the last ``next_position[b]`` slots, anything left of
them is masked. After each rollback, and after a forward in which some rows fed a filler, rows are shifted right by what
they dropped (one gather over the self-attention cache, batch > 1 only; batch 1 just crops its tail), and the
columns every row has left behind are cut off on the left.

* T5/MT5 (relative positions): the bias depends only on key slot - query slot, which right-alignment keeps exact.
* BART/mBART (learned absolute positions): additionally, while the runner's forward runs, a forward hook on the
  decoder's ``embed_positions`` returns the embedding at each row's true position (its own token count), the very
  rows of the same table HF would read.
* Any other encoder-decoder architecture gets a ValueError naming it, as does a decoder-only draft for an
  encoder-decoder target (or the reverse).

Decoder prompt pads (``decoder_attention_mask`` zeros) keep their positions, as in HF's generate: they are masked
but counted, while rejected drafts and fillers are removed. Finished rows leave the batch as with decoder-only
models (``compaction.RowDropper``): ``select_cache_rows`` also selects the encoder output and cross-attention mask.

``cache_implementation="static"`` and ``compile=True`` use ``seq2seq_static.StaticSeq2SeqRunner``, which keeps this
runner's loop bookkeeping (``forward``/``keep_prefix``) and replaces the cache-specific ``_decode``/``_drop``/
``_select_cache``: a preallocated cache with a write pointer per row instead of shifts and crops.
"""

import dataclasses
import functools

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.generation.utils import GenerateEncoderDecoderOutput
from transformers.modeling_outputs import BaseModelOutput

from .cache_ops import crop_cache
from .runner import grow_columns
from .settings import resolve_plan
from .vocab import check_ids_in_vocabulary
from .stats import SpeculationStats

# model_type -> how its decoder knows positions ("relative": nothing to do; "absolute": embed_positions hook).
POSITION_KINDS = {"t5": "relative", "mt5": "relative", "bart": "absolute", "mbart": "absolute"}


@dataclasses.dataclass
class SpeculativeEncoderDecoderOutput(GenerateEncoderDecoderOutput):
    """``GenerateEncoderDecoderOutput`` plus ``speculation_stats``; ``sequences`` are the decoder's, as in HF."""

    speculation_stats: SpeculationStats | None = None


def check_pair(model, draft_model) -> None:
    """ValueError unless both models are encoder-decoders of a supported architecture."""
    target_seq2seq, draft_seq2seq = model.config.is_encoder_decoder, draft_model.config.is_encoder_decoder
    if target_seq2seq != draft_seq2seq:
        kinds = {True: "an encoder-decoder", False: "a decoder-only"}
        raise ValueError(
            f"model is {kinds[target_seq2seq]} model but draft_model is {kinds[draft_seq2seq]} model; the draft must "
            "condition on the same input as the target, so both must be encoder-decoder or both decoder-only"
        )
    for name, m in (("model", model), ("draft_model", draft_model)):
        position_kind(m, name)


def position_kind(model, name: str = "model") -> str:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in POSITION_KINDS:
        raise ValueError(
            f"{name} is an encoder-decoder model of type {model_type!r} ({type(model).__name__}), which "
            f"speculative_kernels does not support; supported encoder-decoder types: {sorted(POSITION_KINDS)}"
        )
    return POSITION_KINDS[model_type]


def _shift_right(tensor: torch.Tensor, shift: torch.Tensor, dim: int) -> torch.Tensor:
    """Row b of ``tensor`` (batch on dim 0) moved ``shift[b]`` slots towards the end along ``dim`` (the last
    shift[b] slots fall off, the first ones repeat slot 0 and must be masked by the caller)."""
    width = tensor.shape[dim]
    source = (torch.arange(width, device=shift.device).unsqueeze(0) - shift.unsqueeze(1)).clamp(min=0)  # [B, W]
    shape = [tensor.shape[0]] + [1] * (tensor.dim() - 1)
    shape[dim] = width
    return tensor.gather(dim, source.view(shape).expand_as(tensor))


class Seq2SeqRunner:
    """One encoder-decoder model with its encoder output and a hole-free, right-aligned decoder cache.

    The loop's interface (see ``runner.DecoderRunner``): ``forward(tokens [B, T], real [B, T] | None, last_only)``
    and ``keep_prefix(width, kept [B], max_kept)``, in the loop's slot numbering. The first forward is the decoder
    prompt: there ``real`` is the decoder attention mask and every token keeps its position. Later, ``real`` False
    marks a filler, which takes no position and is dropped right after the forward.
    encoder_outputs: BaseModelOutput with last_hidden_state [B, S, H]; encoder_mask: [B, S] or None.
    """

    def __init__(self, model, batch: int, max_slots: int, device: torch.device, encoder_outputs, encoder_mask):
        self.model, self.batch = model, batch
        self.encoder_outputs = encoder_outputs
        # No config: layers are created as used (a config may count the encoder's layers, e.g. T5).
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        # The loop's view: which of its slots held a real token (to count what a rollback drops).
        self.slot_mask = torch.zeros(batch, max_slots, dtype=torch.int64, device=device)
        self.num_slots = 0
        # The cache's view: width W, row b's tokens in its last next_position[b] slots (a row's token count is
        # its next position), attend [B, W] (0 left of them and at decoder prompt pads).
        self.width = 0
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.attend = torch.zeros(batch, 0, dtype=torch.int64, device=device)
        self._bound = {0: 0}  # loop slot count -> host upper bound on max(next_position) at that point
        self._tail_only = batch == 1  # batch 1 and no filler since the last rollback: rollback is a tail crop
        self._position_module = None
        if position_kind(model) == "absolute":
            self._position_module = model.get_decoder().embed_positions
            if not isinstance(self._position_module, torch.nn.Embedding):
                raise ValueError(f"{type(model).__name__}: unexpected decoder position embedding type")
        self._positions = None
        # sdpa/eager take a ready additive 4-D mask as given; a 2-D one makes HF read it on the host at every forward
        # to see whether masking can be skipped (flash attention only takes 2-D masks and pays that read).
        self._dtype = next(model.parameters()).dtype
        self._four_d = getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")
        self._cross_mask = encoder_mask
        if self._four_d and encoder_mask is not None:  # [B, 1, 1, S], broadcast over queries
            blocked = ~encoder_mask.to(torch.bool)[:, None, None, :]
            self._cross_mask = torch.zeros(blocked.shape, dtype=self._dtype, device=device).masked_fill_(
                blocked, torch.finfo(self._dtype).min)

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False):
        """Run tokens [B, T] after each row's tokens. Returns logits [B, T, V] (or [B, 1, V] with last_only) in the
        loop's order."""
        batch, width = tokens.shape
        start, end = self.num_slots, self.num_slots + width
        self.slot_mask = grow_columns(self.slot_mask, end)
        prompt = start == 0
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
        logits = self._call_model(tokens, self._self_mask(mask, width) if self._four_d else mask)
        self.attend, self.width = mask, self.width + width
        self.next_position = self.next_position + count
        if fillers:
            self._tail_only = False
            self._shift(width - count)
        return logits

    def _call_model(self, tokens: torch.Tensor, decoder_mask: torch.Tensor) -> torch.Tensor:
        """One decoder forward with the position hooks in place; decoder_mask: [B, W] or additive [B, 1, T, W]."""
        hooks = self._register_position_hooks()
        try:
            return self._model_forward(tokens, decoder_mask)
        finally:
            for hook in hooks:
                hook.remove()

    def _model_forward(self, tokens: torch.Tensor, decoder_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            attention_mask=self._cross_mask,
            encoder_outputs=self.encoder_outputs,
            decoder_input_ids=tokens,
            decoder_attention_mask=decoder_mask,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        return out.logits

    def _register_position_hooks(self) -> list:
        """Hooks that give the decoder each row's true positions (``self._positions``) during one forward."""
        if self._position_module is None:
            return []
        return [self._position_module.register_forward_hook(self._true_positions)]

    def _self_mask(self, attend: torch.Tensor, width: int) -> torch.Tensor:
        """attend [B, W + T] (1 = attended slot) -> additive [B, 1, T, W + T], causal over the T new slots."""
        slots = attend.shape[1]
        query_slots = torch.arange(slots - width, slots, device=attend.device).unsqueeze(1)
        causal = torch.arange(slots, device=attend.device).unsqueeze(0) <= query_slots  # [T, W + T]
        blocked = ~(causal.unsqueeze(0) & attend[:, None, :].to(torch.bool))
        return torch.zeros(blocked.shape, dtype=self._dtype, device=attend.device).masked_fill_(
            blocked, torch.finfo(self._dtype).min).unsqueeze(1)

    def _true_positions(self, module, args, output):
        """Forward hook: the position embeddings of each row's true positions [B, T] (HF reads the cache width)."""
        limit = module.num_embeddings - getattr(module, "offset", 0) - 1
        positions = self._positions.clamp(max=limit) + getattr(module, "offset", 0)  # fillers may run past the end
        return torch.nn.functional.embedding(positions, module.weight).to(output.dtype)

    # ------------------------------------------------------------------------------------------- rollback
    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int) -> None:
        """Of the loop's last ``width`` slots, row b keeps the first kept[b]; the real tokens among the rest go.

        kept: [B] int64 on device; max_kept: its max (host int).
        """
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

    def select_cache_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of both caches, the encoder output and masks (``compaction.drop_rows`` selects
        ``slot_mask`` and ``next_position``)."""
        self._select_cache(index)
        self.encoder_outputs = BaseModelOutput(
            last_hidden_state=self.encoder_outputs.last_hidden_state.index_select(0, index))
        if self._cross_mask is not None:
            self._cross_mask = self._cross_mask.index_select(0, index)
        self.batch = index.shape[0]

    def _select_cache(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)
        self.attend = self.attend.index_select(0, index)

    def _crop_right(self, keep: int) -> None:
        if keep < self.width:
            crop_cache(self.cache.self_attention_cache, keep)
            self.attend = self.attend[:, :keep]
            self.width = keep


class Seq2SeqRunnerFactory:
    """``runner_factory`` for the loop: each model gets the encoder output computed for it.

    encode: () -> {id(model): BaseModelOutput}, run at the first runner's construction, so that every check of the
    request (vocabularies, static-cache sizes and memory) comes before the encoder passes."""

    def __init__(self, encode, encoder_mask):
        self._encode, self._encoded, self.encoder_mask = encode, None, encoder_mask

    @property
    def encoded(self) -> dict:
        if self._encoded is None:
            self._encoded = self._encode()
        return self._encoded

    def __call__(self, model, batch: int, max_slots: int, device: torch.device) -> Seq2SeqRunner:
        return Seq2SeqRunner(model, batch, max_slots, device, self.encoded[id(model)], self.encoder_mask)


# ----------------------------------------------------------------------------------------------- request preparation
def prepare_seq2seq(model, draft_model, input_ids, attention_mask, num_speculative_tokens, generation_config,
                    kwargs: dict):
    """Run both encoders and build the decoder prompt as HF's ``generate`` does.

    input_ids, attention_mask: the encoder input [B, S] (either may be None, as in HF). kwargs: the remaining
    ``generate`` keywords (decoder_input_ids, decoder_attention_mask, encoder_outputs and generation settings).
    Returns (plan, decoder_input_ids [B, Ld], decoder_attention_mask [B, Ld], runner_factory); the encoders run when
    the loop builds its first runner.
    """
    check_pair(model, draft_model)
    device = next(model.parameters()).device
    decoder_ids = kwargs.pop("decoder_input_ids", None)
    decoder_mask = kwargs.pop("decoder_attention_mask", None)
    encoder_outputs = _as_encoder_output(kwargs.pop("encoder_outputs", None), device)
    probe, _ = resolve_plan(model, None, num_speculative_tokens, generation_config, dict(kwargs), draft_model)
    config = probe.generation_config
    input_ids, attention_mask = _encoder_input(input_ids, attention_mask, encoder_outputs, config.bos_token_id,
                                               device)
    batch = input_ids.shape[0] if input_ids is not None else encoder_outputs.last_hidden_state.shape[0]
    decoder_ids, decoder_mask = _decoder_prompt(config, decoder_ids, decoder_mask, batch, device)
    if input_ids is not None:
        check_ids_in_vocabulary(model.get_encoder(), "input_ids", input_ids)
    check_ids_in_vocabulary(model, "decoder_input_ids", decoder_ids)
    plan, model_kwargs = resolve_plan(model, decoder_ids.shape[1], num_speculative_tokens, generation_config, kwargs,
                                      draft_model)
    model_kwargs.pop("use_cache", None)
    if model_kwargs:
        raise ValueError(f"unsupported keyword arguments for speculative_kernels.generate: {sorted(model_kwargs)}")
    encode = functools.partial(_encode_both, model, draft_model, input_ids, attention_mask, encoder_outputs)
    return plan, decoder_ids, decoder_mask, Seq2SeqRunnerFactory(encode, attention_mask)


def _as_encoder_output(encoder_outputs, device):
    if encoder_outputs is None:
        return None
    if isinstance(encoder_outputs, (tuple, list)):
        encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
    hidden = getattr(encoder_outputs, "last_hidden_state", None)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
        raise ValueError("encoder_outputs must hold last_hidden_state [batch, source length, hidden]")
    return BaseModelOutput(last_hidden_state=hidden.to(device))


def _encoder_input(input_ids, attention_mask, encoder_outputs, bos_token_id, device):
    """(input_ids, attention_mask) for the encoders. No ids and no encoder_outputs: [[bos]], as HF does."""
    if input_ids is None and encoder_outputs is None:
        if bos_token_id is None:
            raise ValueError("input_ids (or encoder_outputs) is required: the model has no bos_token_id to start from")
        input_ids = torch.full((1, 1), int(bos_token_id), dtype=torch.int64, device=device)
    if input_ids is not None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            shape = getattr(input_ids, "shape", input_ids)
            raise ValueError(f"input_ids must be a [batch, length] tensor, got {shape}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
        input_ids = input_ids.to(device=device, dtype=torch.int64)
    given = encoder_outputs is not None and input_ids is not None
    if given and encoder_outputs.last_hidden_state.shape[0] != input_ids.shape[0]:
        raise ValueError("encoder_outputs and input_ids have different batch sizes")
    if attention_mask is not None:
        source = input_ids.shape if input_ids is not None else encoder_outputs.last_hidden_state.shape[:2]
        if tuple(attention_mask.shape) != tuple(source):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but the encoder input has "
                             f"{tuple(source)}")
        attention_mask = attention_mask.to(device)
    return input_ids, attention_mask


def _decoder_prompt(config, decoder_ids, decoder_mask, batch: int, device):
    """HF's decoder prompt: decoder_start_token_id (or bos) alone, or prepended to decoder_input_ids that do not
    all start with it (decoder_attention_mask gets a 1 in front)."""
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else config.bos_token_id
    if start is None:
        raise ValueError("decoder_start_token_id or bos_token_id has to be defined for encoder-decoder generation")
    start = torch.as_tensor(start, dtype=torch.int64, device=device)
    if start.dim() == 1 and start.shape[0] != batch:
        raise ValueError(f"decoder_start_token_id has {start.shape[0]} entries for a batch of {batch}")
    start = start.view(-1, 1).expand(batch, 1)
    if decoder_ids is None:
        if decoder_mask is not None:
            raise ValueError("decoder_attention_mask was given without decoder_input_ids")
        return start.clone(), torch.ones(batch, 1, dtype=torch.int64, device=device)
    if not isinstance(decoder_ids, torch.Tensor) or decoder_ids.dim() != 2 or decoder_ids.shape[0] != batch:
        raise ValueError(f"decoder_input_ids must be a [{batch}, length] tensor, got "
                         f"{getattr(decoder_ids, 'shape', decoder_ids)}")
    decoder_ids = decoder_ids.to(device=device, dtype=torch.int64)
    if decoder_mask is None:
        decoder_mask = torch.ones_like(decoder_ids)
    if tuple(decoder_mask.shape) != tuple(decoder_ids.shape):
        raise ValueError(f"decoder_attention_mask has shape {tuple(decoder_mask.shape)} but decoder_input_ids has "
                         f"{tuple(decoder_ids.shape)}")
    decoder_mask = decoder_mask.to(device=device, dtype=torch.int64)
    if decoder_ids.shape[1] == 0 or bool((decoder_ids[:, 0] != start[:, 0]).all()):
        decoder_ids = torch.cat([start, decoder_ids], dim=1)
        decoder_mask = torch.cat([torch.ones_like(start), decoder_mask], dim=1)
    if not bool(decoder_mask[:, -1].all()):
        raise ValueError("decoder_attention_mask must be 1 at the last decoder_input_ids position of every row")
    return decoder_ids, decoder_mask


@torch.inference_mode()
def _encode_both(model, draft_model, input_ids, attention_mask, encoder_outputs) -> dict:
    """id(model) -> encoder output. The draft reuses the target's when it is the same model or shares its encoder."""
    if encoder_outputs is None:
        encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
    encoded = {id(model): encoder_outputs}
    if draft_model is model or draft_model.get_encoder() is model.get_encoder():
        encoded[id(draft_model)] = encoder_outputs
    elif input_ids is None:
        raise ValueError("encoder_outputs alone cannot feed the draft's own encoder; pass input_ids as well")
    else:
        encoded[id(draft_model)] = draft_model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask,
                                                             return_dict=True)
    return encoded
