"""Every row's context on the device for drafters without a model (prompt lookup, n-gram): the tokens so far,
left-padded, in one growing buffer.

Row b's context is ``tokens[b, start[b] : end[b]]``: (for encoder-decoder models, the encoder input's real tokens,
then) the prompt's real tokens, then what the loop emitted. Appending is one scatter per iteration, on the device;
the buffer doubles (host decision, from the iteration's host read) and, for ``compile=True``, is allocated at its
final width up front so its shape never changes.
"""

import torch

from .buffers import INITIAL_NEW_TOKENS, widen


def left_aligned(tokens: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, W], real [B, W] bool -> (tokens [B, W] with each row's real tokens moved to its end, in order, after
    its other tokens; start [B] int64: where its real tokens begin)."""
    order = torch.argsort(real.to(torch.int8), dim=1, stable=True)  # the row's other tokens, then its real ones
    return tokens.gather(1, order), tokens.shape[1] - real.sum(dim=1)


class ContextBuffer:
    """tokens [B, W] int64, start/end [B] int64 on the device; ``end_bound``: a host bound on max(end).

    prefix: (ids [B, Lp], real [B, Lp]) searched before the prompt (the encoder input), or None; max_new_tokens,
    max_gamma: size the final width (max_new_tokens None: no final width, it doubles as needed); full: allocate the
    final width at once (compiled loop: static shapes)."""

    def __init__(self, input_ids: torch.Tensor, real: torch.Tensor, prefix, *, max_new_tokens: int | None,
                 max_gamma: int, full: bool = False):
        if prefix is not None:
            input_ids = torch.cat([prefix[0].to(input_ids.device), input_ids], dim=1)
            real = torch.cat([prefix[1].to(device=real.device, dtype=torch.bool), real], dim=1)
        tokens, self.start = left_aligned(input_ids.to(torch.int64), real)
        self.end = torch.full_like(self.start, tokens.shape[1])
        self.end_bound = tokens.shape[1]
        unbounded = 1 << 62
        self.final_width = unbounded if max_new_tokens is None else tokens.shape[1] + max_new_tokens + max_gamma + 1
        initial = tokens.shape[1] + INITIAL_NEW_TOKENS + max_gamma + 1
        self.full = full and max_new_tokens is not None
        width = self.final_width if self.full else min(self.final_width, initial)
        self.tokens = widen(tokens, width, 0)

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` more tokens in every row (doubling the width; host values only)."""
        if self.end_bound + extra > self.tokens.shape[1]:
            self.tokens = widen(self.tokens, min(self.final_width, max(self.end_bound + extra,
                                                                        2 * self.tokens.shape[1])), 0)

    def append(self, out: torch.Tensor, count: torch.Tensor) -> None:
        """Append the first count[b] (device [B]) of out [B, T] to row b, on the device."""
        width = out.shape[1]
        self.reserve(width)
        positions = torch.arange(width, device=out.device).unsqueeze(0)
        index = (self.end.unsqueeze(1) + positions).clamp(max=self.tokens.shape[1] - 1)
        keep = positions < count.unsqueeze(1)
        self.tokens.scatter_(1, index, torch.where(keep, out, self.tokens.gather(1, index)))
        self.end = self.end + count
        self.end_bound += width

    def lengths_read(self, ends: list[int]) -> None:
        """The ends as read on the host (tightens ``end_bound``)."""
        self.end_bound = max(ends, default=0)

    def select_rows(self, index: torch.Tensor) -> None:
        self.tokens, self.start, self.end = (t.index_select(0, index) for t in (self.tokens, self.start, self.end))

    def add_rows(self, other: "ContextBuffer") -> None:
        """Append ``other``'s rows (each keeps its own start and end; the narrower buffer is widened on the right:
        buffers allocated at their final width (``full``) stay at the larger final width)."""
        if self.full != other.full:
            raise ValueError("add_rows needs two context buffers allocated the same way (full or growing)")
        width = max(self.tokens.shape[1], other.tokens.shape[1])
        tokens = torch.cat([widen(self.tokens, width, 0), widen(other.tokens, width, 0)])
        self.tokens = tokens
        self.start, self.end = torch.cat([self.start, other.start]), torch.cat([self.end, other.end])
        self.end_bound = max(self.end_bound, other.end_bound)
        self.final_width = max(self.final_width, other.final_width)
