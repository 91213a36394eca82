"""Triton backend of ``prompt_lookup`` (semantics: ``lookup.py``), registered as a torch custom op.

One program per row. For each n-gram size n (unrolled, ``MAX_NGRAM`` is a compile-time constant) it walks the
row's windows in tiles of BLOCK_W: a window matches when its n tokens equal the row's last n (n loads per tile, each
compared with one scalar), and the tile's first (or last) matching start is folded into a running min (max). The
largest n with a match wins. Then up to BLOCK_K >= num_tokens tokens are copied after the match, the filler past the
count. Integer work only, so the result is identical to the reference.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .backends import device_guard
from .eager import kernel_itself, plain_eager

__all__ = ["prompt_lookup"]


# The buffer widens as tokens are generated, and its width (its row stride too) follows each request's prompt: neither
# is specialised (the stride's multiple-of-16 class would compile a second variant for some prompt lengths)
@triton.jit(do_not_specialize=["width", "stride_tb"])
def prompt_lookup_kernel(
    T_ptr,  # [B, W] int64 tokens
    start_ptr,  # [B] int64
    end_ptr,  # [B] int64
    out_ptr,  # [B, K] int64 proposal
    count_ptr,  # [B] int64
    width,
    num_tokens,
    stride_tb,
    stride_ob,
    MAX_NGRAM: tl.constexpr,
    PREFER_LATEST: tl.constexpr,
    PERIODIC: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    row = T_ptr + b.to(tl.int64) * stride_tb
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    best_j = tl.zeros((), dtype=tl.int64)
    best_n = tl.zeros((), dtype=tl.int64)
    for n in tl.static_range(MAX_NGRAM, 0, -1):  # largest n first (a constexpr per unrolled copy)
        if PREFER_LATEST:
            candidate = tl.full((), -1, dtype=tl.int64)
        else:
            candidate = tl.full((), 0, dtype=tl.int64) + width
        for j0 in range(0, width, BLOCK_W):
            offs = j0 + tl.arange(0, BLOCK_W).to(tl.int64)
            ok = (offs >= start) & (offs + n < end)  # implies n <= end - start - 1
            for i in tl.static_range(n):
                suffix = tl.load(row + tl.maximum(end - n + i, 0))
                window = tl.load(row + offs + i, mask=ok, other=0)
                ok = ok & (window == suffix)
            if PREFER_LATEST:
                candidate = tl.maximum(candidate, tl.max(tl.where(ok, offs, -1), axis=0))
            else:
                candidate = tl.minimum(candidate, tl.min(tl.where(ok, offs, width), axis=0))
        if PREFER_LATEST:
            found = candidate >= 0
        else:
            found = candidate < width
        take = found & (best_n == 0)
        best_j = tl.where(take, candidate, best_j)
        best_n = tl.where(take, n, best_n)
    s = best_j + best_n
    t = tl.arange(0, BLOCK_K).to(tl.int64)
    if PERIODIC:
        count = tl.where(best_n > 0, num_tokens, 0)
        position = s + t % tl.maximum(end - s, 1)
    else:
        count = tl.where(best_n > 0, tl.minimum(end - s, num_tokens), 0)
        position = s + t
    filler = tl.load(row + end - 1)
    copied = tl.load(row + position, mask=t < count, other=0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + t, tl.where(t < count, copied, filler), mask=t < num_tokens)
    tl.store(count_ptr + b, count)


def window_tile(device: torch.device) -> int:
    """BLOCK_W: windows per tile; the interpreter (CPU tests) is fastest with big numpy tiles."""
    return 128 if device.type == "cuda" else 512


@triton_op("speculative_kernels::prompt_lookup_triton", mutates_args=())
def prompt_lookup_triton(tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor, num_tokens: int,
                         max_ngram: int, prefer_latest: bool,
                         periodic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, W] int64 (unit stride over W); start, end [B] int64. Returns (proposal [B, K], count [B])."""
    return _prompt_lookup_body(tokens, start, end, num_tokens, max_ngram, prefer_latest, periodic, None)


def _prompt_lookup_body(tokens, start, end, num_tokens: int, max_ngram: int, prefer_latest: bool, periodic: bool,
                        wrap):
    """``prompt_lookup_triton``'s body, which ``prompt_lookup`` also calls directly in plain eager mode
    (``eager.py``). wrap: None for this module's ``wrap_triton`` (looked up here: ``triton_aot.recording`` stands in
    for it), or ``eager.kernel_itself``."""
    batch, width = tokens.shape
    proposal = torch.empty(batch, num_tokens, dtype=torch.int64, device=tokens.device)
    count = torch.empty(batch, dtype=torch.int64, device=tokens.device)
    if batch == 0:
        return proposal, count
    with device_guard(tokens.device):
        (wrap or wrap_triton)(prompt_lookup_kernel)[(batch,)](
            tokens, start, end, proposal, count, width, num_tokens, tokens.stride(0), proposal.stride(0),
            MAX_NGRAM=max_ngram, PREFER_LATEST=prefer_latest, PERIODIC=periodic, BLOCK_W=window_tile(tokens.device),
            BLOCK_K=1 << (num_tokens - 1).bit_length(),  # (triton.next_power_of_2: ~3 µs per host call)
        )
    return proposal, count


def prompt_lookup(tokens, start, end, num_tokens: int, max_ngram: int, prefer_latest: bool = False,
                  periodic: bool = False):
    """As ``lookup.prompt_lookup_reference``."""
    if tokens.stride(1) != 1:
        tokens = tokens.contiguous()
    args = (tokens, start.contiguous(), end.contiguous(), num_tokens, max_ngram, prefer_latest, periodic)
    if plain_eager(args):  # the op's body with the kernel itself (eager.py)
        return _prompt_lookup_body(*args, kernel_itself)
    return torch.ops.speculative_kernels.prompt_lookup_triton(*args)
