"""Turning the ops' invalid-row flags (-1) into errors that name the argument and the row."""

import torch

from .reference import invalid_rows
from .randomness import MAX_OFFSET, Randomness
from .warping import scale_logits


def should_check(check: bool | None) -> bool:
    """Resolve ``check=None``: check eagerly, but not while compiling or capturing a CUDA graph."""
    if check is not None:
        return bool(check)
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _rows(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def raise_for_invalid_rows(flags: torch.Tensor, *, temperature: float = 0.0, randomness: Randomness | None = None,
                           **inputs) -> None:
    """Raise ValueError if any entry of ``flags`` ([B]) is -1, or (given the call's ``randomness``) a row's seed or
    offset is out of range, naming the offending input and rows.

    One host read of the combined flags; the inputs are only inspected after a failure. ``temperature`` > 0: the
    logits were scaled by it, so a logit that overflows float32 when scaled is named too.
    """
    failed = flags < 0
    if randomness is not None:
        failed = failed | randomness.out_of_range()
    bad = _rows(failed)
    if not bad:
        return
    if randomness is not None:
        for name, value in (("seed", randomness.seed), ("offset", randomness.offset)):
            out_of_range = (value < 0) | (value >= MAX_OFFSET) if name == "offset" else value < 0
            rows = _rows(out_of_range)
            if rows:
                limit = "2**32" if name == "offset" else "2**63"
                raise ValueError(f"{name} must be in [0, {limit}), got {int(value[rows[0]])} (batch rows {rows})")
    vocab = inputs["target_logits"].shape[-1] if "target_logits" in inputs else None
    for name, tensor in inputs.items():
        if tensor is None:
            continue
        if tensor.is_floating_point():
            rows = _rows(invalid_rows(tensor))
            if rows:
                raise ValueError(f"{name} has NaN, +inf or an all -inf row in batch rows {rows}; no token emitted")
            if temperature > 0.0:
                rows = _rows(invalid_rows(scale_logits(tensor, temperature)))
                if rows:
                    raise ValueError(
                        f"{name} divided by temperature={temperature!r} is not finite (a logit overflows float32, "
                        f"or every logit becomes -inf) in batch rows {rows}; no token emitted")
        elif vocab is not None:
            rows = _rows(((tensor < 0) | (tensor >= vocab)).any(dim=-1))
            if rows:
                raise ValueError(f"{name} has ids outside [0, {vocab}) in batch rows {rows}")
    raise ValueError(f"invalid input in batch rows {bad}")
