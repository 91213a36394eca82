"""Pass 2 and 3 of the sampling path: accept/reject decision plus the chunked exponential race, then the finish.

Leviathan et al. 2023, Algorithm 1, with the project's counters (``philox.py``): x_i is accepted iff q_i(x_i) > 0
and r_i * q_i(x_i) < p_i(x_i); the next token is argmax_v w_v / E_v with w = max(0, p_n - q_n) (q_K := 0), or
w = p_n when that residual is all zero. Each program races over one chunk of the vocabulary for both weights and
writes (best ratio, first index) partials; ``finish_sample_kernel`` picks the winner per batch entry.
"""

import triton
import triton.language as tl

from .philox import STREAM_ACCEPT
from .triton_kernels import (
    INT_MAX,
    combine_argmax,
    combine_softmax,
    draft_limit,
    load_draft_tokens,
    pick_lane,
    row_invalid,
    row_temperature,
    warp_logit,
    write_tokens,
)
from .triton_random import (
    exponential_from_bits,
    philox_first_word,
    philox_key,
    precise_exp,
    uniform_from_bits,
    vocabulary_bits,
)

_STREAM_ACCEPT = tl.constexpr(STREAM_ACCEPT)


@triton.jit
def _prob(z, m, s, PRECISE: tl.constexpr):
    """softmax entry exp(z - m) / s with a correctly rounded division."""
    return tl.math.div_rn(precise_exp(z - m, PRECISE), s)


@triton.jit
def _probs_at_tokens(L_ptr, stride_lb, stride_lj, stride_lv, CUT_V_ptr, CUT_I_ptr, cut_row0, b, lanes, x, in_k,
                     m, s, temperature, SCALE: tl.constexpr, HAS_CUT: tl.constexpr, PRECISE: tl.constexpr):
    """p_i(x_i) for lanes i (rows of one batch entry b of logits L), 0 on lanes outside ``in_k``."""
    ptr = L_ptr + b.to(tl.int64) * stride_lb + lanes.to(tl.int64) * stride_lj + x.to(tl.int64) * stride_lv
    logit = tl.load(ptr, mask=in_k, other=float("-inf")).to(tl.float32)
    cut_value = float("-inf")
    cut_index = 0
    if HAS_CUT:
        cut_value = tl.load(CUT_V_ptr + cut_row0 + lanes, mask=in_k, other=float("-inf"))
        cut_index = tl.load(CUT_I_ptr + cut_row0 + lanes, mask=in_k, other=0)
    z = warp_logit(logit, x, temperature, cut_value, cut_index, SCALE, HAS_CUT)
    return tl.where(in_k, _prob(z, tl.where(in_k, m, 0.0), tl.where(in_k, s, 1.0), PRECISE), 0.0)


@triton.jit(do_not_specialize=["stride_seed", "stride_offset", "plane", "B", "num_chunks", "seed_per_row"])
def race_kernel(
    T_ptr, stride_tb, stride_tj, stride_tv,  # target logits [B, K+1, V]
    D_ptr, stride_db, stride_di, stride_dv,  # draft logits [B, K, V] (HAS_DRAFT)
    X_ptr, stride_xb, stride_xi,  # draft tokens [B, K]
    CUT_TV_ptr, CUT_TI_ptr, CUT_DV_ptr, CUT_DI_ptr,  # cuts [B*(K+1)], [B*K] (HAS_CUT)
    SEED_ptr, stride_seed, OFFSET_ptr, stride_offset,  # [B] int64
    TEMP_ptr, NB_ptr,  # temperature [B] float32 (ROW_PARAMS), num_draft_tokens [B] int64 (HAS_LIMIT)
    WSF_ptr, WSI_ptr, plane,  # pass-1 partials: float32 [2 (+1), B*NR, C] (max, sum exp, raw max), int32 [2, B*NR, C]
    RF_ptr, RI_ptr, B,  # race partials: float32 [2, B, C2] (residual, p), int32 [3, B, C2] + [2 (+2), B] (see finish)
    V, K, num_chunks, race_chunk_size, temperature, seed_per_row, stream_base,
    HAS_DRAFT: tl.constexpr, HAS_CUT: tl.constexpr, SCALE: tl.constexpr, RESIDUAL: tl.constexpr,
    ROW_PARAMS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    PRECISE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Grid (B, C2). Every program of batch entry b decides n (identically), then races over its chunk. A row only
    uses its first n_b drafts (``draft_limit``); with per-row parameters a greedy row (temperature 0) decides by
    argmax and skips the race."""
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    num_chunks2 = tl.num_programs(1)
    WS_M_ptr = WSF_ptr
    WS_S_ptr = WSF_ptr + plane
    WS_F_ptr = WSI_ptr + plane
    lanes = tl.arange(0, BLOCK_K)
    nb, bad_nb = draft_limit(NB_ptr, b, K, HAS_LIMIT)
    in_k = lanes < nb
    num_rows = K + 1
    if HAS_DRAFT:
        num_rows += K
    t = row_temperature(TEMP_ptr, b, temperature, ROW_PARAMS)
    k0, k1 = philox_key(tl.load(SEED_ptr + b * stride_seed))
    c1 = tl.where(seed_per_row != 0, 0, b).to(tl.uint32)
    c2 = (tl.load(OFFSET_ptr + b * stride_offset) & 0xFFFFFFFF).to(tl.uint32)

    # Decision: combine the softmax partials, then p_i(x_i), q_i(x_i) and the accept test (Algorithm 1).
    mt, st, ft = combine_softmax(WS_M_ptr, WS_S_ptr, WS_F_ptr, b * num_rows + lanes, lanes <= K, num_chunks,
                                  PRECISE, BLOCK_K, BLOCK_C)
    invalid = row_invalid(ft, lanes <= nb) | bad_nb
    x, oob = load_draft_tokens(X_ptr, stride_xb, stride_xi, b, lanes, nb, V)
    invalid = invalid | oob
    p_x = _probs_at_tokens(T_ptr, stride_tb, stride_tj, stride_tv, CUT_TV_ptr, CUT_TI_ptr, b * (K + 1), b, lanes,
                           x, in_k, mt, st, t, SCALE, HAS_CUT, PRECISE)
    if HAS_DRAFT:
        md, sd, fd = combine_softmax(WS_M_ptr, WS_S_ptr, WS_F_ptr, b * num_rows + K + 1 + lanes, lanes < K,
                                      num_chunks, PRECISE, BLOCK_K, BLOCK_C)
        invalid = invalid | row_invalid(fd, in_k)
        q_x = _probs_at_tokens(D_ptr, stride_db, stride_di, stride_dv, CUT_DV_ptr, CUT_DI_ptr, b * K, b, lanes,
                               x, in_k, md, sd, t, SCALE, HAS_CUT, PRECISE)
    else:
        q_x = tl.where(in_k, 1.0, 0.0)
    r = uniform_from_bits(philox_first_word(k0, k1, lanes.to(tl.uint32), c1, c2, _STREAM_ACCEPT))
    accepted = (q_x > 0) & (r * q_x < p_x)
    n = tl.min(tl.where(in_k & ~accepted, lanes, nb), 0)
    race_plane = B * num_chunks2
    start = chunk * race_chunk_size
    end = tl.minimum(start + race_chunk_size, V)
    if ROW_PARAMS:  # a greedy row: accept while x_i == argmax, emit the argmax at n; no race
        greedy = tl.load(TEMP_ptr + b) == 0.0
        _, best_idx, _ = combine_argmax(WSF_ptr + 2 * plane, WSI_ptr, WS_F_ptr, b * num_rows + lanes, lanes <= K,
                                        num_chunks, BLOCK_K, BLOCK_C)
        n_greedy = tl.min(tl.where(in_k & (x != best_idx), lanes, nb), 0)
        n = tl.where(greedy, n_greedy, n)
        tl.store(RI_ptr + 3 * race_plane + 2 * B + b, greedy.to(tl.int32), mask=chunk == 0)
        tl.store(RI_ptr + 3 * race_plane + 3 * B + b, pick_lane(best_idx, lanes, n), mask=chunk == 0)
        end = tl.where(greedy, start, end)
    tl.store(RI_ptr + 3 * race_plane + b, n, mask=chunk == 0)
    tl.store(RI_ptr + 3 * race_plane + B + b, invalid, mask=chunk == 0)

    # Race over this chunk of row n: weights max(0, p_n - q_n) and, for the fallback, p_n.
    m_n = pick_lane(mt, lanes, n)
    s_n = pick_lane(st, lanes, n)
    t_row = T_ptr + b.to(tl.int64) * stride_tb + n.to(tl.int64) * stride_tj
    cut_value = float("-inf")
    cut_index = 0
    if HAS_CUT:
        cut_value = tl.load(CUT_TV_ptr + b * (K + 1) + n)
        cut_index = tl.load(CUT_TI_ptr + b * (K + 1) + n)
    has_q = n < nb  # q := 0 once all n_b drafts are accepted: the bonus position races over p_n
    x_q = tl.where(has_q, pick_lane(x, lanes, n), -1)  # one-hot q's token, -1 for none
    if HAS_DRAFT:
        nd = tl.minimum(n, K - 1)
        md_n = tl.where(has_q, pick_lane(md, lanes, n), 0.0)
        sd_n = tl.where(has_q, pick_lane(sd, lanes, n), 1.0)
        d_row = D_ptr + b.to(tl.int64) * stride_db + nd.to(tl.int64) * stride_di
        d_cut_value = float("-inf")
        d_cut_index = 0
        if HAS_CUT:
            d_cut_value = tl.load(CUT_DV_ptr + b * K + nd)
            d_cut_index = tl.load(CUT_DI_ptr + b * K + nd)
    stream = (stream_base + n).to(tl.uint32)

    offs = tl.arange(0, BLOCK_V)
    best_r = tl.full([BLOCK_V], -1.0, tl.float32)
    idx_r = tl.full([BLOCK_V], INT_MAX, tl.int32)
    best_p = tl.full([BLOCK_V], -1.0, tl.float32)
    idx_p = tl.full([BLOCK_V], INT_MAX, tl.int32)
    any_r = tl.zeros([BLOCK_V], tl.int32)
    q_end = tl.where(has_q, end, 0)  # (a scalar-bool & block mask trips the interpreter; a bound does not)
    for base in range(start, end, BLOCK_V):  # (base is a multiple of BLOCK_V, as race_chunk_size is: of 4 too)
        v = base + offs
        mask = v < end
        logit = tl.load(t_row + v.to(tl.int64) * stride_tv, mask=mask, other=float("-inf")).to(tl.float32)
        p = _prob(warp_logit(logit, v, t, cut_value, cut_index, SCALE, HAS_CUT), m_n, s_n, PRECISE)
        if tl.max(p, 0) > 0:
            e = exponential_from_bits(vocabulary_bits(k0, k1, base, c1, c2, stream, BLOCK_V), PRECISE)
        else:  # every p of the tile 0 (cut by top-k/top-p, or underflowed): residual 0 too, so every key is 0 / E
            e = tl.full([BLOCK_V], 1.0, tl.float32)  # = 0 / 1 bit for bit (E > 0): no random numbers drawn
        race_p = True  # (without RESIDUAL p is the only race)
        if RESIDUAL:
            if HAS_DRAFT:
                d_logit = tl.load(d_row + v.to(tl.int64) * stride_dv, mask=v < q_end,
                                  other=float("-inf")).to(tl.float32)
                q = _prob(warp_logit(d_logit, v, t, d_cut_value, d_cut_index, SCALE, HAS_CUT), md_n, sd_n,
                          PRECISE)
            else:
                q = tl.where(v == x_q, 1.0, 0.0)
            residual = tl.maximum(p - q, 0.0)
            w_r = tl.where(mask, tl.math.div_rn(residual, e), -1.0)
            better = w_r > best_r  # strict: a lane keeps its first (lowest) index on ties
            best_r = tl.where(better, w_r, best_r)
            idx_r = tl.where(better, v, idx_r)
            any_r = any_r | (mask & (residual > 0)).to(tl.int32)
            # The race over p decides only a row whose residual is 0 at every id (finish_sample_kernel): once a
            # residual of this program is positive its p partial is never read, so from that tile on it skips the p
            # race (a division and an update per id). A row that falls back had none positive: every tile raced p.
            race_p = tl.max(any_r, 0) == 0
        if race_p:
            w_p = tl.where(mask, tl.math.div_rn(p, e), -1.0)
            better = w_p > best_p
            best_p = tl.where(better, w_p, best_p)
            idx_p = tl.where(better, v, idx_p)

    slot = b * num_chunks2 + chunk
    top_r = tl.max(best_r, 0)
    tl.store(RF_ptr + slot, top_r)
    tl.store(RI_ptr + slot, tl.min(tl.where(best_r == top_r, idx_r, INT_MAX), 0))
    top_p = tl.max(best_p, 0)
    tl.store(RF_ptr + race_plane + slot, top_p)
    tl.store(RI_ptr + race_plane + slot, tl.min(tl.where(best_p == top_p, idx_p, INT_MAX), 0))
    tl.store(RI_ptr + 2 * race_plane + slot, tl.max(any_r, 0))


@triton.jit
def _combine_race(W_ptr, I_ptr, row0, num_chunks2, BLOCK_C: tl.constexpr):
    """Winner (ratio, first index) over the chunk partials W/I[row0 : row0 + num_chunks2]."""
    best = -2.0
    best_idx = INT_MAX
    for c0 in range(0, num_chunks2, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = cols < num_chunks2
        w = tl.load(W_ptr + row0 + cols, mask=mask, other=-2.0)
        i = tl.load(I_ptr + row0 + cols, mask=mask, other=INT_MAX)
        blk = tl.max(w, 0)
        blk_idx = tl.min(tl.where(w == blk, i, INT_MAX), 0)
        better = blk > best  # earlier chunk blocks hold lower indices
        best = tl.where(better, blk, best)
        best_idx = tl.where(better, blk_idx, best_idx)
    return best_idx


@triton.jit(do_not_specialize=["B", "num_chunks2"])
def finish_sample_kernel(
    RF_ptr, RI_ptr, B,  # race partials, layout of race_kernel: float32 [2, B, C2]; int32 [3, B, C2] + n [B] + bad [B]
    #                     (+ greedy [B] + greedy token [B] with ROW_PARAMS)
    X_ptr, stride_xb, stride_xi,  # draft tokens [B, K]
    OUT_ptr, stride_ob, NUM_ptr,  # tokens [B, K+1] int64, num_accepted [B] int64
    K, num_chunks2,
    RESIDUAL: tl.constexpr, ROW_PARAMS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Pass 3, grid (B,): the race winner (residual, or p_n when the residual is all zero; a greedy row's argmax
    with per-row parameters) and the output row."""
    b = tl.program_id(0)
    race_plane = B * num_chunks2
    row0 = b * num_chunks2
    next_token = _combine_race(RF_ptr + race_plane, RI_ptr + race_plane, row0, num_chunks2, BLOCK_C)
    if RESIDUAL:
        cols = tl.arange(0, BLOCK_C)
        any_r = 0
        for c0 in range(0, num_chunks2, BLOCK_C):
            flags = tl.load(RI_ptr + 2 * race_plane + row0 + c0 + cols, mask=c0 + cols < num_chunks2, other=0)
            any_r = any_r | tl.max(flags, 0)
        residual_token = _combine_race(RF_ptr, RI_ptr, row0, num_chunks2, BLOCK_C)
        next_token = tl.where(any_r != 0, residual_token, next_token)
    if ROW_PARAMS:
        greedy = tl.load(RI_ptr + 3 * race_plane + 2 * B + b)
        next_token = tl.where(greedy != 0, tl.load(RI_ptr + 3 * race_plane + 3 * B + b), next_token)
    n = tl.load(RI_ptr + 3 * race_plane + b)
    invalid = tl.load(RI_ptr + 3 * race_plane + B + b)
    write_tokens(OUT_ptr, stride_ob, NUM_ptr, X_ptr, stride_xb, stride_xi, b, n, next_token, invalid, K, BLOCK_K)
