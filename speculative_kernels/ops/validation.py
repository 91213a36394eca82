"""Argument checks shared by the public ops: logits, tokens, devices and sampling settings (each error names the
argument). Seeds and offsets are checked where they are resolved, ``randomness.py``."""

import numbers

import torch

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOKEN_DTYPES = (torch.int64, torch.int32)
# The kernels divide float32 logits by float32(temperature): below float32's smallest normal number the divisor is
# subnormal (or zero) and every logit of ordinary size overflows, so such a temperature is refused up front.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def check_sampling_params(temperature, top_k, top_p) -> tuple[float, int, float]:
    """Validate and normalise (temperature >= 0, top_k >= 0, 0 < top_p <= 1); returns python scalars."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {temperature}")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature={temperature!r} is below float32's smallest normal number ({MIN_TEMPERATURE:.3g}): the "
            "logits are divided by it in float32 and would overflow; use do_sample=False (temperature 0) for greedy"
        )
    if top_k is None:
        top_k = 0
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if top_p is None:
        top_p = 1.0
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real):
        raise TypeError(f"top_p must be a real number, got {type(top_p).__name__}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    return float(temperature), int(top_k), float(top_p)


def check_logits(name: str, logits: torch.Tensor, ndim: int) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(logits.shape)}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {logits.dtype}")
    if logits.shape[-1] < 1:
        raise ValueError(f"{name} has an empty vocabulary dimension: shape {tuple(logits.shape)}")
    if logits.shape[0] < 1:
        raise ValueError(f"{name} has an empty batch (B = 0): shape {tuple(logits.shape)}")


def check_tokens(name: str, tokens: torch.Tensor, ndim: int) -> None:
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tokens.shape)}")
    if tokens.dtype not in TOKEN_DTYPES:
        raise TypeError(f"{name} must be int64 or int32, got {tokens.dtype}")


def check_same_device(**tensors) -> None:
    named = [(k, t) for k, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; put them on one device")
