"""Buffers that grow with what is generated: their starting size, and growing them along the token axis."""

import torch

INITIAL_NEW_TOKENS = 256  # output, score and slot-mask buffers start with room for this many new tokens, then double


def initial_new_tokens(max_new_tokens: int) -> int:
    """New tokens the buffers of a request hold before their first growth."""
    return min(max_new_tokens, INITIAL_NEW_TOKENS)


def widen(tensor: torch.Tensor, width: int, fill) -> torch.Tensor:
    """``tensor`` [B, W, ...] padded with ``fill`` along dim 1 to ``width`` columns (a copy; unchanged if wide
    enough)."""
    if tensor.shape[1] >= width:
        return tensor
    # (one allocation of the result and a copy: a concatenation would hold a padding block beside it too)
    wide = tensor.new_empty((tensor.shape[0], width, *tensor.shape[2:]))
    wide[:, : tensor.shape[1]] = tensor
    wide[:, tensor.shape[1]:] = fill
    return wide


def grow_columns(mask: torch.Tensor, width: int, fill=0) -> torch.Tensor:
    """mask [B, M] with at least ``width`` columns: doubled (``fill`` appended) when too narrow, so growing to any
    length costs amortised O(1) per slot. (Runners captured by torch.compile size theirs up front.)"""
    if width <= mask.shape[1]:
        return mask
    return widen(mask, max(width, 2 * mask.shape[1]), fill)


def initial_slots(prompt_length: int, max_gamma: int, max_new_tokens: int) -> int:
    """Initial width of the runners' slot masks (they grow as needed): the prompt, a few iterations' worth of slots
    and room for the first new tokens."""
    return prompt_length + 4 * (max_gamma + 2) + initial_new_tokens(max_new_tokens)
