"""Triton kernels of the verification step and the draft sampler (split-row, three passes, no host sync).

Rows are the vocabulary rows of one batch entry b: target positions j = 0..K, then (with draft logits) draft
positions i = 0..K-1, so a batch entry owns NR = K+1 (+K) workspace rows. Every vocabulary row is cut into
chunks handled by separate programs, so a batch of one still fills the GPU.

1. ``stats_kernel``   grid (B*(K+1), C): per (row, chunk) online-softmax (max, sum exp) of the warped z, or
                      (max, first argmax) of the float32 logits for greedy, and validity flags (of the scaled z
                      when sampling, of the logits for greedy; ``reference.py``).
2. ``race_kernel``    grid (B, C2): combines the partials (every program of a batch entry does the same, cheap,
                      deterministic combine), gathers p_i(x_i), q_i(x_i), runs the accept test, then an exponential
                      race over its chunk of max(0, p_n - q_n) and of p_n (the zero-residual fallback).
3. ``finish_*``       grid (B,): combines the race (or greedy argmax) partials and writes tokens / num_accepted.

z = float32(logits) / temperature is a correctly rounded division (``tl.math.div_rn``), like torch on CPU.
"""

import triton
import triton.language as tl

from .triton_random import (
    exponential_from_bits,
    philox_first_word,
    philox_key,
    precise_exp,
    uniform_from_bits,
)

FLAG_BAD = tl.constexpr(1)  # the chunk holds NaN or +inf
FLAG_ALIVE = tl.constexpr(2)  # the chunk holds a value > -inf
INT_MAX = tl.constexpr(2**31 - 1)
GROUP = tl.constexpr(8)  # pass-1 ids per tile row (``_row_chunk_stats``)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _scale(x, temperature, SCALE: tl.constexpr):
    """float32 logits x -> z = x / temperature (correctly rounded)."""
    if SCALE:
        z = tl.math.div_rn(x, tl.cast(temperature, tl.float32))  # inductor passes a python float as fp64
    else:
        z = x
    return z


@triton.jit
def _cut(z, v, cut_value, cut_index, HAS_CUT: tl.constexpr):
    """Scaled logits z at vocabulary ids v -> entries outside the (value, index) cut set to -inf."""
    if HAS_CUT:
        keep = (z > cut_value) | ((z == cut_value) & (v >= cut_index))
        z = tl.where(keep, z, float("-inf"))
    return z


@triton.jit
def warp_logit(x, v, temperature, cut_value, cut_index, SCALE: tl.constexpr, HAS_CUT: tl.constexpr):
    """float32 logits x at vocabulary ids v -> warped z (entries outside the (value, index) cut set to -inf)."""
    return _cut(_scale(x, temperature, SCALE), v, cut_value, cut_index, HAS_CUT)


@triton.jit
def _chunk_flags(hi):
    """Validity flags of a chunk from ``hi`` [rows, GROUP], each lane's NaN-propagating max of the values judged
    (masked lanes hold -inf): NaN or +inf iff the lane saw one; > -inf iff it saw a value > -inf (a NaN lane leaves
    alive unset, but its bad flag invalidates the row anyway)."""
    bad = tl.max(tl.max(((hi != hi) | (hi == float("inf"))).to(tl.int32), 1), 0)
    alive = tl.max(tl.max((hi > float("-inf")).to(tl.int32), 1), 0)
    return bad * FLAG_BAD + alive * FLAG_ALIVE


@triton.jit
def _row_chunk_stats(
    x_ptr, stride_v, start, end, temperature, cut_value, cut_index, ws,
    WS_M_ptr, WS_S_ptr, WS_I_ptr, WS_F_ptr, WS_R_ptr,
    GREEDY: tl.constexpr, BOTH: tl.constexpr, SCALE: tl.constexpr, HAS_CUT: tl.constexpr, PRECISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Partials of x[start:end] written at workspace slot ``ws``: (max z, sum exp(z - max)) or, for greedy,
    (max x, first index of it); plus the chunk's validity flags. ``BOTH`` (per-row parameters, greedy and sampled rows
    in one launch): the softmax partials and, in WS_R / WS_I, the greedy ones (max x, first index).

    A tile is [BLOCK_V // GROUP, GROUP], GROUP consecutive ids per row (one 16-byte load, which Triton keeps in one
    thread's registers), and everything but the final combine stays per lane or per row: the validity flags (``hi``),
    the argmax, and the online softmax, rescaled once per row and tile. No reduction across threads inside the loop
    (sm_90 SASS: no shuffle or barrier in it)."""
    offs = tl.arange(0, BLOCK_V // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    # Per lane: the NaN-propagating max of what validity is judged on.
    hi = tl.full([BLOCK_V // GROUP, GROUP], float("-inf"), tl.float32)
    best = tl.full([BLOCK_V // GROUP, GROUP], float("-inf"), tl.float32)
    best_base = tl.full([BLOCK_V // GROUP, GROUP], -1, tl.int32)  # the tile where the lane's best was read
    m_row = tl.full([BLOCK_V // GROUP], float("-inf"), tl.float32)
    s_row = tl.zeros([BLOCK_V // GROUP], tl.float32)
    for base in range(start, end, BLOCK_V):
        v = base + offs
        x = tl.load(x_ptr + v.to(tl.int64) * stride_v, mask=v < end, other=float("-inf")).to(tl.float32)
        if GREEDY or BOTH:
            if GREEDY:
                hi = tl.maximum(hi, x, propagate_nan=tl.PropagateNan.ALL)
            better = x > best  # strict: a lane keeps its first (lowest) index on ties
            best = tl.where(better, x, best)
            best_base = tl.where(better, base, best_base)
        if not GREEDY:
            z = _scale(x, temperature, SCALE)
            # judged after scaling: a logit that overflows invalidates the row
            hi = tl.maximum(hi, z, propagate_nan=tl.PropagateNan.ALL)
            z = _cut(z, v, cut_value, cut_index, HAS_CUT)
            m_new = tl.maximum(m_row, tl.max(z, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_row = s_row * precise_exp(m_row - m_safe, PRECISE) + tl.sum(
                precise_exp(z - m_safe[:, None], PRECISE), 1)
            m_row = m_new
    if GREEDY or BOTH:
        best_max = tl.max(tl.max(best, 1), 0)
        best_idx = tl.where(best_base < 0, INT_MAX, best_base + offs)
        tl.store(WS_I_ptr + ws, tl.min(tl.min(tl.where(best == best_max, best_idx, INT_MAX), 1), 0))
        if GREEDY:
            tl.store(WS_M_ptr + ws, best_max)
        else:
            tl.store(WS_R_ptr + ws, best_max)
    if not GREEDY:
        m = tl.max(m_row, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        tl.store(WS_S_ptr + ws, tl.sum(s_row * precise_exp(m_row - m_safe, PRECISE), 0))
        tl.store(WS_M_ptr + ws, m)
    tl.store(WS_F_ptr + ws, _chunk_flags(hi))


@triton.jit
def row_temperature(TEMP_ptr, b, temperature, ROW_PARAMS: tl.constexpr):
    """The temperature of batch entry b: the scalar, or TEMP_ptr[b] with 0 (a greedy row) read as 1, so that a
    greedy row's z is its float32 logits (its validity flags are then the raw logits', as greedy judges them)."""
    if ROW_PARAMS:
        t = tl.load(TEMP_ptr + b)
        t = tl.where(t == 0.0, 1.0, t)
    else:
        t = temperature
    return t


@triton.jit
def draft_limit(NB_ptr, b, K, HAS_LIMIT: tl.constexpr):
    """(n_b clamped to 0..K, 1 if num_draft_tokens[b] is outside 0..K) for batch entry b; (K, 0) without a limit."""
    if HAS_LIMIT:
        raw = tl.load(NB_ptr + b)
        nb = tl.minimum(tl.maximum(raw, 0), K).to(tl.int32)
        bad = ((raw < 0) | (raw > K)).to(tl.int32)
    else:
        nb = K
        bad = 0
    return nb, bad


# Arguments that change with the batch size are not specialised (``do_not_specialize``): Triton would otherwise key a
# compilation on each integer's "== 1" / "% 16 == 0" class, and a server would recompile for new batch sizes. The
# sizes that do not vary with B (V, K, chunk sizes: multiples of the tile) and the strides keep their specialisation,
# which gives the loads their 16-byte alignment.
@triton.jit(do_not_specialize=["plane"])
def stats_kernel(
    T_ptr, stride_tb, stride_tj, stride_tv,  # target logits [B, K+1, V]
    D_ptr, stride_db, stride_di, stride_dv,  # draft logits [B, K, V] (HAS_DRAFT)
    CUT_TV_ptr, CUT_TI_ptr,  # target cut (value float32, index int32) [B*(K+1)] (HAS_CUT)
    CUT_DV_ptr, CUT_DI_ptr,  # draft cut [B*K] (HAS_CUT and HAS_DRAFT)
    TEMP_ptr, NB_ptr,  # temperature [B] float32 (ROW_PARAMS), num_draft_tokens [B] int64 (HAS_LIMIT)
    WSF_ptr, WSI_ptr, plane,  # float32 [2 (+1 ROW_PARAMS), B*NR, C] (max, sum exp, raw max); int32 [2, B*NR, C]
    V, K, chunk_size, temperature,
    HAS_DRAFT: tl.constexpr, HAS_CUT: tl.constexpr, GREEDY: tl.constexpr, SCALE: tl.constexpr,
    ROW_PARAMS: tl.constexpr, HAS_LIMIT: tl.constexpr, PRECISE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Pass 1, grid (B*(K+1), C): target row (b, j) and, with draft logits and j < K, draft row (b, j). With a
    per-row draft limit n_b, rows a batch entry does not use (target j > n_b, draft j >= n_b) are not read."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks = tl.num_programs(1)
    b = row // (K + 1)
    j = row - b * (K + 1)
    num_rows = K + 1
    if HAS_DRAFT:
        num_rows += K
    nb, _ = draft_limit(NB_ptr, b, K, HAS_LIMIT)
    t = row_temperature(TEMP_ptr, b, temperature, ROW_PARAMS)
    start = chunk * chunk_size
    end = tl.minimum(start + chunk_size, V)
    cut_value = float("-inf")
    cut_index = 0
    if HAS_CUT:
        cut_value = tl.load(CUT_TV_ptr + row)
        cut_index = tl.load(CUT_TI_ptr + row)
    x_ptr = T_ptr + b.to(tl.int64) * stride_tb + j.to(tl.int64) * stride_tj
    ws = (b * num_rows + j) * num_chunks + chunk
    _row_chunk_stats(x_ptr, stride_tv, start, tl.where(j <= nb, end, start), t, cut_value, cut_index, ws,
                     WSF_ptr, WSF_ptr + plane, WSI_ptr, WSI_ptr + plane, WSF_ptr + 2 * plane,
                     GREEDY, ROW_PARAMS, SCALE, HAS_CUT, PRECISE, BLOCK_V)
    if HAS_DRAFT:
        if j < K:
            d_cut_value = float("-inf")
            d_cut_index = 0
            if HAS_CUT:
                d_cut_value = tl.load(CUT_DV_ptr + b * K + j)
                d_cut_index = tl.load(CUT_DI_ptr + b * K + j)
            d_ptr = D_ptr + b.to(tl.int64) * stride_db + j.to(tl.int64) * stride_di
            d_ws = (b * num_rows + K + 1 + j) * num_chunks + chunk
            _row_chunk_stats(d_ptr, stride_dv, start, tl.where(j < nb, end, start), t, d_cut_value, d_cut_index,
                             d_ws, WSF_ptr, WSF_ptr + plane, WSI_ptr, WSI_ptr + plane, WSF_ptr + 2 * plane,
                             GREEDY, ROW_PARAMS, SCALE, HAS_CUT, PRECISE, BLOCK_V)


@triton.jit
def combine_softmax(WS_M_ptr, WS_S_ptr, WS_F_ptr, rows, row_mask, num_chunks,
                     PRECISE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Combine the chunk partials of workspace rows ``rows`` [BLOCK_R] -> (max, sum exp, OR of flags)."""
    m_all = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s_all = tl.zeros([BLOCK_R], tl.float32)
    f_all = tl.zeros([BLOCK_R], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < num_chunks)[None, :]
        idx = rows[:, None] * num_chunks + cols[None, :]
        m = tl.load(WS_M_ptr + idx, mask=mask, other=float("-inf"))
        s = tl.load(WS_S_ptr + idx, mask=mask, other=0.0)
        f = tl.load(WS_F_ptr + idx, mask=mask, other=0)
        m_new = tl.maximum(m_all, tl.max(m, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_all = s_all * precise_exp(m_all - m_safe, PRECISE) + tl.sum(
            s * precise_exp(m - m_safe[:, None], PRECISE), 1)
        m_all = m_new
        f_all = f_all | tl.reduce(f, 1, _bit_or)
    return m_all, s_all, f_all


@triton.jit
def combine_argmax(WS_M_ptr, WS_I_ptr, WS_F_ptr, rows, row_mask, num_chunks,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Combine greedy partials of rows [BLOCK_R] -> (max, first index of the max, OR of flags)."""
    best = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK_R], INT_MAX, tl.int32)
    f_all = tl.zeros([BLOCK_R], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = row_mask[:, None] & (cols < num_chunks)[None, :]
        idx = rows[:, None] * num_chunks + cols[None, :]
        m = tl.load(WS_M_ptr + idx, mask=mask, other=float("-inf"))
        i = tl.load(WS_I_ptr + idx, mask=mask, other=INT_MAX)
        f = tl.load(WS_F_ptr + idx, mask=mask, other=0)
        blk = tl.max(m, 1)
        blk_idx = tl.min(tl.where(m == blk[:, None], i, INT_MAX), 1)
        better = blk > best  # earlier chunk blocks hold lower indices
        best = tl.where(better, blk, best)
        best_idx = tl.where(better, blk_idx, best_idx)
        f_all = f_all | tl.reduce(f, 1, _bit_or)
    return best, best_idx, f_all


@triton.jit
def row_invalid(flags, row_mask):
    """1 if any masked-in row has NaN/+inf or is entirely -inf."""
    bad = ((flags & FLAG_BAD) != 0) | ((flags & FLAG_ALIVE) == 0)
    return tl.max((bad & row_mask).to(tl.int32), 0)


@triton.jit
def pick_lane(vec, lanes, n):
    """vec[n] for a block ``vec`` indexed by ``lanes`` (exact: one term plus zeros)."""
    return tl.sum(tl.where(lanes == n, vec, 0), 0)


@triton.jit
def write_tokens(OUT_ptr, stride_ob, NUM_ptr, X_ptr, stride_xb, stride_xi, b, n, next_token, invalid, K,
                  BLOCK_K: tl.constexpr):
    """tokens[b] = accepted drafts, next token, then -1; all -1 and num_accepted -1 for an invalid row."""
    pos = tl.arange(0, BLOCK_K)
    x = tl.load(X_ptr + b * stride_xb + pos * stride_xi, mask=pos < K, other=-1).to(tl.int64)
    out = tl.where(pos < n, x, tl.where(pos == n, next_token.to(tl.int64), -1))
    out = tl.where(invalid != 0, -1, out)
    tl.store(OUT_ptr + b * stride_ob + pos, out, mask=pos <= K)
    tl.store(NUM_ptr + b, tl.where(invalid != 0, -1, n).to(tl.int64))


@triton.jit
def load_draft_tokens(X_ptr, stride_xb, stride_xi, b, lanes, K, V):
    """Draft tokens of batch entry b on lanes < K (the row's draft limit n_b: later lanes are not read) ->
    (clamped ids int32, 1 if any id read is outside [0, V))."""
    in_k = lanes < K
    x = tl.load(X_ptr + b * stride_xb + lanes * stride_xi, mask=in_k, other=0).to(tl.int64)
    oob = tl.max((in_k & ((x < 0) | (x >= V))).to(tl.int32), 0)
    return tl.minimum(tl.maximum(x, 0), V - 1).to(tl.int32), oob


@triton.jit(do_not_specialize=["plane", "num_chunks"])
def finish_greedy_kernel(
    WSF_ptr, WSI_ptr, plane,  # greedy partials: float32 [B*NR, C] max, int32 [2, B*NR, C] (argmax, flags)
    X_ptr, stride_xb, stride_xi,  # draft tokens [B, K]
    NB_ptr,  # num_draft_tokens [B] int64 (HAS_LIMIT)
    OUT_ptr, stride_ob, NUM_ptr,  # tokens [B, K+1] int64, num_accepted [B] int64
    V, K, num_chunks,
    HAS_DRAFT: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Greedy pass 2, grid (B,): accept while x_i == argmax z_i (i < n_b), then emit argmax z_n."""
    b = tl.program_id(0)
    lanes = tl.arange(0, BLOCK_K)
    num_rows = K + 1
    if HAS_DRAFT:
        num_rows += K
    nb, bad_nb = draft_limit(NB_ptr, b, K, HAS_LIMIT)
    _, best_idx, flags = combine_argmax(WSF_ptr, WSI_ptr, WSI_ptr + plane, b * num_rows + lanes, lanes <= K,
                                        num_chunks, BLOCK_K, BLOCK_C)
    invalid = row_invalid(flags, lanes <= nb) | bad_nb
    if HAS_DRAFT:
        _, _, d_flags = combine_argmax(WSF_ptr, WSI_ptr, WSI_ptr + plane, b * num_rows + K + 1 + lanes,
                                       lanes < K, num_chunks, BLOCK_K, BLOCK_C)
        invalid = invalid | row_invalid(d_flags, lanes < nb)
    x, oob = load_draft_tokens(X_ptr, stride_xb, stride_xi, b, lanes, nb, V)
    rejected = (lanes < nb) & (x != best_idx)
    n = tl.min(tl.where(rejected, lanes, nb), 0)
    next_token = pick_lane(best_idx, lanes, n)
    write_tokens(OUT_ptr, stride_ob, NUM_ptr, X_ptr, stride_xb, stride_xi, b, n, next_token, invalid | oob, K,
                  BLOCK_K)


@triton.jit
def scale_kernel(
    X_ptr, stride_xb, stride_xj, stride_xv,  # logits [B, J, V]
    Z_ptr,  # out: z [B*J, V] float32, contiguous
    TEMP_ptr,  # temperature [B] float32 (ROW_PARAMS)
    J, V, temperature,
    SCALE: tl.constexpr, ROW_PARAMS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """z = float32(x) / temperature, written out for ``warp_thresholds``; grid (B*J, cdiv(V, BLOCK_V)).

    The top-k/top-p cut must be computed from bit-for-bit the z the other kernels compute (torch's CUDA
    division by a python scalar multiplies by the reciprocal instead), so this kernel shares ``warp_logit``.
    """
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    b = row // J
    j = row - b * J
    mask = v < V
    x = tl.load(X_ptr + b.to(tl.int64) * stride_xb + j.to(tl.int64) * stride_xj + v.to(tl.int64) * stride_xv,
                mask=mask, other=0.0).to(tl.float32)
    z = warp_logit(x, v, row_temperature(TEMP_ptr, b, temperature, ROW_PARAMS), 0.0, 0, SCALE, False)
    tl.store(Z_ptr + row.to(tl.int64) * V + v, z, mask=mask)
