"""Turning the ops' invalid-row flags (-1) into errors that name the argument and the row."""

import torch

from .reference import invalid_rows


def should_check(check: bool | None) -> bool:
    """Resolve ``check=None``: check eagerly, but not while compiling or capturing a CUDA graph."""
    if check is not None:
        return bool(check)
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def raise_for_invalid_rows(flags: torch.Tensor, **inputs) -> None:
    """Raise ValueError if any entry of ``flags`` ([B]) is -1, naming the offending input and rows.

    One host read of ``flags``; the inputs are only inspected after a failure.
    """
    bad = (flags < 0).nonzero().flatten().tolist()
    if not bad:
        return
    for name, tensor in inputs.items():
        if tensor is None:
            continue
        if tensor.is_floating_point():
            rows = invalid_rows(tensor).nonzero().flatten().tolist()
            if rows:
                raise ValueError(f"{name} has NaN, +inf or an all -inf row in batch rows {rows}; no token emitted")
        else:
            vocab = inputs["target_logits"].shape[-1]
            rows = ((tensor < 0) | (tensor >= vocab)).any(dim=-1).nonzero().flatten().tolist()
            if rows:
                raise ValueError(f"{name} has ids outside [0, {vocab}) in batch rows {rows}")
    raise ValueError(f"invalid input in batch rows {bad}")
