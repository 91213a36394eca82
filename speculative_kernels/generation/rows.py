"""Finished rows leaving a running batch: the loop keeps computing only the unfinished rows, while their outputs
are written back into full-size buffers, in the original row order, when they leave or at the end."""

import dataclasses

import torch

from .buffers import widen
from .options import BatchingOptions


@dataclasses.dataclass
class Outputs:
    """What a loop writes per row: sequences [B, W] int64, generated [B] int64 (new tokens so far), and HF's
    ``scores``/``logits`` [B, W - prompt, V] float32 (None unless asked for)."""

    sequences: torch.Tensor
    generated: torch.Tensor
    scores: torch.Tensor | None
    raw_logits: torch.Tensor | None

    def select(self, index: torch.Tensor) -> "Outputs":
        """Rows ``index`` [B'] (int64 on the device)."""
        return Outputs(**{name: None if t is None else t.index_select(0, index) for name, t in self.items()})

    def items(self) -> list[tuple[str, torch.Tensor | None]]:
        return [(field.name, getattr(self, field.name)) for field in dataclasses.fields(self)]


class RowDropper:
    """Decides when finished rows leave the batch (``BatchingOptions.rows_to_drop``) and keeps the full-size
    outputs meanwhile. fill: the token id of unwritten sequence positions (the pad)."""

    def __init__(self, options: BatchingOptions, fill: int):
        self.options, self.fill = options, fill
        self.dropped = 0
        self._full: Outputs | None = None  # the full-size outputs, once rows have left
        self._rows: torch.Tensor | None = None  # [B'] original index of each remaining row (device)

    def due(self, finished_host: list[int]) -> bool:
        """Whether the finished rows (flags from the iteration's host read) should leave the batch now."""
        return self.options.rows_to_drop(sum(1 for f in finished_host if f), len(finished_host))

    def drop(self, outputs: Outputs, keep: torch.Tensor) -> Outputs:
        """Rows ``keep`` [B'] (int64 on the device, in order) of ``outputs`` stay; returns their outputs. The others'
        outputs are kept (written back) in the full-size buffers."""
        if self._full is None:  # the loop's buffers are still the full-size ones: they become the outputs
            self._full, self._rows = outputs, torch.arange(outputs.generated.shape[0], device=keep.device)
        else:
            self._write_back(outputs)
        self.dropped += outputs.generated.shape[0] - keep.shape[0]
        self._rows = self._rows.index_select(0, keep)
        return outputs.select(keep)

    def finish(self, outputs: Outputs) -> Outputs | None:
        """Write the remaining rows back and return the full-size outputs; None when no row ever left."""
        if self._full is None:
            return None
        self._write_back(outputs)
        full, self._full = self._full, None
        return full

    def _write_back(self, outputs: Outputs) -> None:
        for name, part in outputs.items():
            mine = getattr(self._full, name)
            if mine is None:
                continue
            if mine.dim() > 1 and mine.shape[1] < part.shape[1]:  # the loop grew its buffers meanwhile
                mine = widen(mine, part.shape[1], self.fill if name == "sequences" else 0.0)
                setattr(self._full, name, mine)
            mine.index_copy_(0, self._rows, part)
