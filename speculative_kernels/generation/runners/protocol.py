"""What the loop needs from the object that drives one model over its KV cache (``Runner``), and from one whose
steps can be captured by ``torch.compile`` (``CapturableRunner``)."""

from collections.abc import Sequence
from typing import Protocol

import torch

from ..options import CompileOptions


class Runner(Protocol):
    """One model with its KV cache, for one batch of B rows.

    Every row writes the same slots at each forward (``num_slots``, a host int, counts them), so the loop addresses
    slots, not tokens; which slots a row really uses (holes, pointers per row) is the runner's business. Rolling back
    costs O(1) and needs no host read of its own.
    """

    num_slots: int

    def forward(self, tokens: torch.Tensor, real: torch.Tensor | None = None,
                last_only: bool = False, prompt: bool = False) -> torch.Tensor:
        """Run tokens [B, T] int64 at the next T slots. real: [B, T] bool, False where a row has nothing to feed (a
        left pad of the prompt, a filler); None: every token is real. Returns logits [B, T, V], or [B, 1, V] (the
        last position) with last_only. prompt: the tokens are (a chunk of) the prompts, which a forward at slot 0
        always is (``prefill.prefill`` passes it for every chunk): an encoder-decoder's decoder prompt keeps its
        pads' positions, where a later False is a filler that takes none."""

    def keep_prefix(self, width: int, kept: torch.Tensor, max_kept: int,
                    kept_host: list[int] | None = None) -> None:
        """Roll back: of the last ``width`` slots, row b keeps its first kept[b] ([B] int64 on the device) and drops
        the rest. max_kept: max(kept), a host int from the iteration's host read; kept_host: kept as host ints, when
        the caller has them (a runner may then skip device work, e.g. when every row keeps as many)."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` ([B'] int64 on the device, in order) of every per-row state: finished rows leave."""

    def add_rows(self, other: "Runner") -> None:
        """Append the B2 rows of ``other`` (a runner of the same kind over the same model, e.g. requests just
        prefilled on their own) after this runner's B rows: every per-row state becomes [B + B2]; each row keeps its
        positions, the side with fewer slots getting holes on the left. ``other`` is consumed. The counterpart of
        ``select_rows``. Raises ValueError, with nothing changed, when the rows cannot join (e.g. more rows than a
        static cache was allocated for); runners that never take rows (encoder-decoder) raise NotImplementedError."""

    def check_add_rows(self, other: "Runner") -> None:
        """Raise as ``add_rows(other)`` would refuse (ValueError / NotImplementedError), changing nothing; return
        when it can take ``other``'s rows (what may still fail then is an allocation)."""

    def lengths_to_read(self) -> torch.Tensor | None:
        """[B] int64 on the device that this runner wants on the host, read with the loop's one host read of the
        iteration (each row's real slots: hole compaction, a capacity bound); None when it needs nothing."""

    def lengths_read(self, lengths: list[int]) -> None:
        """``lengths_to_read()`` as read on the host, before this iteration's rollback (so upper bounds after it)."""

    @property
    def compactions(self) -> int:
        """Hole compactions so far (statistics)."""


class CapturableRunner(Runner, Protocol):
    """A runner over a preallocated cache, whose forward at a fixed width can be captured (CUDA graphs on CUDA)."""

    def capture(self, shapes: Sequence[tuple[int, bool]], options: CompileOptions) -> None:
        """Compile the forward for each (width T, last_only) of ``shapes``; other widths (the prefill) stay eager."""

    def warm_up(self, calls: int = 3) -> None:
        """Run every captured step ``calls`` times on filler tokens and roll back (compiles, records CUDA graphs)."""
