"""Batched decoding housekeeping: squeezing holes out of the KV caches, and dropping finished rows.

Holes. Every row writes the same cache slots; a row that accepts fewer drafts than the longest row leaves holes
(masked slots) behind. They cost attention work and, with the static cache, capacity. Rollback itself stays O(1)
(mask write + pointer move); holes are removed in bulk, rarely: when they pass ``compaction_threshold`` of the used
slots (default 25%), or when a static cache would otherwise run out of room, ``SlotCompactor`` moves every row's real
slots to the left with ``ops.compact_kv`` (a stable per-row gather of K and V along the slot axis, one kernel per
layer tensor, in place), rewrites the slot mask to a left-aligned prefix and moves the write pointer back. Positions
do not change: a row's real-token count is the same and each K already carries its rotary position.

The compactor needs each row's real-slot count on the host, and gets it without a host read of its own: the loop
appends every runner's ``next_position`` (the real slots of each row) to the iteration's single device-to-host read
(``host_counts``). Those counts are taken before the rollback, so they bound the real slots after it from above; the
compacted width is that bound (a few trailing holes, at most the rows' rejected drafts, may remain).

Finished rows. ``drop_rows`` removes rows from a runner (cache, slot mask, positions) with one batched
``index_select``; the loop uses it when ``drop_finished_fraction`` of the rows in the batch have finished, after
writing their final outputs, so the remaining iterations only compute the unfinished rows.
"""

import dataclasses
import math

import torch

from ..ops.compaction import compact_kv


@dataclasses.dataclass(frozen=True)
class BatchingOptions:
    """Knobs of batched decoding (batch > 1); the defaults suit most workloads.

    compaction_threshold: compact when holes exceed this fraction of the used slots (0 < t <= 1).
    drop_finished_fraction: drop finished rows from the batch once at least this fraction of it has finished
        (0 < f <= 1); None never drops.
    compaction_backend: backend of ``ops.compact_kv`` ("auto", "torch", "triton", "cuda").
    static_slack: extra static-cache slots, as a fraction of the minimum capacity, that let holes accumulate between
        compactions (None: compaction_threshold). Memory grows by this fraction; compactions get rarer.
    """

    compaction_threshold: float = 0.25
    drop_finished_fraction: float | None = 0.25
    compaction_backend: str = "auto"
    static_slack: float | None = None

    def __post_init__(self):
        if not 0.0 < self.compaction_threshold <= 1.0:
            raise ValueError(f"compaction_threshold must be in (0, 1], got {self.compaction_threshold}")
        if self.drop_finished_fraction is not None and not 0.0 < self.drop_finished_fraction <= 1.0:
            raise ValueError(f"drop_finished_fraction must be in (0, 1] or None, got {self.drop_finished_fraction}")
        if self.static_slack is not None and not 0.0 <= self.static_slack <= 4.0:
            raise ValueError(f"static_slack must be in [0, 4] or None, got {self.static_slack}")

    @property
    def slack(self) -> float:
        return self.compaction_threshold if self.static_slack is None else self.static_slack

    def rows_to_drop(self, num_finished: int, batch: int) -> bool:
        """Whether to drop ``num_finished`` finished rows out of ``batch`` now (some row must stay unfinished)."""
        if self.drop_finished_fraction is None or num_finished == 0 or num_finished >= batch:
            return False
        return num_finished >= max(1, math.ceil(self.drop_finished_fraction * batch))


class SlotCompactor:
    """Decides when a runner's cache is compacted and does it (see the module docstring).

    The runner provides: ``slot_mask`` [B, M], ``num_slots`` (host int), ``kv_tensors(num_slots)`` (every K/V
    tensor restricted to the first num_slots slots, [B, H, num_slots, D] views) and ``truncate(num_slots)``.
    """

    def __init__(self, batch: int, threshold: float = 0.25, backend: str = "auto"):
        self.enabled = batch > 1
        self.threshold = threshold
        self.backend = backend
        self.host_counts: list[int] | None = None  # real slots per row, from the loop's host read
        self.compactions = 0

    def maybe_compact(self, runner, reserve: int = 0, capacity: int | None = None) -> bool:
        """Compact if the holes pass the threshold, or if ``reserve`` more slots would not fit in ``capacity``.

        Uses (and consumes) ``host_counts``; without them (batch 1, or a runner driven without the loop's read) it
        can only report a full cache."""
        counts, self.host_counts = self.host_counts, None
        used = runner.num_slots
        full = capacity is not None and used + reserve > capacity
        if counts is None or not self.enabled or used == 0:
            return False
        real = [min(max(c, 0), used) for c in counts]
        holes = len(real) * used - sum(real)
        if not full and holes <= self.threshold * len(real) * used:
            return False
        self.compact(runner, max(real))
        return True

    def compact(self, runner, width: int) -> None:
        """Move every row's real slots to the left; ``width`` (host int) bounds the longest row's real slots."""
        used = runner.num_slots
        mask = runner.slot_mask[:, :used]
        lengths = compact_kv(runner.kv_tensors(used), mask, backend=self.backend)
        mask.copy_(torch.arange(used, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1))
        runner.truncate(width)
        self.compactions += 1


def drop_rows(runner, index: torch.Tensor) -> None:
    """Keep rows ``index`` [B'] (int64, on the runner's device) of a runner: cache, slot mask and positions."""
    runner.select_cache_rows(index)
    runner.slot_mask = runner.slot_mask.index_select(0, index)
    runner.next_position = runner.next_position.index_select(0, index)
    compactor = getattr(runner, "compactor", None)
    if compactor is not None:
        compactor.enabled = index.shape[0] > 1
        compactor.host_counts = None


def widen(tensor: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``tensor`` [B, W, ...] padded with ``fill`` along dim 1 to ``width`` columns (a copy; unchanged if wide
    enough). The loop grows its output buffers with it; ``RowDropper`` grows its full-size copies to match."""
    if tensor.shape[1] >= width:
        return tensor
    pad = tensor.new_full((tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:]), fill)
    return torch.cat([tensor, pad], dim=1)


class RowDropper:
    """Drops finished rows from a running ``SpeculativeLoop`` (see the module docstring).

    While rows are dropped, the loop's ``sequences``/``generated``/``scores``/``raw_logits`` hold the remaining rows
    only; ``finish`` writes them back and restores the full-size buffers (rows in their original order).
    """

    PER_ROW = ("sequences", "generated", "finished", "last", "scores", "raw_logits")
    OUTPUTS = ("sequences", "generated", "scores", "raw_logits")

    def __init__(self, options: BatchingOptions):
        self.options = options
        self.rows = None  # [B'] original index of each remaining row (device), None until the first drop
        self.full = None  # output name -> full-size tensor
        self.dropped = 0

    def maybe_drop(self, loop, finished_host: list[int]) -> bool:
        """Drop the finished rows when enough have finished. finished_host: the loop's flags from its host read."""
        num_finished = sum(1 for f in finished_host if f)
        runners = (loop.target_runner, loop.draft_runner)
        if not self.options.rows_to_drop(num_finished, len(finished_host)):
            return False
        if not all(hasattr(r, "select_cache_rows") for r in runners):
            return False
        if self.full is None:  # the loop's buffers are still the full-size ones: keep them as the outputs
            self.full = {name: getattr(loop, name) for name in self.OUTPUTS}
            self.rows = torch.arange(loop.batch, device=loop.device)
        else:
            self._write_back(loop)
        remaining = len(finished_host) - num_finished
        keep = torch.argsort(loop.finished.to(torch.int8), stable=True)[:remaining]  # unfinished rows, in order
        loop.select_host_rows([i for i, f in enumerate(finished_host) if not f])
        for name in self.PER_ROW:
            value = getattr(loop, name)
            if value is not None:
                setattr(loop, name, value.index_select(0, keep))
        loop.randomness.select_rows(keep)
        tokens, real = loop.pending
        loop.pending = (tokens.index_select(0, keep), None if real is None else real.index_select(0, keep))
        for runner in runners:
            drop_rows(runner, keep)
        self.rows = self.rows.index_select(0, keep)
        loop.batch = remaining
        self.dropped += num_finished
        return True

    def _write_back(self, loop) -> None:
        for name, full in self.full.items():
            if full is not None:
                part = getattr(loop, name)
                if full.dim() > 1 and full.shape[1] < part.shape[1]:  # the loop grew its buffers meanwhile
                    fill = loop.sequences_fill if name == "sequences" else 0
                    full = self.full[name] = widen(full, part.shape[1], fill)
                full.index_copy_(0, self.rows, part)

    def finish(self, loop) -> None:
        """Write the remaining rows back and give the loop its full-size outputs again."""
        if self.full is None:
            return
        self._write_back(loop)
        for name, full in self.full.items():
            setattr(loop, name, full)
        loop.batch = self.full["sequences"].shape[0]
        loop.finished = torch.ones(loop.batch, dtype=torch.bool, device=loop.device)
        self.full = None


def compactions(loop) -> int:
    """Hole compactions both runners of a loop have done."""
    return sum(getattr(getattr(r, "compactor", None), "compactions", 0) for r in (loop.target_runner,
                                                                                  loop.draft_runner))
