"""Drive one decoder-only HF model slot by slot, with holes instead of copies.

Every row of the batch writes the same KV-cache slots at each forward (``num_slots`` is shared), so the cache stays
a plain rectangular HF cache. What differs per row is which slots are real: ``slot_mask`` [B, max_slots] holds 1 for
a slot a row attends to and 0 for a hole (left padding, a rejected draft token, a filler token). Position ids run
per row over real slots only, exactly as HF numbers a left-padded batch, so a row with holes computes what it would
compute without them.

Rollback after verification is O(1): the rejected slots of a row become holes (a mask write), and the slots no row
needs any more at the end are cut off by shrinking the cache's length (``crop``), a view, not a copy. Holes in the
middle cost attention work only; ``compact`` squeezes them out when they pass a threshold (batch > 1).
"""

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .cache_ops import crop_cache
from .capabilities import ModelSpec, check_model
from .compaction import SlotCompactor


def _accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


class DecoderRunner:
    """One decoder-only model with its KV cache, slot mask and per-row positions.

    model: an HF causal LM; batch: B; max_slots: the slot mask's initial width (it grows as needed);
    compaction_threshold / compaction_backend: hole compaction for batch > 1 (``compaction.py``).
    """

    def __init__(self, model, batch: int, max_slots: int, device: torch.device, *,
                 compaction_threshold: float = 0.25, compaction_backend: str = "auto"):
        self.model = model
        self.spec: ModelSpec = check_model(model, path="dynamic", batch=batch)
        self.cache = RollbackCache(model.config)
        self.slot_mask = torch.zeros(batch, max_slots, dtype=torch.int64, device=device)
        self.num_slots = 0
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self._logits_to_keep = _accepts(model, "logits_to_keep")
        self._attention = getattr(model.config, "_attn_implementation", None)
        self._dtype = next(model.parameters()).dtype
        # additive mask value by slot-mask value (0: hole, 1: real); indexing with the slot mask builds the mask
        self._mask_values = torch.tensor([torch.finfo(self._dtype).min, 0.0], dtype=self._dtype, device=device)
        self._steps: dict[int, torch.Tensor] = {}  # T -> arange(T) (positions of an all-real forward)
        self.compactor = SlotCompactor(batch, compaction_threshold, compaction_backend)

    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None, last_only: bool = False):
        """Run tokens [B, T] at the next T slots; real [B, T] bool marks real tokens (None: all real).

        Returns logits [B, T, V] (or [B, 1, V] with last_only).
        """
        batch, width = tokens.shape
        start, end = self.num_slots, self.num_slots + width
        self.slot_mask = grow_columns(self.slot_mask, end)
        if real is None:  # the common case, kept cheap: no cumsum, no per-row count
            self.slot_mask[:, start:end] = 1
            positions = self.next_position.unsqueeze(1) + self._step_offsets(width)
        else:
            real_i = real.to(torch.int64)
            self.slot_mask[:, start:end] = real_i
            positions = (self.next_position.unsqueeze(1) + real_i.cumsum(dim=1) - 1).clamp(min=0)
        kwargs = {}
        if last_only and self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=tokens,
            attention_mask=self.attention_mask(start, end),
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        self.cache = out.past_key_values
        self.num_slots = end
        self.next_position += width if real is None else real_i.sum(dim=1)
        logits = out.logits
        return logits[:, -1:] if last_only else logits

    def attention_mask(self, start: int, end: int):
        """The mask for queries at slots [start, end): an additive 4-D mask [B, 1, T, end] (causal over slots and
        the slot mask), which HF uses as given. Passing the 2-D mask instead would make HF read it on the host at
        every forward to decide whether it can skip masking; attention kernels that take no 4-D mask (flash
        attention) and ALiBi models (which build their bias from it, ``capabilities.py``) get the 2-D mask.
        Sliding-window layers get the window applied over real positions (``window_mask``); models that mix full
        and sliding layers get a dict of both masks keyed by layer type."""
        if self._attention not in ("sdpa", "eager") or self.spec.mask == "2d":
            return self.slot_mask[:, :end]
        slot_mask = self.slot_mask[:, :end]
        if end - start == 1:  # a single query sees every earlier slot: only the slot mask matters
            allowed = slot_mask[:, None, :].bool()  # [B, 1, S]
        else:
            query_slots = torch.arange(start, end, device=self.slot_mask.device).unsqueeze(1)
            causal = torch.arange(end, device=self.slot_mask.device).unsqueeze(0) <= query_slots  # [T, S]
            allowed = causal.unsqueeze(0) & slot_mask[:, None, :].bool()  # [B, T, S]
        full = self._mask_values[allowed.unsqueeze(1).to(torch.int64)]
        if self.spec.sliding_window is None:
            return full
        windowed = allowed & window_mask(slot_mask, torch.arange(start, end, device=slot_mask.device),
                                         self.spec.sliding_window)
        sliding = self._mask_values[windowed.unsqueeze(1).to(torch.int64)]
        if self.spec.mask == "4d-by-layer-type":
            return {"full_attention": full, "sliding_attention": sliding}
        return sliding

    def _step_offsets(self, width: int) -> torch.Tensor:
        """arange(width) [1, T] on the runner's device, built once per width."""
        offsets = self._steps.get(width)
        if offsets is None:
            offsets = self._steps[width] = torch.arange(width, device=self.slot_mask.device).unsqueeze(0)
        return offsets

    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int) -> None:
        """Of the last ``width`` slots, row b keeps its first kept[b] real ones; the rest become holes.

        kept: [B] int64 on device; max_kept: max over rows (host int), so the trailing slots nobody keeps are cut.
        """
        start = hole_rejected_slots(self.slot_mask, self.next_position, self.num_slots, width, kept)
        self.truncate(start + max_kept)
        self.compactor.maybe_compact(self)

    def kv_tensors(self, num_slots: int) -> list[torch.Tensor]:
        """Every layer's K and V restricted to the first ``num_slots`` slots ([B, H, num_slots, D] views)."""
        return [t[:, :, :num_slots] for layer in self.cache.layers if layer.keys is not None and layer.keys.numel()
                for t in (layer.keys, layer.values)]

    def select_cache_rows(self, index: torch.Tensor) -> None:
        self.cache.batch_select_indices(index)

    def truncate(self, num_slots: int) -> None:
        """Drop every slot at index >= num_slots (no row may still need them)."""
        if num_slots < self.num_slots:
            crop_cache(self.cache, num_slots)
            self.slot_mask[:, num_slots : self.num_slots] = 0
            self.num_slots = num_slots


def grow_columns(mask: torch.Tensor, width: int) -> torch.Tensor:
    """mask [B, M] with at least ``width`` columns: doubled (zeros appended) when too narrow, so growing to any
    length costs amortised O(1) per slot. (Runners that are captured by torch.compile size theirs up front.)"""
    if width <= mask.shape[1]:
        return mask
    return torch.cat([mask, mask.new_zeros(mask.shape[0], max(width, 2 * mask.shape[1]) - mask.shape[1])], dim=1)
class RollbackCache(DynamicCache):
    """HF's ``DynamicCache(config=...)`` with every sliding-window layer replaced by a full ``DynamicLayer``.

    A sliding-window layer evicts keys older than its window, and a rollback could not bring back what a rejected
    draft pushed out; keeping every slot lets a rollback cut the tail as for full attention, while the window itself
    is applied by the runner's masks (``window_mask``). Memory grows as for full attention. Other layer kinds
    (cache-less layers of MoE-only or KV-sharing models) stay as HF builds them; ``capabilities.check_model`` refuses
    the kinds a rollback cannot handle before this is built.
    """

    def __init__(self, config):
        super().__init__(config=config)
        self.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                       for layer in self.layers]


def window_mask(slot_mask: torch.Tensor, query_slots: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T, S] bool: the key at slot s is inside the sliding window of the query at slot query_slots[t].

    slot_mask: [B, S] (1 = real slot); query_slots: [T]. Real slots of a row carry positions 0, 1, 2, ... in slot
    order (holes take none), so a slot's position is the count of real slots up to it, minus one; HF's rule is
    q - k < window over positions (cache positions in HF, which differ from these by the row's left padding only).
    """
    positions = slot_mask.cumsum(dim=1)  # [B, S]: position + 1 at real slots
    query = positions.index_select(1, query_slots)  # [B, T]
    return (query.unsqueeze(2) - positions.unsqueeze(1)) < window


def hole_rejected_slots(slot_mask: torch.Tensor, next_position: torch.Tensor, num_slots: int, width: int,
                        kept: torch.Tensor) -> int:
    """In place: of the last ``width`` of ``num_slots`` slots, row b keeps its first kept[b]; the rest become holes
    (slot_mask [B, S] set to 0) and next_position [B] moves back by the real tokens dropped. kept: [B] int64 on
    device. Returns the first slot of the window (host int). No host synchronisation."""
    start = num_slots - width
    offsets = torch.arange(width, device=kept.device).unsqueeze(0)
    window = slot_mask[:, start:num_slots]
    dropped_real = (window * (offsets >= kept.unsqueeze(1))).sum(dim=1)
    window.mul_((offsets < kept.unsqueeze(1)).to(window.dtype))
    next_position -= dropped_real
    return start
