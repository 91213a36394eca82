"""What the two decoder-only runners share: each row's real slots marked in a slot mask (holes at 0), rollback by
mask writes, per-row positions, hole compaction fed by the loop's host read, and rows leaving (``select_rows``) or
joining (``add_rows``: the shorter side's slots padded on the left with holes)."""

import abc
import inspect

import torch

from ..capabilities import ModelSpec
from .compaction import SlotCompactor
from .masks import additive_mask


def accepts(model, name: str) -> bool:
    """Whether ``model.forward`` takes the keyword ``name``."""
    return name in inspect.signature(model.forward).parameters


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


def _left_padded(mask: torch.Tensor, used: int, pad: int, width: int, fill, pad_fill) -> torch.Tensor:
    """mask [B, M]'s first ``used`` columns moved right by ``pad`` (``pad_fill`` before them, ``fill`` after), in a
    new [B, width] tensor."""
    out = mask.new_full((mask.shape[0], width), fill)
    out[:, :pad] = pad_fill
    out[:, pad : pad + used] = mask[:, :used]
    return out


class SlotMaskRunner(abc.ABC):
    """Base of the decoder-only runners: ``slot_mask`` [B, S] int64 (1 real, 0 hole), ``next_position`` [B] (each
    row's real slots: its next position), ``num_slots`` (host int) and a ``SlotCompactor``. Subclasses own the cache:
    ``truncate``, ``kv_tensors``, ``_select_cache_rows``, ``_add_cache_rows``; ``reserve``/``capacity`` bound a
    preallocated cache.

    Slots no forward has written yet are 1 in ``slot_mask``, so a forward of real tokens (``real=None``, every draft
    and verification step) writes no mask. ``real_from`` (host int) keeps that cheap: every slot at index >= real_from
    is 1; writes of holes raise it, and ``_reset_tail`` sets the slots a rollback cuts back to 1.
    """

    reserve: int = 0
    capacity: int | None = None

    def __init__(self, batch: int, slots: int, device: torch.device, compaction_threshold: float,
                 compaction_backend: str):
        self.slot_mask = torch.ones(batch, slots, dtype=torch.int64, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.num_slots = 0
        self.real_from = 0
        self.compactor = SlotCompactor(batch, compaction_threshold, compaction_backend)
        self._additive = None

    def _init_additive(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        """Keep the additive mask of the slots beside slot_mask (0 real, dtype's minimum a hole) for models that take
        a plain 4-D mask: a forward of real tokens then joins its slice to a cached causal block (``_additive_mask``)
        instead of building the mask from slot_mask. Slots past num_slots are 0 in it, as they are 1 in slot_mask."""
        if spec.mask == "2d" or spec.sliding_window is not None:
            return
        self._additive = torch.zeros(self.slot_mask.shape, dtype=dtype, device=self.slot_mask.device)
        self._causal: dict[int, torch.Tensor] = {}  # T -> [1, 1, T, T] additive, causal

    def _additive_mask(self, start: int, end: int) -> torch.Tensor:
        """[B, 1, T, end] additive mask of T = end - start real queries at slots [start, end) over key slots
        [0, end): the mirror for the slots before start, causal among the queries."""
        queries = end - start
        block = self._causal.get(queries)
        if block is None:
            allowed = torch.ones(queries, queries, dtype=torch.bool, device=self.slot_mask.device).tril()
            block = self._causal[queries] = additive_mask(allowed.unsqueeze(0), self._additive.dtype)
        batch = self.slot_mask.shape[0]
        prefix = self._additive[:, None, None, :start].expand(batch, 1, queries, start)
        # (not under a caller's autocast: CPU autocast to bfloat16 fails on a cat of float16 masks)
        with torch.autocast(self.slot_mask.device.type, enabled=False):
            return torch.cat([prefix, block.expand(batch, 1, queries, queries)], dim=-1)

    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int, kept_host: list[int] | None = None) -> None:
        """Of the last ``width`` slots, row b keeps its first kept[b] real ones; the rest become holes and the
        trailing slots no row keeps are cut. Then compacts when that frees more than the threshold's share
        (``SlotCompactor.due``), or when the next iteration (``reserve`` slots) would not fit in ``capacity``.
        kept_host: kept on the host, when the caller
        has it: when every row keeps the same count of slots that are all real, the rollback is a cut (no holes)."""
        start = self.num_slots - width
        cut = start + max_kept
        if kept_host is not None and min(kept_host) == max_kept and self.real_from <= cut:
            if cut < self.num_slots:  # every dropped slot is real: each row's position moves back by as many
                self.next_position -= self.num_slots - cut
        else:
            hole_rejected_slots(self.slot_mask, self.next_position, self.num_slots, width, kept)
            self._mask_written(start, self.num_slots)
        self.truncate(cut)
        target = self.compactor.due(self.num_slots, self.reserve, self.capacity)
        if target is not None:
            self.compactor.compact(self.kv_tensors(self.num_slots), self.slot_mask[:, : self.num_slots])
            self._mask_written(0, self.num_slots)
            self.truncate(target)

    def _mask_written(self, start: int, end: int) -> None:
        """slot_mask[:, start:end] was written (holes possible): keep ``real_from`` and the additive mirror."""
        self.real_from = max(self.real_from, end)
        if self._additive is not None:  # 0 where real, the dtype's minimum at holes: (m - 1) * max
            window = self._additive[:, start:end]
            window.copy_(self.slot_mask[:, start:end]).sub_(1).mul_(torch.finfo(window.dtype).max)

    def _reset_tail(self, num_slots: int) -> None:
        """Slots at index >= num_slots are no longer used: set them back to 1 (see the class docstring)."""
        if self.real_from > num_slots:
            self.slot_mask[:, num_slots : self.real_from] = 1
            if self._additive is not None:
                self._additive[:, num_slots : self.real_from] = 0
            self.real_from = num_slots

    @abc.abstractmethod
    def truncate(self, num_slots: int) -> None:
        """Drop every cache slot at index >= num_slots."""

    @abc.abstractmethod
    def kv_tensors(self, num_slots: int) -> list[torch.Tensor]:
        """Every K and V tensor restricted to the first ``num_slots`` slots ([B, H, num_slots, D] views)."""

    @abc.abstractmethod
    def _select_cache_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [B'] of the cache."""

    def select_rows(self, index: torch.Tensor) -> None:
        self._select_cache_rows(index)
        self.slot_mask = self.slot_mask.index_select(0, index)
        if self._additive is not None:
            self._additive = self._additive.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)
        self.compactor.select_rows(index.shape[0], holes=self.real_from > 0)

    def check_add_rows(self, other: "SlotMaskRunner") -> None:
        """ValueError, with nothing changed, unless ``add_rows(other)`` can take ``other``'s rows."""
        if type(other) is not type(self) or other.model is not self.model:
            raise ValueError("add_rows needs a runner of the same kind over the same model")
        if (self._additive is None) != (other._additive is None):
            raise ValueError("add_rows needs runners built with the same attention-mask kind")

    def add_rows(self, other: "SlotMaskRunner") -> None:
        """Append the rows of ``other`` (a runner of the same model and kind over its own rows, e.g. requests just
        prefilled) after this runner's rows; ``other`` must not be used afterwards. The side with fewer slots is
        padded on the left with holes, so every row keeps its slots, positions (``next_position`` [B]) and masks."""
        self.check_add_rows(other)
        slots = max(self.num_slots, other.num_slots)
        pads = (slots - self.num_slots, slots - other.num_slots)
        spare = max(r.slot_mask.shape[1] - r.num_slots for r in (self, other))
        slot_mask = torch.cat([_left_padded(r.slot_mask, r.num_slots, pad, slots + spare, 1, 0)
                               for r, pad in ((self, pads[0]), (other, pads[1]))])
        additive = None
        # (not under a caller's autocast: CPU autocast to bfloat16 fails on a cat of float16 masks)
        with torch.autocast(self.slot_mask.device.type, enabled=False):
            if self._additive is not None:
                hole = -torch.finfo(self._additive.dtype).max  # as ``_mask_written`` writes a hole
                additive = torch.cat([_left_padded(r._additive, r.num_slots, pad, slots + spare, 0.0, hole)
                                      for r, pad in ((self, pads[0]), (other, pads[1]))])
            self._add_cache_rows(other, *pads)  # the last step that can fail: allocates the merged cache
        self.slot_mask, self._additive = slot_mask, additive
        self.next_position = torch.cat([self.next_position, other.next_position])
        self.real_from = max(r.real_from + pad for r, pad in ((self, pads[0]), (other, pads[1])))
        self.num_slots = slots
        self.reserve = max(self.reserve, other.reserve)  # (rows that may draft more than this runner's joined it)
        self.compactor.select_rows(self.slot_mask.shape[0], holes=self.real_from > 0)

    @abc.abstractmethod
    def _add_cache_rows(self, other: "SlotMaskRunner", pad: int, other_pad: int) -> None:
        """Append ``other``'s cache rows after this cache's, each side's slots left-padded with ``pad`` /
        ``other_pad`` slots first (masked as holes by ``add_rows``)."""

    def lengths_to_read(self) -> torch.Tensor | None:
        return self.next_position if self.compactor.enabled else None

    def lengths_read(self, lengths: list[int]) -> None:
        self.compactor.counts_read(lengths)

    @property
    def compactions(self) -> int:
        return self.compactor.compactions
