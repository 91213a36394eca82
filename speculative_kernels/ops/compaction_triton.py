"""Triton backend of ``compact_kv`` (semantics: ``compaction.py``), registered as a mutating torch custom op.

One program per (row b, head h, head-dim block); it walks the slots in tiles of BLOCK_S, in order. Per tile: the
exclusive prefix count of real slots gives each real slot its destination ``count + prefix``; only slots that move
(destination != source) are loaded, then, after a barrier, stored. Destinations never exceed sources, so a tile's
stores can only hit slots of this tile (already loaded) or of earlier tiles (already done). Elements are moved as
integers of the same width, so the copy is bit-exact for every dtype.
"""

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .backends import device_guard
from .eager import kernel_itself, plain_eager

__all__ = ["compact_kv"]

_AS_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit(do_not_specialize=["num_slots"])  # the used slots grow every iteration: no recompilation for them
def compact_kv_kernel(
    KV_ptr,  # [B, H, S, D] integer view, unit stride over D
    M_ptr,  # [B, S] int8 slot mask, contiguous
    num_heads,
    num_slots,
    head_dim,
    stride_kb,
    stride_kh,
    stride_ks,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    base = KV_ptr + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    mask_row = M_ptr + b.to(tl.int64) * num_slots
    count = 0
    for s0 in range(0, num_slots, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        real = tl.load(mask_row + offs_s, mask=offs_s < num_slots, other=0).to(tl.int32)
        dest = count + tl.cumsum(real, axis=0) - real  # exclusive prefix: destination of each real slot
        moved = (real != 0) & (dest != offs_s)
        both = moved[:, None] & d_ok[None, :]
        values = tl.load(base + offs_s.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], mask=both)
        tl.debug_barrier()  # every load of the tile before any store of it
        tl.store(base + dest.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], values, mask=both)
        count += tl.sum(real, axis=0)


def slot_tile(device: torch.device) -> int:
    """BLOCK_S: slots per tile; the interpreter (CPU tests) is fastest with big numpy tiles."""
    return 64 if device.type == "cuda" else 256


@triton_op("speculative_kernels::compact_kv_triton", mutates_args=("kv",))
def compact_kv_triton(kv: torch.Tensor, slot_mask: torch.Tensor) -> None:
    """kv [B, H, S, D] (unit stride over D), in place; slot_mask [B, S] int8 contiguous (nonzero = real)."""
    _compact_kv_body(kv, slot_mask, None)


def _compact_kv_body(kv: torch.Tensor, slot_mask: torch.Tensor, wrap) -> None:
    """``compact_kv_triton``'s body, which ``compact_kv`` also calls directly in plain eager mode (``eager.py``).
    wrap: None for this module's ``wrap_triton`` (looked up here: ``triton_aot.recording`` stands in for it), or
    ``eager.kernel_itself``."""
    batch, heads, slots, head_dim = kv.shape
    if kv.numel() == 0:
        return
    data = kv.view(_AS_INT[kv.element_size()])
    # (plain arithmetic: triton.next_power_of_2 / triton.cdiv are constexpr_functions, ~3 µs per host call)
    block_d = min(1 << (head_dim - 1).bit_length(), 128)
    block_s = slot_tile(kv.device)
    grid = (batch * heads, (head_dim + block_d - 1) // block_d)
    with device_guard(kv.device):
        (wrap or wrap_triton)(compact_kv_kernel)[grid](
            data, slot_mask, heads, slots, head_dim, data.stride(0), data.stride(1), data.stride(2),
            BLOCK_S=block_s, BLOCK_D=block_d,
        )


def compact_kv(tensors, slot_mask) -> None:
    """tensors: list of [B, H, S, D]; slot_mask: [B, S]. In place. One registered op call per tensor (a model's
    layers: 2 per layer), or, in plain eager mode, its body with the kernel itself (``eager.py``)."""
    mask = (slot_mask != 0).to(torch.int8).contiguous()
    for kv in tensors:
        if kv.stride(-1) != 1:
            raise ValueError(f"compact_kv (triton) needs unit stride over the head dimension, got {kv.stride()}")
        if kv.element_size() not in _AS_INT:
            raise TypeError(f"compact_kv (triton): unsupported element size {kv.element_size()} ({kv.dtype})")
    if plain_eager((mask, *tensors)):
        for kv in tensors:
            _compact_kv_body(kv, mask, kernel_itself)
        return
    for kv in tensors:
        torch.ops.speculative_kernels.compact_kv_triton(kv, mask)
