"""``StaticDecoderRunner``: a decoder-only model over a preallocated ``SlotCache``, with steps that can be captured.

As on the dynamic cache, every row writes the same slots and ``slot_mask`` [B, C] marks the real ones. A rollback is
a mask write and a move of the cache's write pointer (stale K/V past it is masked, then overwritten). The forward
uses device-side indices only (pointer, positions, mask), so one captured graph per width serves every step.
"""

import functools
from collections.abc import Sequence

import torch

from ..capabilities import ModelSpec
from ..options import CompileOptions
from .captured import call_captured, compile_step
from .masks import decoder_mask
from .slot_cache import CacheLayout, SlotCache
from .slot_mask import SlotMaskRunner, accepts


class StaticDecoderRunner(SlotMaskRunner):
    """A ``CapturableRunner`` for one decoder-only model.

    spec: its static-path spec (``capabilities.check_model``); batch: B; capacity: C cache slots
    (``sizing.static_capacity``); reserve: the most slots one iteration writes (gamma + 1), kept free by compacting
    early; compaction_threshold / compaction_backend: see ``options.BatchingOptions``.
    """

    def __init__(self, model, spec: ModelSpec, batch: int, capacity: int, device: torch.device, *, reserve: int = 0,
                 compaction_threshold: float = 0.25, compaction_backend: str = "auto"):
        super().__init__(batch, capacity, device, compaction_threshold, compaction_backend)  # slot_mask [B, C]
        self.model, self.spec = model, spec
        self.cache = SlotCache(CacheLayout.of(model, spec), batch, capacity, device)
        self.capacity, self.reserve = capacity, reserve  # (num_slots: the host copy of the write pointer)
        self._logits_to_keep = accepts(model, "logits_to_keep")
        self._dtype = next(model.parameters()).dtype
        self._compiled = {}  # (width, last_only) -> compiled step
        self._steps: dict[int, torch.Tensor] = {}  # T -> arange(T) [1, T]
        self._ones: dict[torch.Size, torch.Tensor] = {}  # [B, T] -> ones
        self._init_additive(spec, self._dtype)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False):
        """Run tokens [B, T] at the next T slots; real [B, T] bool marks real tokens (None: all real).
        Returns logits [B, T, V] (or [B, 1, V] with last_only)."""
        width = tokens.shape[1]
        if self.num_slots + width > self.capacity:
            raise RuntimeError(f"static cache exhausted ({self.num_slots + width} > {self.capacity} slots)")
        compiled = self._compiled.get((width, last_only))
        if compiled is None and real is None and self._additive is not None:
            logits = self._real_step(tokens, last_only)
        else:
            real_i = self._all_real(tokens.shape) if real is None else real.to(torch.int64)
            if compiled is not None:
                logits = call_captured(compiled, tokens, real_i)
            else:
                logits = self._step(tokens, real_i, last_only)
            if real is not None:
                self._mask_written(self.num_slots, self.num_slots + width)
        self.num_slots += width
        return logits

    def _real_step(self, tokens: torch.Tensor, last_only: bool) -> torch.Tensor:
        """Eager ``_step`` for real tokens only, with host slot numbers: no mask write (the slots past num_slots are
        1), the positions next_position + [0, T), the mask from the additive mirror (``_additive_mask``)."""
        width = tokens.shape[1]
        start = self.num_slots
        positions = self.next_position.unsqueeze(1)
        if width > 1:
            positions = positions + self._step_offsets(width)
        mask = self._additive_mask(start, start + width, self.capacity)
        kwargs = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True, **kwargs)
        self.next_position.add_(width)
        self.cache.position.add_(width)
        logits = out.logits
        return logits[:, -1:] if last_only else logits

    def _all_real(self, shape: torch.Size) -> torch.Tensor:
        """ones [B, T] int64 (the real flags of a forward of real tokens), made once per shape (read-only)."""
        ones = self._ones.get(shape)
        if ones is None:
            ones = self._ones[shape] = torch.ones(shape, dtype=torch.int64, device=self.slot_mask.device)
        return ones

    def _step_offsets(self, width: int) -> torch.Tensor:
        """arange(width) [1, T] on the runner's device, built once per width."""
        offsets = self._steps.get(width)
        if offsets is None:
            offsets = self._steps[width] = torch.arange(width, device=self.slot_mask.device).unsqueeze(0)
        return offsets

    def _step(self, tokens: torch.Tensor, real_i: torch.Tensor, last_only: bool) -> torch.Tensor:
        """The captured part: mask/position bookkeeping with device indices, the model forward, pointer advance."""
        width = tokens.shape[1]
        slots = self.cache.position + torch.arange(width, device=tokens.device)  # [T]
        self.slot_mask.index_copy_(1, slots, real_i)
        positions = (self.next_position.unsqueeze(1) + real_i.cumsum(dim=1) - 1).clamp(min=0)
        kwargs = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        out = self.model(
            input_ids=tokens,
            attention_mask=decoder_mask(self.slot_mask, slots, self.spec, self._dtype),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        self.next_position.add_(real_i.sum(dim=1))
        self.cache.position.add_(width)
        logits = out.logits
        return logits[:, -1:] if last_only else logits

    # ------------------------------------------------------------------------------------------ capture
    def capture(self, shapes: Sequence[tuple[int, bool]], options: CompileOptions) -> None:
        static = (self.slot_mask, self.next_position, self.cache.position, *self.cache.tensors())
        for width, last_only in shapes:
            self._compiled[(width, last_only)] = compile_step(functools.partial(self._step, last_only=last_only),
                                                              options, self.slot_mask.device, static)

    def warm_up(self, calls: int = 3) -> None:
        start, positions = self.num_slots, self.next_position.clone()
        batch = self.slot_mask.shape[0]
        for width, last_only in self._compiled:
            tokens = torch.zeros(batch, width, dtype=torch.int64, device=self.slot_mask.device)
            for _ in range(calls):
                self.forward(tokens, None, last_only)
                self.truncate(start)
                self.next_position.copy_(positions)

    # ------------------------------------------------------------------------------------------ rollback
    def truncate(self, num_slots: int) -> None:
        """Drop every slot at index >= num_slots (no row may still need them): a mask write and a pointer move."""
        if num_slots < self.num_slots:
            self._reset_tail(num_slots)
            self.num_slots = num_slots
            self.cache.position.fill_(num_slots)

    def kv_tensors(self, num_slots: int) -> list[torch.Tensor]:
        return [t[:, :, :num_slots] for t in self.cache.tensors()]

    def _select_cache_rows(self, index: torch.Tensor) -> None:
        self.cache.select_rows(index)

    def _add_cache_rows(self, other: "StaticDecoderRunner", pad: int, other_pad: int) -> None:
        raise NotImplementedError("rows cannot join a StaticDecoderRunner: its SlotCache is allocated for a fixed "
                                  "batch (continuous batching runs on the dynamic cache)")
