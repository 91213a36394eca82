"""Turning the ops' invalid-row flags (-1) into errors that name the argument and the row."""

import torch
from torch._subclasses.fake_tensor import is_fake

from .reference import draft_limit, invalid_positions, invalid_rows, used_positions
from .randomness import MAX_OFFSET, Randomness
from .sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, Sampling
from .validation import too_large_temperature
from .warping import scale_logits


def should_check(check: bool | None, logits: torch.Tensor) -> bool:
    """Resolve ``check=None``: check eagerly, but not while compiling or capturing a CUDA graph, nor on tensors with
    no values to read (the meta device, fake tensors: shape propagation, ``torch.library.opcheck``). logits: the
    op's input."""
    if check is not None:
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool or None, got {type(check).__name__}")
        if check and (torch.compiler.is_compiling() or (torch.cuda.is_available()
                                                         and torch.cuda.is_current_stream_capturing())):
            raise ValueError("check=True reads the result on the host, which cannot run while compiling "
                             "(torch.compile) or capturing a CUDA graph: pass check=False, or leave check=None (the "
                             "default), which skips the checks there; invalid rows then come back as -1")
        return check
    if torch.compiler.is_compiling() or logits.device.type == "meta" or is_fake(logits):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _rows(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def _scaled(tensor: torch.Tensor, temperature: float, sampling: Sampling | None) -> torch.Tensor:
    """What the softmax sees: float32(logits) / temperature, per row with per-row parameters (greedy rows: 1)."""
    if sampling is None or sampling.rows is None:
        return scale_logits(tensor, temperature)
    divisor = sampling.rows.safe_temperature().view(-1, *([1] * (tensor.dim() - 1)))
    return tensor.to(torch.float32) / divisor


def _bad_values(tensor: torch.Tensor, used: torch.Tensor | None) -> torch.Tensor:
    """[B] bool: rows whose logits (at the used positions, when ``used`` [B, J] is given) are invalid."""
    if used is None or tensor.dim() != 3:
        return invalid_rows(tensor)
    return (invalid_positions(tensor) & used).any(dim=1)


def _raise_for_parameters(sampling: Sampling | None, num_draft_tokens: torch.Tensor | None, num_draft: int | None):
    if num_draft_tokens is not None and num_draft is not None:
        rows = _rows((num_draft_tokens < 0) | (num_draft_tokens > num_draft))
        if rows:
            raise ValueError(f"num_draft_tokens must be in [0, {num_draft}] (K), got {int(num_draft_tokens[rows[0]])} "
                             f"(batch rows {rows})")
    if sampling is None or sampling.rows is None:
        return
    params = sampling.rows
    t = params.temperature
    given = params.given_temperature
    if given is not None:  # a float64 value above float32's largest value (inf in float32), named as given
        rows = _rows((given > MAX_TEMPERATURE) & (given != float("inf")))
        if rows:
            raise ValueError(f"{too_large_temperature(given[rows[0]].item())} (batch rows {rows})")
    checks = (
        ("temperature", t, ~(t >= 0.0) | (t == float("inf")),
         "must be finite and >= 0 (0 means greedy)"),
        ("temperature", t, (t > 0.0) & (t < MIN_TEMPERATURE),
         f"is below float32's smallest normal number ({MIN_TEMPERATURE:.3g}): the logits would overflow; use 0 for "
         "greedy"),
        ("top_k", params.top_k, params.top_k < 0, "must be >= 0 (0 disables it)"),
        ("top_p", params.top_p, ~((params.top_p > 0.0) & (params.top_p <= 1.0)), "must be in (0, 1]"),
    )
    for name, value, bad, rule in checks:
        rows = _rows(bad)
        if rows:
            raise ValueError(f"{name} {rule}, got {value[rows[0]].item()!r} (batch rows {rows})")
    rows = _rows(params.breaks_top_k_bound())
    if rows:
        b = rows[0]
        raise ValueError(f"top_k_bound={params.top_k_bound} does not bound the sampled rows' top_k: row {b} has "
                         f"top_k={params.top_k[b].item()} with top_p={params.top_p[b].item()!r} (sampled rows need "
                         f"1 <= top_k <= top_k_bound where top_p < 1, and top_k <= top_k_bound everywhere; batch "
                         f"rows {rows})")


def raise_for_invalid_rows(flags: torch.Tensor, *, temperature: float = 0.0, randomness: Randomness | None = None,
                           sampling: Sampling | None = None, num_draft_tokens: torch.Tensor | None = None,
                           **inputs) -> None:
    """Raise ValueError if any entry of ``flags`` ([B]) is -1, or (given the call's ``randomness``) a row's seed or
    offset is out of range, naming the offending input and rows.

    One host read of the combined flags; the inputs are only inspected after a failure. ``temperature`` > 0 (or a
    ``sampling`` that samples): the logits were scaled by it, so a logit that overflows float32 when scaled is named
    too. ``sampling`` with per-row parameters and ``num_draft_tokens`` ([B]) are named when out of range; with
    ``num_draft_tokens``, only the positions a row uses are inspected (target j <= n_b, drafts i < n_b).
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
    draft_tokens = inputs.get("draft_tokens")
    num_draft = draft_tokens.shape[1] if draft_tokens is not None else None
    _raise_for_parameters(sampling, num_draft_tokens, num_draft)
    if sampling is not None:
        temperature = sampling.temperature if sampling.rows is None else 1.0
    samples = temperature > 0.0 if sampling is None or sampling.rows is None else True
    used = {}
    if num_draft is not None:
        limit, _ = draft_limit(num_draft_tokens, flags.shape[0], num_draft, flags.device)
        used["target_logits"], used["draft_logits"] = used_positions(limit, num_draft)
        used["draft_tokens"] = used["draft_logits"]
    vocab = inputs["target_logits"].shape[-1] if "target_logits" in inputs else None
    for name, tensor in inputs.items():
        if tensor is None:
            continue
        if tensor.is_floating_point():
            rows = _rows(_bad_values(tensor, used.get(name)))
            if rows:
                raise ValueError(f"{name} has NaN, +inf or an all -inf row in batch rows {rows}; no token emitted")
            if samples:
                rows = _rows(_bad_values(_scaled(tensor, temperature, sampling), used.get(name)))
                if rows:
                    shown = f"temperature={temperature!r}" if sampling is None or sampling.rows is None else (
                        "its row's temperature")
                    raise ValueError(
                        f"{name} divided by {shown} is not finite (a logit overflows float32, "
                        f"or every logit becomes -inf) in batch rows {rows}; no token emitted")
        elif vocab is not None:
            out = (tensor < 0) | (tensor >= vocab)
            if name in used:
                out = out & used[name]
            rows = _rows(out.any(dim=-1))
            if rows:
                raise ValueError(f"{name} has ids outside [0, {vocab}) in batch rows {rows}")
    raise ValueError(f"invalid input in batch rows {bad}")
