"""Argument checks shared by the public ops: logits, tokens, devices and sampling settings (each error names the
argument). Seeds and offsets are checked where they are resolved, ``randomness.py``."""

import numbers

import torch

from .sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, RowSampling, Sampling

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOKEN_DTYPES = (torch.int64, torch.int32)
FLOAT_PARAM_DTYPES = (torch.float32, torch.float64)
INT_PARAM_DTYPES = (torch.int64, torch.int32)


def too_large_temperature(temperature) -> str:
    """The error for a temperature above float32's largest value (as a scalar or in a [B] tensor)."""
    return (f"temperature={temperature!r} exceeds float32's largest value ({MAX_TEMPERATURE:.9g}): the ops hold the "
            "temperature in float32, where it would be infinite")


def check_sampling_params(temperature, top_k, top_p) -> tuple[float, int, float]:
    """Validate and normalise (0 <= temperature <= float32's largest value, top_k >= 0, 0 < top_p <= 1); returns
    python scalars. A temperature above float32's largest value is refused by name: HF divides float32 logits by it
    and gets 0 everywhere (a uniform draw), but the ops hold it in float32, where it is infinite."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a real number, got {type(temperature).__name__}")
    if not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {temperature}")
    if temperature > MAX_TEMPERATURE:
        raise ValueError(too_large_temperature(temperature))
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


def _check_row_tensor(name: str, value: torch.Tensor, dtypes, batch: int, device: torch.device) -> None:
    """dtype, shape [B] and device of a per-row tensor argument; its values are checked with the result."""
    if value.dtype not in dtypes:
        raise TypeError(f"{name} tensor must be {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                        f"got {value.dtype}")
    if tuple(value.shape) != (batch,):
        raise ValueError(f"{name} tensor must have shape [{batch}] (one value per row), got {tuple(value.shape)}")
    if value.device != indexed_device(device):
        raise ValueError(f"{name} is on {value.device} but the logits are on {device}; put them on one device")


def indexed_device(device) -> torch.device:
    """``device`` with its index: ``"cuda"`` names the current CUDA device, as a tensor created there reports it
    (``cuda:0`` when 0 is current), so ``"cuda"`` and ``cuda:0`` compare equal when they are the same device."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def check_sampling(temperature, top_k, top_p, batch: int, device: torch.device,
                   top_k_bound: int | None = None) -> Sampling:
    """The ``Sampling`` of a call: python scalars as ``check_sampling_params``; any of the three may instead be a
    [B] tensor on the logits' device (float32/float64 temperature and top_p, int64/int32 top_k), which makes every
    parameter per row (``RowSampling``). Tensor values are not read here: a row with an invalid value comes back
    flagged (-1) and the checked path names the argument (``diagnostics.raise_for_invalid_rows``).

    ``top_k_bound``: the caller's host int >= 1 (None: not given), a promise on the sampled rows (temperature > 0):
    top_k <= top_k_bound, and top_k >= 1 where top_p < 1. With per-row tensors it becomes
    ``RowSampling.top_k_bound`` (one topk of the bound instead of a V-length sort per row); a row breaking it is
    flagged by ``breaks_top_k_bound`` (the ops then return it as -1). With scalars it is checked here. A python
    top_k >= 1 beside per-row tensors is itself such a bound (every row has it), taken when none is given."""
    bound = _check_top_k_bound(top_k_bound)
    tensors = {name: value for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
               if isinstance(value, torch.Tensor)}
    if not tensors:
        sampling = Sampling(*check_sampling_params(temperature, top_k, top_p))
        if bound is not None and sampling.temperature > 0.0 and (
                sampling.top_k > bound or (sampling.top_k == 0 and sampling.top_p < 1.0)):
            raise ValueError(f"top_k_bound={bound} does not bound top_k={sampling.top_k}"
                             + (f" with top_p={sampling.top_p}" if sampling.top_k == 0 else "")
                             + ": sampled rows need 1 <= top_k <= top_k_bound where top_p < 1, and top_k <= "
                             "top_k_bound everywhere")
        return sampling
    scalars = check_sampling_params(
        0.0 if "temperature" in tensors else temperature,
        0 if "top_k" in tensors else top_k,
        1.0 if "top_p" in tensors else top_p,
    )
    dtypes = {"temperature": FLOAT_PARAM_DTYPES, "top_k": INT_PARAM_DTYPES, "top_p": FLOAT_PARAM_DTYPES}
    kinds = {"temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float64}
    rows = {}
    for index, name in enumerate(("temperature", "top_k", "top_p")):
        if name in tensors:
            _check_row_tensor(name, tensors[name], dtypes[name], batch, device)
            # contiguous: the kernels read row b at offset b (a sliced or expanded tensor would give row b another
            # row's value)
            rows[name] = _row_values(name, tensors[name], kinds[name]).contiguous()
        else:
            rows[name] = torch.full((batch,), _representable(scalars[index], kinds[name]), dtype=kinds[name],
                                    device=device)
    cut = "top_k" in tensors or "top_p" in tensors or scalars[1] > 0 or scalars[2] < 1.0
    given = tensors.get("temperature")
    given = given if given is not None and given.dtype == torch.float64 else None
    if bound is None and "top_k" not in tensors and scalars[1] > 0:
        bound = scalars[1]  # (every row's top_k: nothing to check)
    return Sampling(rows=RowSampling(rows["temperature"], rows["top_k"], rows["top_p"], cut, given,
                                     top_k_bound=bound))


def _check_top_k_bound(top_k_bound) -> int | None:
    if top_k_bound is None:
        return None
    if isinstance(top_k_bound, bool) or not isinstance(top_k_bound, numbers.Integral):
        raise TypeError(f"top_k_bound must be an int (a host value) or None, got {type(top_k_bound).__name__}")
    if top_k_bound < 1:
        raise ValueError(f"top_k_bound must be >= 1, got {top_k_bound}")
    return int(top_k_bound)


def _row_values(name: str, value: torch.Tensor, kind: torch.dtype) -> torch.Tensor:
    """A per-row tensor in the dtype the kernels read. A float64 temperature that is not 0 but rounds to 0 in float32
    (e.g. 1e-50) would make its row greedy: it becomes a float32 subnormal instead, which is refused as the
    scalar 1e-50 is (below float32's smallest normal), with no host read. One above float32's largest value (e.g.
    1e39, or one that rounds down to it) becomes infinite, so its row is refused as the scalar is
    (``diagnostics`` names it by the value given, ``RowSampling.given_temperature``)."""
    converted = value.to(kind)
    if name == "temperature" and value.dtype == torch.float64:
        underflow = (converted == 0.0) & (value != 0.0)
        converted = torch.where(underflow, torch.full_like(converted, MIN_TEMPERATURE / 2), converted)
        converted = torch.where(value > MAX_TEMPERATURE, torch.full_like(converted, float("inf")), converted)
    return converted


def _representable(value, kind: torch.dtype):
    """A valid scalar made a [B] tensor's value when another parameter is per row: a top_k past int64 (any top_k of
    the vocabulary size or more is no cut) is the largest int64. (A valid temperature fits float32:
    ``check_sampling_params`` refuses one above float32's largest value.)"""
    if kind == torch.int64:
        return min(int(value), torch.iinfo(torch.int64).max)
    return value


def check_num_draft_tokens(value, batch: int, device: torch.device) -> torch.Tensor | None:
    """num_draft_tokens: None, or a [B] int64 tensor on the logits' device (values 0..K are checked with the
    result: a row outside that range comes back flagged, -1). Returns it contiguous (the kernels read row b at
    offset b)."""
    if value is None:
        return None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"num_draft_tokens must be a torch.Tensor or None, got {type(value).__name__}")
    _check_row_tensor("num_draft_tokens", value, (torch.int64,), batch, device)
    return value.contiguous()
