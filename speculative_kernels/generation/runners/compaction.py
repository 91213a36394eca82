"""When to squeeze the holes out of a decoder-only runner's cache, and doing it with ``ops.compact_kv``.

A row that accepts fewer drafts than the longest row leaves holes (masked slots) behind. They cost attention work
and, in the static cache, capacity; they are removed in bulk, rarely (``docs/batching.md``). The decision needs each
row's real-slot count on the host: it comes with the loop's one host read of the iteration (``counts_read``).
"""

import torch

from ...ops.compaction import compact_kv


class SlotCompactor:
    """Decides when a runner's cache is compacted (``due``) and moves the slots (``compact``).

    batch: B (one row has no holes of its own: never compacts, unless rows have left or joined: ``select_rows``);
    threshold: compact when that frees more than this fraction of the used slots (``due``); backend: of
    ``ops.compact_kv``.
    """

    def __init__(self, batch: int, threshold: float = 0.25, backend: str = "auto"):
        self.enabled = batch > 1
        self.threshold = threshold
        self.backend = backend
        self.compactions = 0
        self._counts: list[int] | None = None  # real slots per row, from the loop's host read

    def counts_read(self, counts: list[int]) -> None:
        """Each row's real slots as the iteration's host read saw them (before its rollback: upper bounds)."""
        self._counts = counts

    def select_rows(self, batch: int, holes: bool = False) -> None:
        """Rows left or joined the batch: it has ``batch`` rows now, and earlier counts no longer apply. holes: the
        cache may hold holes (a row left alone after others left or joined keeps its holes otherwise)."""
        self.enabled, self._counts = batch > 1 or holes, None

    def due(self, used: int, reserve: int = 0, capacity: int | None = None) -> int | None:
        """The width to compact ``used`` slots to (the most real slots of a row), or None: when compacting would
        free more than the threshold's fraction of the used slots, or when ``reserve`` more slots would not fit in
        ``capacity``. What it frees is the width past the longest row: holes that rows of different lengths leave
        (left padding, rows that accepted fewer drafts) stay after any compaction, and counting them compacted
        after nearly every iteration for nothing (a batch of 16 prompts of 16-45 tokens: 21 compactions in 36
        iterations, half of them to the same width). Uses (and consumes) the counts read; without them (batch 1,
        or a runner driven without the loop's read) it cannot judge and returns None."""
        counts, self._counts = self._counts, None
        full = capacity is not None and used + reserve > capacity
        if counts is None or not self.enabled or used == 0:
            return None
        longest = max(min(max(c, 0), used) for c in counts)
        if not full and used - longest <= self.threshold * used:
            return None
        return longest

    def compact(self, kv: list[torch.Tensor], slot_mask: torch.Tensor) -> None:
        """Move every row's real slots to the left in each kv [B, H, S, D] and rewrite slot_mask [B, S] to the
        left-aligned prefix of each row's real slots, in place."""
        lengths = compact_kv(kv, slot_mask, backend=self.backend)
        slot_mask.copy_(torch.arange(slot_mask.shape[1], device=slot_mask.device).unsqueeze(0) < lengths.unsqueeze(1))
        self.compactions += 1
