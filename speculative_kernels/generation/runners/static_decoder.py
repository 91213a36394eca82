"""``StaticDecoderRunner``: a decoder-only model over a preallocated ``SlotCache``, with steps that can be captured.
Its buffers may hold more rows than the batch (continuous batching: rows join and leave in place).

As on the dynamic cache, every row writes the same slots and ``slot_mask`` [B, C] marks the real ones. A rollback is
a mask write and a move of the cache's write pointer (stale K/V past it is masked, then overwritten). The forward
uses device-side indices only (pointer, positions, mask), so one captured graph per width serves every step.
"""

import functools
from collections.abc import Sequence

import torch

from ..capabilities import ModelSpec
from ..options import CompileOptions
from .attention_backends import without_cudnn_attention
from .captured import call_captured, compile_step, mark_static
from .compaction import SlotCompactor
from .masks import attention_dtype, decoder_mask
from .slot_cache import CacheLayout, SlotCache
from .slot_mask import SlotMaskRunner, accepts


class StaticDecoderRunner(SlotMaskRunner):
    """A ``CapturableRunner`` for one decoder-only model.

    spec: its static-path spec (``capabilities.check_model``); batch: B; capacity: C cache slots
    (``sizing.static_capacity``); reserve: the most slots one iteration writes (gamma + 1), kept free by compacting
    early; compaction_threshold / compaction_backend: see ``options.BatchingOptions``; rows: rows allocated (default
    B). Every per-row buffer (K/V ``[rows, H_kv, C, D]``, ``slot_mask`` / its additive mirror ``[rows, C]``,
    ``next_position`` ``[rows]``) is allocated once, and the batch's rows are its first B (views): rows leaving are
    moved to the front in place (``select_rows``), rows joining are copied into the free rows (``add_rows``, up to
    ``rows``: continuous batching on the static cache).
    """

    def __init__(self, model, spec: ModelSpec, batch: int, capacity: int, device: torch.device, *, reserve: int = 0,
                 compaction_threshold: float = 0.25, compaction_backend: str = "auto", rows: int | None = None):
        self.resizable = rows is not None  # rows join and leave in place: the batch size changes
        rows = batch if rows is None else rows
        if rows < batch:
            raise ValueError(f"rows ({rows}) must be at least the batch ({batch})")
        super().__init__(rows, capacity, device, compaction_threshold, compaction_backend)  # slot_mask [rows, C]
        self.compactor = SlotCompactor(batch, compaction_threshold, compaction_backend)
        self.model, self.spec = model, spec
        self._flags = dict(spec.forward_flags)  # (capabilities.forward_flags: output_router_logits=False)
        self.cache = SlotCache(CacheLayout.of(model, spec), batch, capacity, device, rows=rows)
        self.capacity, self.reserve = capacity, reserve  # (num_slots: the host copy of the write pointer)
        self._logits_to_keep = accepts(model, "logits_to_keep")
        self._dtype = attention_dtype(model)
        self._compiled = {}  # (width, last_only) -> compiled step
        self._warm_sizes: set[int] = set()  # batch sizes whose captured steps have all been warmed up
        self._steps: dict[int, torch.Tensor] = {}  # T -> arange(T) [1, T]
        self._ones: dict[torch.Size, torch.Tensor] = {}  # [B, T] -> ones
        self._init_additive(spec, self._dtype)
        self._rows = (self.slot_mask, self._additive, self.next_position)  # as allocated: [rows, C], [rows, C], [rows]
        self._views: dict[int, tuple] = {}  # B -> the views of the first B rows (one set per B: see _use_rows)
        self._use_rows(batch)

    @property
    def rows(self) -> int:
        """Rows allocated: the most the batch can hold."""
        return self._rows[0].shape[0]

    def _use_rows(self, batch: int) -> None:
        """The batch is the first ``batch`` allocated rows: every per-row state becomes a view of them (made once
        per batch size). With captured steps the views are marked as static addresses: the steps write them in place,
        and a CUDA graph records no copy of them (an input written in place that is not static makes inductor skip
        the CUDA graph). A view of B rows starts where the buffer does, so each batch size has one address."""
        views = self._views.get(batch)
        if views is None:
            mask, additive, positions = self._rows
            views = self._views[batch] = (mask[:batch], None if additive is None else additive[:batch],
                                          positions[:batch])
        self.slot_mask, self._additive, self.next_position = views
        self.cache.use_rows(batch)
        if self._compiled:
            mark_static(self._static_tensors())

    def _static_tensors(self) -> tuple[torch.Tensor, ...]:
        """What the captured step reads and writes in place: the mask, positions, write pointer and K/V in use."""
        return (self.slot_mask, self.next_position, self.cache.position, *self.cache.tensors())

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False,
                prompt: bool = False):
        """Run tokens [B, T] at the next T slots; real [B, T] bool marks real tokens (None: all real).
        Returns logits [B, T, V] (or [B, 1, V] with last_only). prompt: (a chunk of) the prompts, whose mask is
        built from slot_mask (a pad and a filler are both holes). Eager forwards attend to the slots written so far
        only (``_eager_step``); captured ones to all C slots (fixed shapes)."""
        width = tokens.shape[1]
        if self.num_slots + width > self.capacity:
            raise RuntimeError(f"static cache exhausted ({self.num_slots + width} > {self.capacity} slots)")
        if self._compiled and tokens.shape[0] not in self._warm_sizes:  # a batch size new to the captured steps
            self.warm_up()
        compiled = self._compiled.get((width, last_only))
        if compiled is None and width and self.spec.mask != "2d":  # (see _eager_step)
            with without_cudnn_attention(tokens.device), self.cache.reading(self.num_slots + width):
                logits = self._eager_step(tokens, real, last_only, prompt)
        else:
            real_i = self._all_real(tokens.shape) if real is None else real.to(torch.int64)
            if compiled is not None:  # (captured: its shapes are fixed; the backend is the one it was captured with)
                logits = call_captured(compiled, tokens, real_i)
            else:  # ('2d' masks: the slot mask [B, C] over all C slots)
                with without_cudnn_attention(tokens.device):
                    logits = self._step(tokens, real_i, last_only)
        if real is not None:
            self._mask_written(self.num_slots, self.num_slots + width)
        self.num_slots += width
        return logits

    def _eager_step(self, tokens: torch.Tensor, real: torch.Tensor | None, last_only: bool, prompt: bool
                    ) -> torch.Tensor:
        """A forward that is not captured, inside ``cache.reading(num_slots + T)``: the attention reads the slots
        written so far and these T only, never the unwritten rest of the cache, and its mask spans those slots
        (the columns past them were all masked: every real query attends to the same slots as over all C).

        An unpadded prompt's forward at slot 0 (or its first chunk; ``prefill.prompt_real`` gives real=None) then
        sees exactly what the dynamic cache's first forward sees, T keys, and gets no mask, as there
        (``DecoderRunner._mask``): the model's mask code makes it causal (SDPA's causal kernel, GQA without copying
        K/V), as ``model.generate``'s static prefill does. A mask [B, 1, T, C] over the whole cache costs T * C
        writes and SDPA's masked kernel over all C keys (about three times the prefill at T = 4000). A forward of
        real tokens past the prompt (draft and verification steps) joins the additive mirror to a cached causal
        block (``_additive_mask``); the rest (left padding, a later prompt chunk, fillers, sliding windows) get
        ``decoder_mask`` from slot_mask."""
        start, end = self.num_slots, self.num_slots + tokens.shape[1]
        if real is None and prompt and start == 0:
            return self._real_step(tokens, None, last_only)
        if real is None and not prompt and self._additive is not None:  # (not a prompt's: no cached causal
            # block of its width)
            return self._real_step(tokens, self._additive_mask(start, end), last_only)
        real_i = self._all_real(tokens.shape) if real is None else real.to(torch.int64)
        return self._step(tokens, real_i, last_only, read=end)

    def _real_step(self, tokens: torch.Tensor, mask: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        """Eager ``_step`` for real tokens only, with host slot numbers: no mask write (the slots past num_slots are
        1), the positions next_position + [0, T); mask: [B, 1, T, S] from the additive mirror (``_additive_mask``),
        or None (the model's own causal mask: ``_eager_step``)."""
        width = tokens.shape[1]
        positions = self.next_position.unsqueeze(1)
        if width > 1:
            positions = positions + self._step_offsets(width)
        kwargs = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                         return_dict=True, **{self.spec.cache_argument: self.cache}, **kwargs, **self._flags)
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

    def _step(self, tokens: torch.Tensor, real_i: torch.Tensor, last_only: bool, read: int | None = None
              ) -> torch.Tensor:
        """The captured part: mask/position bookkeeping with device indices, the model forward, pointer advance.
        read: the key slots the attention reads (host int, eager only: inside ``cache.reading(read)``); None: all C."""
        width = tokens.shape[1]
        slots = self.cache.position + torch.arange(width, device=tokens.device)  # [T]
        self.slot_mask.index_copy_(1, slots, real_i)
        positions = (self.next_position.unsqueeze(1) + real_i.cumsum(dim=1) - 1).clamp(min=0)
        kwargs = {"logits_to_keep": 1} if last_only and self._logits_to_keep else {}
        slot_mask = self.slot_mask if read is None else self.slot_mask[:, :read]
        out = self.model(
            input_ids=tokens,
            attention_mask=decoder_mask(slot_mask, slots, self.spec, self._dtype),
            position_ids=positions,
            use_cache=True,
            return_dict=True,
            **{self.spec.cache_argument: self.cache},
            **kwargs,
            **self._flags,
        )
        self.next_position.add_(real_i.sum(dim=1))
        self.cache.position.add_(width)
        logits = out.logits
        return logits[:, -1:] if last_only else logits

    # ------------------------------------------------------------------------------------------ capture
    def capture(self, shapes: Sequence[tuple[int, bool]], options: CompileOptions) -> None:
        """Compile the step at each (width, last_only). When the batch size changes (rows joining or leaving in
        place), the steps are compiled with dynamo's automatic dynamic shapes unless ``options.dynamic`` says
        otherwise: the second batch size compiles a graph with a symbolic batch that serves every later one (on
        CUDA a CUDA graph is still recorded per size)."""
        for width, last_only in shapes:
            self._compiled[(width, last_only)] = compile_step(functools.partial(self._step, last_only=last_only),
                                                              options, self.slot_mask.device, self._static_tensors(),
                                                              batch_changes=self.resizable)

    def warm_up(self, calls: int = 3) -> None:
        """Run every captured step ``calls`` times on filler tokens and roll each back (compiles, records CUDA
        graphs). Done at capture and again before the first step at each new batch size, so that all of a batch
        size's compilation happens at once, before its first real step (each step fits: the loop keeps its widest
        free at every iteration)."""
        start, positions = self.num_slots, self.next_position.clone()
        batch = self.slot_mask.shape[0]
        self._warm_sizes.add(batch)
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

    def _select_cache_rows(self, index: torch.Tensor) -> None:  # the base class's paths, replaced here
        raise AssertionError("select_rows moves the rows in place")

    def _add_cache_rows(self, other: "StaticDecoderRunner", pad: int, other_pad: int) -> None:
        raise AssertionError("add_rows copies the rows in place")

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` ([B'] int64, increasing, < B): they move to the front of every allocated buffer, in
        place (one transient copy of B' rows of one buffer at a time); the buffers keep their size. With no rows
        left, the write pointer goes back to 0."""
        batch = index.shape[0]
        for full in (*self.cache.buffers(), *self._rows):
            if full is not None:
                full[:batch].copy_(full.index_select(0, index))
        self._use_rows(batch)
        if batch == 0:  # no rows left: every slot is free again
            self.truncate(0)
        self.compactor.select_rows(batch, holes=self.real_from > 0)

    def check_add_rows(self, other: "StaticDecoderRunner") -> None:
        """ValueError, with nothing changed, unless ``add_rows(other)`` fits: the same kind, model and mask kind,
        the allocated rows, and the slots (with an iteration's reserve)."""
        super().check_add_rows(other)
        batch, joining = self.slot_mask.shape[0], other.slot_mask.shape[0]
        if batch + joining > self.rows:
            raise ValueError(f"cannot add {joining} rows to a static cache of {batch} rows allocated for {self.rows}")
        slots = max(self.num_slots, other.num_slots)
        if slots + self.reserve > self.capacity:
            raise ValueError(f"cannot add rows holding {other.num_slots} slots to a static cache of {self.capacity} "
                             f"slots ({self.num_slots} in use, {self.reserve} kept free for an iteration)")

    def add_rows(self, other: "StaticDecoderRunner") -> None:
        """Append the rows of ``other`` (a static runner of the same model over its own rows, e.g. requests prefilled
        and stepped on their own; consumed) after this runner's B rows: its K/V, slot mask and positions are copied
        into the free allocated rows [B, B + B2), aligned at the shared write pointer. The side with fewer slots gets
        holes on the left: the joining rows' slots are written after masked slots, or, when they hold more, the
        running rows are first moved right within their rows (one transient copy of one buffer at a time).
        Raises ValueError, with nothing changed, when the rows or the slots do not fit (``check_add_rows``)."""
        self.check_add_rows(other)
        batch, joining = self.slot_mask.shape[0], other.slot_mask.shape[0]
        slots = max(self.num_slots, other.num_slots)
        self._shift_right(slots - self.num_slots)
        pad, end = slots - other.num_slots, batch + joining
        for mine, theirs in zip(self.cache.buffers(), other.cache.tensors()):
            mine[batch:end, :, pad:slots].copy_(theirs[:, :, : other.num_slots])
        mask, additive, positions = self._rows
        mask[batch:end, :pad] = 0
        mask[batch:end, pad:slots] = other.slot_mask[:, : other.num_slots]
        mask[batch:end, slots:] = 1
        if additive is not None:
            additive[batch:end, :pad] = -torch.finfo(additive.dtype).max  # as ``_mask_written`` writes a hole
            additive[batch:end, pad:slots] = other._additive[:, : other.num_slots]
            additive[batch:end, slots:] = 0
        positions[batch:end] = other.next_position
        self.real_from = max(self.real_from, other.real_from + pad)  # slots from there on are 1 in every row
        self._use_rows(end)
        self.compactor.select_rows(end, holes=self.real_from > 0)

    def _shift_right(self, shift: int) -> None:
        """Move the B rows' ``num_slots`` used slots right by ``shift`` (holes before them); the pointer follows."""
        if shift == 0:
            return
        used, end = self.num_slots, self.num_slots + shift
        for t in self.cache.tensors():
            t[:, :, shift:end].copy_(t[:, :, :used].clone())
        self.slot_mask[:, shift:end] = self.slot_mask[:, :used].clone()
        self.slot_mask[:, :shift] = 0
        if self._additive is not None:
            self._additive[:, shift:end] = self._additive[:, :used].clone()
            self._additive[:, :shift] = -torch.finfo(self._additive.dtype).max
        self.real_from = self.real_from + shift if self.slot_mask.shape[0] else 0  # (no rows: no holes)
        self.num_slots = end
        self.cache.position.fill_(end)
