"""``DecoderRunner``: a decoder-only model over HF's dynamic cache, slot by slot, with holes instead of copies.

Each row's real slots are marked in ``slot_mask`` [B, S] (1 real, 0 a hole: left padding, a rejected draft, a
filler); position ids count real slots only, so a row with holes computes what it would alone. A rollback marks the
rejected slots as holes and cuts the slots no row needs off the end (a view); ``SlotCompactor`` squeezes the holes
out in bulk when they pass a threshold (``docs/batching.md``).
"""

import torch
from transformers import EncoderDecoderCache

from ..buffers import grow_columns
from ..capabilities import ModelSpec, slot_table_limit
from .attention_backends import without_cudnn_attention
from .dynamic_cache import CachedPrefix, RollbackCache, append_cache_rows, crop_cache
from .masks import attention_dtype, decoder_mask
from .slot_mask import SlotMaskRunner, accepts


class DecoderRunner(SlotMaskRunner):
    """A ``Runner`` for one decoder-only model on HF's dynamic cache.

    spec: from ``capabilities.check_model``; batch: B; max_slots: the slot mask's initial width (it grows as needed);
    compaction_threshold / compaction_backend: hole compaction for batch > 1 (``options.BatchingOptions``);
    prefix: the prompt's first P tokens, cached by the caller (``dynamic_cache.CachedPrefix``, built by
    ``prompt_cache.py``): the runner starts with them in its first P slots (a copy of their keys and values; holes
    where the prefix is left padding).
    """

    def __init__(self, model, spec: ModelSpec, batch: int, max_slots: int, device: torch.device, *,
                 compaction_threshold: float = 0.25, compaction_backend: str = "auto", reserve: int = 0,
                 prefix: CachedPrefix | None = None):
        super().__init__(batch, max_slots, device, compaction_threshold, compaction_backend)
        self.model, self.spec = model, spec
        self._flags = dict(spec.forward_flags)  # (capabilities.forward_flags: output_router_logits=False)
        self.cache: RollbackCache | None = None  # made by the first forward (a draft that never runs costs nothing)
        self._logits_to_keep = accepts(model, "logits_to_keep")
        self._dtype = attention_dtype(model)
        self._steps: dict[int, torch.Tensor] = {}  # T -> arange(T) (positions of an all-real forward)
        self._init_additive(spec, self._dtype)
        self._slot_limit = slot_table_limit(model)  # (GPT-Neo, MPT: transformers fails past it)
        if self._slot_limit is not None:  # a batch's holes are compacted away before an iteration would pass it
            self.capacity, self.reserve = self._slot_limit, reserve
        if prefix is not None:
            self._start_from(prefix)

    def _start_from(self, prefix: CachedPrefix) -> None:
        """Take the caller's cached prompt prefix as slots [0, P): its keys and values, its mask, its positions."""
        width = prefix.length
        self.cache = RollbackCache(self.model.config, prefix.layers)
        self._grow(width)
        self.slot_mask[:, :width] = prefix.real.to(torch.int64)
        self._mask_written(0, width)
        self.num_slots = width
        self.next_position = prefix.real.sum(dim=1)

    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False,
                prompt: bool = False):
        """Run tokens [B, T] at the next T slots; real [B, T] bool marks real tokens (None: all real).
        Returns logits [B, T, V] (or [B, 1, V] with last_only). prompt: (a chunk of) the prompts: its mask is built
        as ``_mask`` says (a pad and a filler are both holes)."""
        width = tokens.shape[1]
        start, end = self.num_slots, self.num_slots + width
        if self._slot_limit is not None and end > self._slot_limit:
            raise ValueError(f"{type(self.model).__name__} slices a table of {self._slot_limit} key positions with "
                             f"the cache's slot count, and this batch's cache reaches {end} slots (the rows' "
                             "prompts and tokens, the drafts a row near its end is verified with beside rows with "
                             "more left, and the holes rejected drafts leave until a compaction): lower "
                             "max_new_tokens, or decode these rows one at a time")
        self._grow(end)
        if real is None:  # the common case (every draft and verification step): no mask write, no cumsum
            # (slots past num_slots are 1 already; the position ids are read before next_position moves on)
            positions = self.next_position.unsqueeze(1)
            if width > 1:
                positions = positions + self._step_offsets(width)
        else:
            real_i = real.to(torch.int64)
            self.slot_mask[:, start:end] = real_i
            self._mask_written(start, end)
            positions = (self.next_position.unsqueeze(1) + real_i.cumsum(dim=1) - 1).clamp(min=0)
        mask = self._mask(start, end, all_real=real is None, prompt=prompt)
        kwargs = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        with without_cudnn_attention(tokens.device):  # (a new key length at every forward: no per-shape plans)
            out = self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                return_dict=True,  # (as model.generate: a config's return_dict=False would give tuples)
                **{self.spec.cache_argument: self.cache if self.cache is not None
                   else RollbackCache(self.model.config)},
                **kwargs,
                **self._flags,
            )
        self.cache = _self_attention_cache(getattr(out, self.spec.cache_argument))
        self.num_slots = end
        self.next_position += width if real is None else real_i.sum(dim=1)
        logits = out.logits
        return logits[:, -1:] if last_only else logits

    def _mask(self, start: int, end: int, all_real: bool, prompt: bool):
        """The attention mask of a forward at slots [start, end) whose real tokens slot_mask marks.

        The prompt's forward at slot 0 of an unpadded prompt (or its first chunk; ``prefill.prompt_real``) gets none
        where the model takes 4-D masks, as ``model.generate``'s prefill gets a 2-D mask of ones: transformers then
        builds the causal mask itself, or none (SDPA's causal kernel, GQA without copying K/V). The 4-D mask
        [B, 1, T, T] would cost T * T writes and keep SDPA on its masked kernel: several times slower over a long
        prompt. None, unlike a 2-D mask, is not read on the host to decide that. Other prompt forwards build their
        mask from slot_mask (not the cached causal blocks of the draft and verification widths)."""
        if all_real and not prompt:
            return self._real_mask(start, end)
        if all_real and start == 0 and self.spec.mask != "2d":
            return None
        query_slots = torch.arange(start, end, device=self.slot_mask.device)
        return decoder_mask(self.slot_mask[:, :end], query_slots, self.spec, self._dtype)

    def _real_mask(self, start: int, end: int):
        """The attention mask of a forward of real tokens at slots [start, end) (``masks.decoder_mask``'s value)."""
        if self._additive is None:
            return decoder_mask(self.slot_mask[:, :end], torch.arange(start, end, device=self.slot_mask.device),
                                self.spec, self._dtype)
        if end - start == 1:  # one query sees every slot so far: the mirror itself
            return self._additive[:, None, None, :end]
        return self._additive_mask(start, end)

    def _grow(self, end: int) -> None:
        self.slot_mask = grow_columns(self.slot_mask, end, fill=1)
        if self._additive is not None:
            self._additive = grow_columns(self._additive, end, fill=0.0)

    def _step_offsets(self, width: int) -> torch.Tensor:
        """arange(width) [1, T] on the runner's device, built once per width."""
        offsets = self._steps.get(width)
        if offsets is None:
            offsets = self._steps[width] = torch.arange(width, device=self.slot_mask.device).unsqueeze(0)
        return offsets

    def kv_tensors(self, num_slots: int) -> list[torch.Tensor]:
        """Every layer's K and V restricted to the first ``num_slots`` slots ([B, H, num_slots, D] views)."""
        layers = self.cache.layers if self.cache is not None else []
        return [t[:, :, :num_slots] for layer in layers if layer.keys is not None and layer.keys.numel()
                for t in (layer.keys, layer.values)]

    def truncate(self, num_slots: int) -> None:
        """Drop every slot at index >= num_slots (no row may still need them)."""
        if num_slots < self.num_slots:
            crop_cache(self.cache, num_slots)
            self._reset_tail(num_slots)
            self.num_slots = num_slots

    def _select_cache_rows(self, index: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.batch_select_indices(index)

    def _add_cache_rows(self, other: "DecoderRunner", pad: int, other_pad: int) -> None:
        self.cache = append_cache_rows(self.cache, self.slot_mask.shape[0], pad, other.cache,
                                       other.slot_mask.shape[0], other_pad)


def _self_attention_cache(cache):
    """The cache a decoder-only forward returned, unwrapped where the model wrapped ours in an EncoderDecoderCache
    with an empty cross-attention side (BLIP's text decoder does so whether or not encoder states are given): the
    self-attention cache is what the runner rolls back; the next forward wraps it again."""
    cross = getattr(cache, "cross_attention_cache", None)
    if isinstance(cache, EncoderDecoderCache) and cross is not None and cross.get_seq_length() == 0:
        return cache.self_attention_cache
    return cache
