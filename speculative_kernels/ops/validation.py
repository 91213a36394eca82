"""Argument checks and randomness resolution shared by the public ops (each error names the argument).

Seeds and offsets follow one rule whether they are ints or tensors: seed in [0, 2**63), offset in [0, 2**32).
Ints and CPU tensors are checked here, on entry. A tensor on another device is checked with the op's result
(``diagnostics.flag_bad_randomness``, folded into the one host read that ``check=True`` makes anyway), so checking
adds no host synchronisation; unchecked (inside ``torch.compile`` or a CUDA graph) nothing is read and such a value
is used as its low bits.
"""

import numbers

import torch

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOKEN_DTYPES = (torch.int64, torch.int32)
MAX_OFFSET = 2**32
MAX_SEED = 2**63
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


_LIMITS = {"seed": (MAX_SEED, "2**63"), "offset": (MAX_OFFSET, "2**32")}


def _range_error(name: str, value) -> ValueError:
    return ValueError(f"{name} must be in [0, {_LIMITS[name][1]}), got {value}")


def _as_row_tensor(name: str, value, batch: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """int or int64 tensor of shape [], [1] or [B] -> ([B] int64 on device, whether it was given per row).
    Ints and CPU tensors are range-checked here (see the module docstring)."""
    limit = _LIMITS[name][0]
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} tensor must be int64 or int32, got {value.dtype}")
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] not in (1, batch)):
            raise ValueError(f"{name} must be a scalar, shape [1] or shape [{batch}], got {tuple(value.shape)}")
        if value.device.type == "cpu" and value.numel() and not (
                torch.compiler.is_compiling() or (0 <= int(value.min()) and int(value.max()) < limit)):
            bad = value[(value < 0) | (value >= limit)].flatten()[0]
            raise _range_error(name, int(bad))
        per_row = value.dim() == 1 and value.shape[0] == batch and batch > 1
        return value.to(device=device, dtype=torch.int64, non_blocking=True).reshape(-1).expand(batch), per_row
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int or an integer tensor, got {type(value).__name__}")
    if not 0 <= value < limit:
        raise _range_error(name, value)
    return torch.full((batch,), int(value), dtype=torch.int64, device=device), False


def bad_randomness(seed_rows: torch.Tensor, offset_rows: torch.Tensor) -> torch.Tensor:
    """[B] bool on the rows' device: True where seed or offset is outside its range (no host read)."""
    return (seed_rows < 0) | (offset_rows < 0) | (offset_rows >= MAX_OFFSET)


def resolve_randomness(seed, offset, generator, batch: int, device: torch.device):
    """Turn (seed | generator, offset) into ([B] seed, [B] offset, seed_per_row) int64 tensors on ``device``.

    With neither a seed nor a generator, a seed is drawn from torch's default generator of ``device`` (so
    ``torch.manual_seed`` makes runs repeatable). On a GPU that draw is a device op: no host copy, and inside a CUDA
    graph capture it is captured (every replay draws a fresh seed) instead of copying a host value from pageable
    memory. A CUDA generator likewise yields a device tensor: no host synchronisation.
    """
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        seed = torch.randint(0, 2**62, (), generator=generator, device=generator.device)
    elif seed is None:
        seed = torch.randint(0, 2**62, (), device=device)  # on the op's device: capturable by a CUDA graph
    seed_rows, seed_per_row = _as_row_tensor("seed", seed, batch, device)
    offset_rows, _ = _as_row_tensor("offset", offset, batch, device)
    return seed_rows, offset_rows, seed_per_row
