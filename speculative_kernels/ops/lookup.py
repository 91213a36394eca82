"""``prompt_lookup``: draft tokens copied from the sequence itself (prompt-lookup decoding), on the device.

For every row b with real tokens ``tokens[b, start_b : end_b]`` (the last one at ``end_b - 1``) and each n-gram
size n from ``max_ngram`` down to 1 (n <= end_b - start_b - 1), a window j matches when

    tokens[b, j : j + n] == tokens[b, end_b - n : end_b],   start_b <= j,   j + n < end_b   (a continuation exists)

The largest n with a match wins; among its matches the first (``prefer_latest=False``: HF's
``PromptLookupCandidateGenerator`` rule, left to right) or the last (``prefer_latest=True``: the most recent
occurrence). With s = j + n the proposal is

    count[b] = min(num_tokens, end_b - s),   proposal[b, t] = tokens[b, s + t] for t < count[b]

and 0 tokens where nothing matches. ``periodic=True`` extends a continuation that reaches the row's end as a
repetition with period end_b - s (the match says the text repeats with that period), so a match always proposes
num_tokens tokens: proposal[b, t] = tokens[b, s + t mod (end_b - s)], count[b] = num_tokens. Positions t >= count[b] hold ``tokens[b, end_b - 1]`` (a filler: a deterministic
function of the row's context, so verifying it against one-hot q is still exact; it is only unlikely to be accepted).

Static shapes and no host read: ``count`` stays on the device. Backends (``backends.implementation(...,
family="lookup")``): ``torch`` (the reference below) and ``triton`` (``lookup_triton.py``, also used on CUDA devices:
there is no CUDA C++ kernel); all return identical tensors.
"""

import torch
import torch.nn.functional as F

from . import backends

__all__ = ["prompt_lookup", "prompt_lookup_reference"]


def prompt_lookup_reference(tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor, num_tokens: int,
                            max_ngram: int, prefer_latest: bool = False,
                            periodic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens: [B, W] int64; start, end: [B] int64 (0 <= start <= end <= W, end >= 1). Returns (proposal [B, K]
    int64, count [B] int64), K = num_tokens. The semantics: the module docstring."""
    batch, width = tokens.shape
    j = torch.arange(width, device=tokens.device).unsqueeze(0)  # window starts [1, W]
    start, end = start.unsqueeze(1), end.unsqueeze(1)
    best_j = torch.zeros(batch, 1, dtype=torch.int64, device=tokens.device)
    best_n = torch.zeros_like(best_j)
    padded = F.pad(tokens, (0, max_ngram))  # window j + i never reads past the buffer
    for n in range(max_ngram, 0, -1):
        suffix = tokens.gather(1, (end - n + torch.arange(n, device=tokens.device)).clamp(min=0))  # [B, n]
        ok = (j >= start) & (j + n < end) & (end - start - 1 >= n)
        for i in range(n):
            ok &= padded[:, i : i + width] == suffix[:, i : i + 1]
        if prefer_latest:
            candidate = torch.where(ok, j, -1).amax(dim=1, keepdim=True)
        else:
            candidate = torch.where(ok, j, width).amin(dim=1, keepdim=True)
        take = ok.any(dim=1, keepdim=True) & (best_n == 0)
        best_j = torch.where(take, candidate, best_j)
        best_n = torch.where(take, n, best_n)
    s = best_j + best_n
    t = torch.arange(num_tokens, device=tokens.device).unsqueeze(0)
    if periodic:
        count = torch.where(best_n > 0, num_tokens, 0)
        position = s + t % (end - s).clamp(min=1)
    else:
        count = torch.where(best_n > 0, torch.clamp(end - s, max=num_tokens), 0)
        position = s + t
    copied = tokens.gather(1, position.clamp(max=width - 1))
    filler = tokens.gather(1, end - 1)
    return torch.where(t < count, copied, filler), count.squeeze(1)


def check_lookup_args(tokens, start, end, num_tokens: int, max_ngram: int, check_range: bool = True) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.int64:
        raise ValueError(f"tokens must be a [B, W] int64 tensor, got {getattr(tokens, 'shape', tokens)}")
    for name, value in (("start", start), ("end", end)):
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or tuple(value.shape) != tokens.shape[:1]:
            raise ValueError(f"{name} must be a [{tokens.shape[0]}] int64 tensor, got {getattr(value, 'shape', value)}")
        if value.device != tokens.device:
            raise ValueError(f"{name} is on {value.device} but tokens is on {tokens.device}")
    if tokens.shape[1] < 1:
        raise ValueError(f"tokens must hold at least one position per row (W >= 1), got shape {tuple(tokens.shape)}")
    for name, value in (("num_tokens", num_tokens), ("max_ngram", max_ngram)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if check_range and tokens.device.type == "cpu" and tokens.shape[0] and not torch.compiler.is_compiling():
        # on the host the range costs no device read (on a device it is the caller's: see prompt_lookup)
        bad = ((start < 0) | (start > end) | (end < 1) | (end > tokens.shape[1])).nonzero().flatten().tolist()
        if bad:
            b = bad[0]
            raise ValueError(f"start and end must satisfy 0 <= start <= end, 1 <= end <= W = {tokens.shape[1]}; row {b} has "
                             f"start={int(start[b])}, end={int(end[b])} (batch rows {bad})")


def prompt_lookup(tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor, *, num_tokens: int,
                  max_ngram: int = 2, prefer_latest: bool = False, periodic: bool = False,
                  backend: str = "auto", check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Propose up to ``num_tokens`` tokens per row by n-gram lookup in the row's own tokens (module docstring).

    tokens: [B, W] int64; start, end: [B] int64, row b's real tokens are ``tokens[b, start[b]:end[b]]`` (the caller
    keeps 0 <= start <= end and 1 <= end <= W; checked for CPU tensors, not on a device, where it would need a host read). Returns (proposal
    [B, num_tokens] int64, count [B] int64 in 0..num_tokens). ``check=False`` skips the CPU range check, for a caller
    that keeps the invariant itself (the decode loop's drafter: no per-iteration host work)."""
    check_lookup_args(tokens, start, end, num_tokens, max_ngram, check_range=check)
    for name, value in (("prefer_latest", prefer_latest), ("periodic", periodic)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    impl = backends.implementation(backend, tokens.device.type, family="lookup")
    return impl.prompt_lookup(tokens, start, end, num_tokens, max_ngram, prefer_latest, periodic)
