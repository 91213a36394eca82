"""What the two decoder-only runners share: each row's real slots marked in a slot mask (holes at 0), rollback by
mask writes, per-row positions, and hole compaction fed by the loop's host read."""

import inspect

import torch

from .compaction import SlotCompactor


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


class SlotMaskRunner:
    """Base of the decoder-only runners: ``slot_mask`` [B, S] int64 (1 real, 0 hole), ``next_position`` [B] (each
    row's real slots: its next position), ``num_slots`` (host int) and a ``SlotCompactor``. Subclasses own the cache:
    ``truncate``, ``kv_tensors``, ``_select_cache_rows``; ``reserve``/``capacity`` bound a preallocated cache."""

    reserve: int = 0
    capacity: int | None = None

    def __init__(self, batch: int, slots: int, device: torch.device, compaction_threshold: float,
                 compaction_backend: str):
        self.slot_mask = torch.zeros(batch, slots, dtype=torch.int64, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.num_slots = 0
        self.compactor = SlotCompactor(batch, compaction_threshold, compaction_backend)

    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int) -> None:
        """Of the last ``width`` slots, row b keeps its first kept[b] real ones; the rest become holes and the
        trailing slots no row keeps are cut. Then compacts when the holes pass the threshold, or when the next
        iteration (``reserve`` slots) would not fit in ``capacity``."""
        start = hole_rejected_slots(self.slot_mask, self.next_position, self.num_slots, width, kept)
        self.truncate(start + max_kept)
        target = self.compactor.due(self.num_slots, self.reserve, self.capacity)
        if target is not None:
            self.compactor.compact(self.kv_tensors(self.num_slots), self.slot_mask[:, : self.num_slots])
            self.truncate(target)

    def truncate(self, num_slots: int) -> None:
        raise NotImplementedError

    def kv_tensors(self, num_slots: int) -> list[torch.Tensor]:
        """Every K and V tensor restricted to the first ``num_slots`` slots ([B, H, num_slots, D] views)."""
        raise NotImplementedError

    def _select_cache_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def select_rows(self, index: torch.Tensor) -> None:
        self._select_cache_rows(index)
        self.slot_mask = self.slot_mask.index_select(0, index)
        self.next_position = self.next_position.index_select(0, index)
        self.compactor.select_rows(index.shape[0])

    def lengths_to_read(self) -> torch.Tensor | None:
        return self.next_position if self.compactor.enabled else None

    def lengths_read(self, lengths: list[int]) -> None:
        self.compactor.counts_read(lengths)

    @property
    def compactions(self) -> int:
        return self.compactor.compactions
