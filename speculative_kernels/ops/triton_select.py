"""The Triton backend's k-th largest select (the top-k-alone cut of ``triton_backend._cuts``) without torch.topk: the
radix select of ``csrc/topk_kernels.cuh`` written in Triton.

Keys: the raw logits' bits as order-preserving unsigned integers (16-bit for fp16/bf16, 32-bit for float32; a
negative value has every bit flipped, a positive one its sign bit set: unsigned key order refines float order). One
kernel per 8-bit digit from the top (2 for 16-bit keys, 4 for 32-bit), over programs (row, chunk): a histogram of
the digit over the chunk's elements whose higher digits match the prefix found so far (``tl.histogram``), atomics
into the row's [256] counts, a ticket; the row's last program picks the bucket of the k-th largest (counting from
the top) and stores the prefix and the remaining k. Then ``find_kernel``: the smallest id of the row holding the
selected key (``tl.atomic_min``). Launches: a zeroed workspace (torch's memset) and 3 kernels for bf16/fp16, 5 for
float32.
The result does not depend on the chunking: deterministic.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

__all__ = ["kth_largest_index"]

_KEY_DTYPES = {torch.float32: (torch.int32, 32), torch.float16: (torch.int16, 16), torch.bfloat16: (torch.int16, 16)}


# The kernels inline their row pointer and key arithmetic: under TRITON_INTERPRET=1 every call of a nested
# @triton.jit function re-patches triton.language (~1.5 ms a call), which made the CPU tests' selects 3x slower.
# Keys: int16 / int32 raw bits -> uint32 order-preserving keys (16-bit ones for KEY_BITS == 16).


# The workspace W (int32, zeroed): counts [PASSES, rows, 256], tickets [PASSES, rows], then per row the prefix of the
# selected digits, the remaining k and the output (set to INT_MAX by the last pass: find_kernel's atomic minimum
# starts there). One base pointer and ``rows`` (not specialised, as ``chunks``): pointers into it at offsets that
# change with the batch size would have their 16-byte alignment specialised, a new compilation per batch size class.
@triton.jit(do_not_specialize=["chunks", "rows", "digit"])
def radix_pass_kernel(X_ptr, stride_b, stride_j, positions, vocab, k, chunk, chunks, W_ptr, rows, digit,
                      KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, chunk) = (pid // chunks, pid % chunks) of the pass over digit ``digit`` (0: the top 8 bits; a
    runtime argument, so that the passes share one compiled kernel). X: raw bits [B, J, V] (unit stride over V),
    rows = B * J."""
    PASSES: tl.constexpr = KEY_BITS // 8
    shift = KEY_BITS - 8 * (digit + 1)
    counts_ptr = W_ptr + digit * rows * 256
    tickets_ptr = W_ptr + PASSES * rows * 256 + digit * rows
    prefix_ptr = W_ptr + PASSES * rows * 257
    remaining_ptr = prefix_ptr + rows
    out_ptr = prefix_ptr + 2 * rows
    pid = tl.program_id(0)
    r = pid // chunks
    c = pid - r * chunks
    b = r // positions
    row = X_ptr + b.to(tl.int64) * stride_b + (r - b * positions).to(tl.int64) * stride_j
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    hist = tl.zeros([512], dtype=tl.int32)  # bins 0..255 the digits; 256 the elements that do not match the prefix
    prefix = tl.load(prefix_ptr + r).to(tl.uint32, bitcast=True)  # (0 before the first pass: the zeroed workspace)
    for base in range(start, end, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        inside = offs < end
        u = tl.load(row + offs, mask=inside, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
        if KEY_BITS == 16:
            u = u & 0xFFFF
            key = tl.where((u & 0x8000) != 0, u ^ 0xFFFF, u | 0x8000)
        else:
            key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
        # the higher digits (two shifts: no shift by 32 in the first pass of 32-bit keys, where they are none: 0)
        match = inside & (((key >> shift) >> 8) == prefix)
        hist += tl.histogram(tl.where(match, ((key >> shift) & 255).to(tl.int32), 256), 512)
    bins = tl.arange(0, 512)
    row_counts = counts_ptr + r * 256
    tl.atomic_add(row_counts + bins, hist, mask=(bins < 256) & (hist > 0))
    tl.debug_barrier()  # every thread's counts are added before the ticket (acq_rel, device scope) is taken
    ticket = tl.atomic_add(tickets_ptr + r, 1)
    if ticket == chunks - 1:  # the row's last program: the bucket holding the k-th largest, from the top
        desc = 255 - tl.arange(0, 256)
        counts = tl.atomic_add(row_counts + desc, tl.zeros([256], dtype=tl.int32))  # (read where the atomics landed)
        want = tl.where(digit == 0, k, tl.load(remaining_ptr + r))
        above_it = tl.cumsum(counts, 0) < want  # the buckets above the selected one (a prefix of desc)
        # their number (high word) and their elements (low word) in one sum
        packed = tl.sum(tl.where(above_it, (1 << 32) + counts.to(tl.int64), 0), 0)
        position = (packed >> 32).to(tl.int32)
        above = (packed & 0xFFFFFFFF).to(tl.int32)
        bucket = (255 - position).to(tl.uint32)
        tl.store(prefix_ptr + r, ((prefix << 8) | bucket).to(tl.int32, bitcast=True))
        tl.store(remaining_ptr + r, want - above)
        if digit == PASSES - 1:
            tl.store(out_ptr + r, 2147483647)


@triton.jit(do_not_specialize=["chunks", "rows"])
def find_kernel(X_ptr, stride_b, stride_j, positions, vocab, chunk, chunks, W_ptr, rows, KEY_BITS: tl.constexpr,
                BLOCK: tl.constexpr):
    """Program (row, chunk): the smallest id of the chunk holding the row's selected key (its prefix after the last
    pass: the whole key), atomically min-ed into the row's output (INT_MAX before)."""
    prefix_ptr = W_ptr + (KEY_BITS // 8) * rows * 257
    out_ptr = prefix_ptr + 2 * rows
    pid = tl.program_id(0)
    r = pid // chunks
    c = pid - r * chunks
    b = r // positions
    row = X_ptr + b.to(tl.int64) * stride_b + (r - b * positions).to(tl.int64) * stride_j
    target = tl.load(prefix_ptr + r).to(tl.uint32, bitcast=True)
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    for base in range(start, end, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        inside = offs < end
        u = tl.load(row + offs, mask=inside, other=0).to(tl.int32).to(tl.uint32, bitcast=True)
        if KEY_BITS == 16:
            u = u & 0xFFFF
            key = tl.where((u & 0x8000) != 0, u ^ 0xFFFF, u | 0x8000)
        else:
            key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
        found = inside & (key == target)  # (few ids: the ties of the k-th largest value)
        tl.atomic_min(out_ptr + r + tl.zeros([BLOCK], dtype=tl.int32), offs, mask=found)


def kth_largest_index(logits: torch.Tensor, k: int, block: int, chunk: int, wrap=None) -> torch.Tensor:
    """logits [B, J, V] (unit stride over V), 1 <= k <= V -> [B, J] int32: the smallest id of each row holding its
    k-th largest value (a NaN row: unspecified). block: the kernels' tile (a power of two); chunk: ids per program, a
    multiple of block (``triton_backend.Plan.chunk_size``: the statistics pass's chunking); wrap: None for this
    module's ``wrap_triton`` (looked up at the call: ``triton_aot.recording`` stands in for it), or the identity in
    plain eager mode (``eager.kernel_itself``)."""
    wrap = wrap or wrap_triton
    batch, positions, vocab = logits.shape
    bits_dtype, key_bits = _KEY_DTYPES[logits.dtype]
    rows = batch * positions
    if rows == 0:
        return torch.empty((batch, positions), dtype=torch.int32, device=logits.device)
    bits = logits.view(bits_dtype)  # (same element size: the strides stay)
    chunks = (vocab + chunk - 1) // chunk  # (triton.cdiv's constexpr wrapper costs ~3 µs of host time a call)
    passes = key_bits // 8
    # one zeroed buffer (one memset): counts, tickets, prefix, remaining and the output (0 until the last pass:
    # a valid id where the kernels are only recorded, not run, as triton_aot records them)
    workspace = torch.zeros(passes * rows * 257 + 3 * rows, dtype=torch.int32, device=logits.device)
    strides = (bits.stride(0), bits.stride(1))
    for p in range(passes):
        wrap(radix_pass_kernel)[(rows * chunks,)](
            bits, *strides, positions, vocab, k, chunk, chunks, workspace, rows, p, KEY_BITS=key_bits, BLOCK=block,
        )
    wrap(find_kernel)[(rows * chunks,)](
        bits, *strides, positions, vocab, chunk, chunks, workspace, rows, KEY_BITS=key_bits, BLOCK=block,
    )
    return workspace[passes * rows * 257 + 2 * rows :].view(batch, positions)
