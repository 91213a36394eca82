// Speculative verification and draft sampling kernels; see verify_kernels.cuh for the pipeline and the contract,
// speculative_kernels/ops/reference.py for the semantics.
//
// Arithmetic that decides a result uses explicitly rounded intrinsics (__fdiv_rn, __fsub_rn, __fmul_rn), so the
// build flags (FMA contraction, --use_fast_math) cannot change it: z = x / T is a true division, p_v =
// exp(z_v - max) / sum, the accept test is r * q < p, the race compares w_v / E_v.
#include "common.cuh"
#include "philox.cuh"
#include "verify_kernels.cuh"

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace speculative_kernels {
namespace {

constexpr int kDecideThreads = 256;
constexpr int kFinalizeThreads = 32;
// The fused sampling pass (decide_race_kernel): used for a batch of one, and for larger batches while batch x vocab
// stays within kFusedMaxBatchVocab, with races of this many elements per block (smaller than kChunkSize so that a
// batch of one fills the SMs: 251 blocks at V = 128256, not 63), while the row's R stats fit this much shared
// memory. Measured on an H200 (RESULTS.md, sixth GPU run; bf16, CUDA graph, cold L2): fused / split 0.90-0.93 at
// V = 32000 for B <= 4, 0.97-1.00 at V >= 128256 for B = 1, but 1.31-1.45 at B = 8 (V = 32000) and at B = 2
// (V >= 128256), up to 3.8 at B = 64: each fused block re-reads its row's statistics.
constexpr long long kFusedMaxBatchVocab = 4LL * 32768;
constexpr int kFusedRaceChunk = 512;
constexpr size_t kFusedMaxSharedBytes = 32 * 1024;
constexpr int kMaxGridY = 65535;
constexpr size_t kWorkspaceAlign = 256;

// Per (logit row, chunk) partials, and after `decide` the same fields combined over the whole row.
struct ChunkStats {
  float raw_max;  // max of float32(logits), NaN-first like torch.argmax
  int raw_arg;    // its first index (INT_MAX when empty)
  float m;        // max of the kept warped logits z (-inf when none; > -inf iff some scaled z is)
  float s;        // sum of exp(z - m) over the kept z
  int bad;        // any NaN or +inf logit (sampling: scaled logit z = x / T, which a NaN or +inf logit makes one)
};

struct Decision {
  int n;        // accepted draft tokens, 0..K
  int invalid;  // 1: the row's outputs are all -1
};

// Per (batch row, chunk) race partials: argmax of residual / E and of p / E, and whether any residual > 0.
struct RacePartial {
  float residual_value;
  int residual_index;
  float p_value;
  int p_index;
  int any_positive;
};

// The single kernel's counters: one int region of the workspace, [1 + 3B], zeroed by one cudaMemsetAsync before the
// launch (the workspace is the caller's fresh memory: nothing earlier in the call could zero it).
struct SingleCounters {
  int* next_item;   // [1]: work items claimed so far (each block claims its item: see single_pass_kernel)
  int* stats_done;  // [B]: statistics items of the batch row done
  int* decided;     // [B]: 1 once the row's decision, row_stats and outputs of a greedy/invalid row are published
  int* race_done;   // [B]: race items of the row done
};

struct Workspace {
  ChunkStats* chunk_stats;  // [B * R, num_chunks]
  ChunkStats* row_stats;    // [B * R] (split passes)
  Decision* decisions;      // [B] (split passes)
  RacePartial* race;        // [B, num_race_chunks]
  int* race_tickets;        // [B]: race blocks of the row done (fused passes; zeroed by chunk_stats), else nullptr
  SingleCounters single;    // the single kernel's counters (zeroed by the launcher's memset), else all nullptr
};

// Logit rows of one batch row b are ordered j = 0..K (target positions) then K+1..2K (draft positions, only
// with draft logits): R = K + 1 (+ K) rows per batch row, row id b * R + j.
template <typename T>
struct Args {
  const T* target;
  int64_t target_stride_b, target_stride_j;
  const T* draft;
  int64_t draft_stride_b, draft_stride_j;
  bool target_vec, draft_vec;  // rows are 16-byte aligned: vector loads allowed
  const int64_t* draft_tokens;
  int batch, num_draft, vocab, rows_per_batch, num_chunks;
  int race_chunk, num_race_chunks;  // the race pass's vocabulary elements per block (kChunkSize or kFusedRaceChunk)
  float temperature;
  const float* temperature_rows;  // [B] or nullptr
  const int64_t* draft_limit;     // num_draft_tokens [B] or nullptr
  const int32_t* target_cut_source;
  const int32_t* target_cut_index;
  const int32_t* draft_cut_source;
  const int32_t* draft_cut_index;
  const int64_t* seed;
  int64_t seed_stride;
  const int64_t* offset;
  int64_t offset_stride;
  bool seed_per_row;
  uint32_t stream_base;
  int64_t* tokens;
  int64_t* num_accepted;
  Workspace ws;
};

template <typename T>
struct RowRef {
  const T* ptr;
  bool vec;
  bool cut_ok;        // cut_source was inside [0, V)
  float cut_value;    // z of the cut's source element
  int cut_index;
  float temperature;  // the row's divisor (1 for a greedy row of a per-row launch)
  float inverse;      // 1 / temperature, rounded
  bool exact_inverse; // inverse is exactly 1 / temperature (a power of two): x * inverse == x / temperature, bitwise
};

// ---- small device functions ----------------------------------------------------------------------------------
__device__ __forceinline__ ChunkStats stats_identity() { return {-INFINITY, INT_MAX, -INFINITY, 0.0f, 0}; }

__device__ __forceinline__ ChunkStats combine_stats(const ChunkStats& a, const ChunkStats& b) {
  ChunkStats out;
  const bool take_b = argmax_prefers(b.raw_max, b.raw_arg, a.raw_max, a.raw_arg);
  out.raw_max = take_b ? b.raw_max : a.raw_max;
  out.raw_arg = take_b ? b.raw_arg : a.raw_arg;
  out.bad = a.bad | b.bad;
  out.m = fmaxf(a.m, b.m);
  if (out.m == -INFINITY) {
    out.s = 0.0f;
  } else {
    out.s = __fadd_rn(__fmul_rn(a.s, expf(__fsub_rn(a.m, out.m))), __fmul_rn(b.s, expf(__fsub_rn(b.m, out.m))));
  }
  return out;
}

struct CombineStats {
  __device__ __forceinline__ ChunkStats operator()(const ChunkStats& a, const ChunkStats& b) const {
    return combine_stats(a, b);
  }
};

__device__ __forceinline__ RacePartial race_identity() { return {-INFINITY, INT_MAX, -INFINITY, INT_MAX, 0}; }

__device__ __forceinline__ RacePartial combine_race(const RacePartial& a, const RacePartial& b) {
  RacePartial out = a;
  if (argmax_prefers(b.residual_value, b.residual_index, a.residual_value, a.residual_index)) {
    out.residual_value = b.residual_value;
    out.residual_index = b.residual_index;
  }
  if (argmax_prefers(b.p_value, b.p_index, a.p_value, a.p_index)) {
    out.p_value = b.p_value;
    out.p_index = b.p_index;
  }
  out.any_positive = a.any_positive | b.any_positive;
  return out;
}

struct CombineRace {
  __device__ __forceinline__ RacePartial operator()(const RacePartial& a, const RacePartial& b) const {
    return combine_race(a, b);
  }
};

// The temperature of batch row b: the scalar, or its per-row value with 0 (a greedy row) read as 1, so that a greedy
// row's z is its float32 logits and its validity flags are the raw logits' (as greedy judges them).
template <typename T>
__device__ __forceinline__ float row_temperature(const Args<T>& a, int b) {
  if (a.temperature_rows == nullptr) return a.temperature;
  const float t = a.temperature_rows[b];
  return t == 0.0f ? 1.0f : t;
}

// Whether batch row b of a per-row launch is greedy (never, without per-row temperatures: SAMPLING decides).
template <typename T>
__device__ __forceinline__ bool row_greedy(const Args<T>& a, int b) {
  return a.temperature_rows != nullptr && a.temperature_rows[b] == 0.0f;
}

// Batch row b's draft limit n_b clamped to 0..K; *bad: the given value was outside 0..K.
template <typename T>
__device__ __forceinline__ int row_limit(const Args<T>& a, int b, bool* bad) {
  *bad = false;
  if (a.draft_limit == nullptr) return a.num_draft;
  const int64_t n = a.draft_limit[b];
  *bad = n < 0 || n > a.num_draft;
  return static_cast<int>(n < 0 ? 0 : (n > a.num_draft ? a.num_draft : n));
}

// Whether logit row j (target j <= n_b, draft j - (K+1) < n_b) of batch row b is used.
template <typename T>
__device__ __forceinline__ bool row_used(const Args<T>& a, int b, int j) {
  bool bad;
  const int limit = row_limit(a, b, &bad);
  const int num_positions = a.num_draft + 1;
  return j < num_positions ? j <= limit : j - num_positions < limit;
}

// Logit row j (0..R-1) of batch row b, with its top-k/top-p cut.
template <typename T, bool HAS_CUT>
__device__ __forceinline__ RowRef<T> logit_row(const Args<T>& a, int b, int j) {
  RowRef<T> row;
  row.temperature = row_temperature(a, b);
  row.inverse = __frcp_rn(row.temperature);
  row.exact_inverse = __fmaf_rn(row.inverse, row.temperature, -1.0f) == 0.0f;  // inverse * T - 1, rounded once
  row.cut_ok = true;
  row.cut_value = -INFINITY;
  row.cut_index = 0;
  const int num_positions = a.num_draft + 1;
  int cut_source = 0;
  if (j < num_positions) {
    row.ptr = a.target + static_cast<int64_t>(b) * a.target_stride_b + static_cast<int64_t>(j) * a.target_stride_j;
    row.vec = a.target_vec;
    if constexpr (HAS_CUT) {
      const int64_t k = static_cast<int64_t>(b) * num_positions + j;
      cut_source = a.target_cut_source[k];
      row.cut_index = a.target_cut_index[k];
    }
  } else {
    const int i = j - num_positions;
    row.ptr = a.draft + static_cast<int64_t>(b) * a.draft_stride_b + static_cast<int64_t>(i) * a.draft_stride_j;
    row.vec = a.draft_vec;
    if constexpr (HAS_CUT) {
      const int64_t k = static_cast<int64_t>(b) * a.num_draft + i;
      cut_source = a.draft_cut_source[k];
      row.cut_index = a.draft_cut_index[k];
    }
  }
  if constexpr (HAS_CUT) {
    row.cut_ok = cut_source >= 0 && cut_source < a.vocab;
    row.cut_value = row.cut_ok ? __fdiv_rn(to_float(row.ptr[cut_source]), row.temperature) : INFINITY;
  }
  return row;
}

// Whether the top-k/top-p cut keeps element v, of warped logit z.
template <typename T, bool HAS_CUT>
__device__ __forceinline__ bool cut_keeps(const RowRef<T>& row, int v, float z) {
  if constexpr (HAS_CUT) return z > row.cut_value || (z == row.cut_value && v >= row.cut_index);
  return true;
}

// The warped logit z = x / T and whether the top-k/top-p cut keeps element v. z = x * (1/T) where 1/T is exact (T = 1,
// 0.5, 2, ...): the same real number rounded once, so bit for bit x / T (see StatsAccumulator), without a division.
template <typename T, bool HAS_CUT>
__device__ __forceinline__ bool warp_keep(const Args<T>& a, const RowRef<T>& row, int v, float x, float* z) {
  *z = row.exact_inverse ? __fmul_rn(x, row.inverse) : __fdiv_rn(x, row.temperature);
  return cut_keeps<T, HAS_CUT>(row, v, *z);
}

// softmax(warp(row))[v] given the row's combined (m, s): exp(z - m) / s, 0 for a cut element.
template <typename T, bool HAS_CUT>
__device__ __forceinline__ float prob(const Args<T>& a, const RowRef<T>& row, const ChunkStats& stats, int v,
                                      float x) {
  float z;
  if (!warp_keep<T, HAS_CUT>(a, row, v, x, &z)) return 0.0f;
  return __fdiv_rn(expf(__fsub_rn(z, stats.m)), stats.s);
}

template <typename T>
__device__ __forceinline__ uint64_t row_seed(const Args<T>& a, int b) {
  return static_cast<uint64_t>(a.seed[static_cast<int64_t>(b) * a.seed_stride]);
}

template <typename T>
__device__ __forceinline__ uint32_t row_offset(const Args<T>& a, int b) {
  return static_cast<uint32_t>(static_cast<uint64_t>(a.offset[static_cast<int64_t>(b) * a.offset_stride]));
}

template <typename T>
__device__ __forceinline__ uint32_t row_id(const Args<T>& a, int b) {
  return a.seed_per_row ? 0u : static_cast<uint32_t>(b);
}

// Writes the K+1 tokens of batch row b (drafts before n, next at n, then -1; all -1 if invalid) and n.
// Called by every thread of the block.
template <typename T>
__device__ void write_outputs(const Args<T>& a, int b, int n, int next, bool invalid) {
  const int num_positions = a.num_draft + 1;
  for (int j = static_cast<int>(threadIdx.x); j < num_positions; j += static_cast<int>(blockDim.x)) {
    int64_t token = -1;
    if (!invalid) {
      if (j < n) token = a.draft_tokens[static_cast<int64_t>(b) * a.num_draft + j];
      else if (j == n) token = next;
    }
    a.tokens[static_cast<int64_t>(b) * num_positions + j] = token;
  }
  if (threadIdx.x == 0 && a.num_accepted != nullptr) a.num_accepted[b] = invalid ? -1 : n;
}

// ---- pass 1: per (logit row, chunk) statistics -------------------------------------------------------------
struct ArgMax {
  float value;
  int index;
};

// argmax_prefers without its NaN cases: a thread's argmax never holds a NaN (see StatsAccumulator).
struct CombineArgMax {
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return b.value > a.value || (b.value == a.value && b.index < a.index) ? b : a;
  }
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return __fadd_rn(a, b); }
};

// One thread's partials of a chunk, fed its groups of elements in increasing v (visit_groups).
//  - hi: NaN-propagating max of every z (greedy: x), so the chunk holds a NaN or +inf iff !(hi < inf). Sampling
//    judges z alone: with a valid temperature (0 read as 1, or positive and finite) a NaN or +inf x gives a NaN or
//    +inf z (a row with an invalid per-row temperature is flagged by the caller whatever the kernels find).
//  - raw: argmax of x with a plain '>' over the groups in increasing v, which keeps the first of equal maxima. A NaN is
//    never taken (it sets hi, and a flagged row's argmax is never read). raw.index is the winning group's first
//    element until resolve() finds the element in it. Only where a row can read it: greedy launches and greedy rows
//    of a per-row launch, whose T = 1 makes z = x.
//  - (m, s): online softmax of the kept z, rescaled once per group (to the group's kept max), not per element.
//  - z = x / T as x * (1/T) where 1/T is exact (T a power of two: 1, 0.5, 2, ...): both round the same real number
//    once, so they agree bit for bit (NaN, infinities and signed zeros included), without a division per element.
template <typename T, bool SAMPLING, bool HAS_CUT>
struct StatsAccumulator {
  RowRef<T> row;
  bool need_arg;
  float hi = -INFINITY;
  ArgMax raw = {-INFINITY, INT_MAX};
  bool raw_in_vector = false;
  float m = -INFINITY;
  float s = 0.0f;

  template <int N>
  __device__ __forceinline__ void operator()(int base, const T (&x)[N]) {
    if constexpr (!SAMPLING) {
      const float top = group_max_nan(x);
      hi = fmax_nan(hi, top);
      argmax_add<N>(base, top);
    } else {
      float z[N];
      if (row.exact_inverse) {  // (logit_row's 1/T and its exactness)
#pragma unroll
        for (int k = 0; k < N; ++k) z[k] = __fmul_rn(to_float(x[k]), row.inverse);
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) z[k] = __fdiv_rn(to_float(x[k]), row.temperature);
      }
      const float top = group_max_nan(z);
      hi = fmax_nan(hi, top);
      if (need_arg) argmax_add<N>(base, top);
      float kept_max = top;  // without a cut: NaN only in a flagged chunk
      if constexpr (HAS_CUT) {
        kept_max = -INFINITY;
#pragma unroll
        for (int k = 0; k < N; ++k) {
          if (!cut_keeps<T, HAS_CUT>(row, base + k, z[k])) z[k] = -INFINITY;
          kept_max = fmaxf(kept_max, z[k]);
        }
      }
      if (kept_max > m) {
        s = __fmul_rn(s, expf(__fsub_rn(m, kept_max)));  // m = -inf: s is 0 and stays 0
        m = kept_max;
      }
      if (m > -INFINITY) {  // a cut or -inf z adds exp(-inf) = 0: s unchanged
#pragma unroll
        for (int k = 0; k < N; ++k) s = __fadd_rn(s, expf(__fsub_rn(z[k], m)));
      }
    }
  }

  // Selects, no search: a warp's 32 lanes meet a new maximum in almost every group.
  template <int N>
  __device__ __forceinline__ void argmax_add(int base, float top) {
    if (top > raw.value) {
      raw = {top, base};
      raw_in_vector = N > 1;
    }
  }

  // The first element of the winning vector equal to its max, from a second read of that vector (just loaded: a
  // cache hit); z = x wherever the argmax is kept.
  __device__ __forceinline__ void resolve() {
    if (raw_in_vector) {
      const Vec16<T> x = *reinterpret_cast<const Vec16<T>*>(row.ptr + raw.index);
      raw.index += first_equal(x.v, raw.value);
    }
  }
};

constexpr int kStatsWarps = kStatsThreads / 32;

// Pass 1's work for logit row r, chunk c: its ChunkStats partial written to the workspace by thread 0. A block of
// kStatsThreads threads; every thread must call it (barriers). chunk_stats_kernel and single_pass_kernel run it.
template <typename T, bool SAMPLING, bool HAS_CUT>
__device__ __forceinline__ void write_chunk_stats(const Args<T>& a, int r, int c, ArgMax* arg_scratch,
                                                  float* scratch) {
  constexpr int kWarps = kStatsWarps;
  const int b = r / a.rows_per_batch;
  const int j = r % a.rows_per_batch;
  if (!row_used(a, b, j)) {  // past the row's draft limit: never read (decide ignores the partials)
    if (threadIdx.x == 0) a.ws.chunk_stats[static_cast<int64_t>(r) * a.num_chunks + c] = stats_identity();
    return;
  }
  const int start = c * kChunkSize;
  const int end = min(start + kChunkSize, a.vocab);
  StatsAccumulator<T, SAMPLING, HAS_CUT> acc{logit_row<T, HAS_CUT>(a, b, j), !SAMPLING || row_greedy(a, b)};
  visit_groups<kStatsThreads, kChunkSize>(acc.row.ptr, acc.row.vec, start, end, acc);

  // Block totals: each thread's s rescaled once to the block's max m and summed (one expf per thread, not one per
  // reduction step), the argmax only where it is read, the flag by a barrier vote.
  ChunkStats out = stats_identity();
  if constexpr (SAMPLING) {
    out.m = block_all_reduce<kWarps>(acc.m, MaxOp{}, scratch);
    const float s = acc.m > -INFINITY ? __fmul_rn(acc.s, expf(__fsub_rn(acc.m, out.m))) : 0.0f;
    out.s = block_all_reduce<kWarps>(s, SumOp{}, scratch);
  }
  if (acc.need_arg) {  // the same for the whole block
    acc.resolve();
    const ArgMax raw = block_all_reduce<kWarps>(acc.raw, CombineArgMax{}, arg_scratch);
    out.raw_max = raw.value;
    out.raw_arg = raw.index;
  }
  // A cut source outside [0, V) invalidates the row.
  out.bad = __syncthreads_or(!(acc.hi < INFINITY) || !acc.row.cut_ok);
  if (threadIdx.x == 0) a.ws.chunk_stats[static_cast<int64_t>(r) * a.num_chunks + c] = out;
}

template <typename T, bool SAMPLING, bool HAS_CUT>
__global__ void __launch_bounds__(kStatsThreads) chunk_stats_kernel(const Args<T> a) {
  __shared__ ArgMax arg_scratch[kStatsWarps];
  __shared__ float scratch[kStatsWarps];
  const int r = static_cast<int>(blockIdx.x);
  const int c = static_cast<int>(blockIdx.y);
  if (a.ws.race_tickets != nullptr && r == 0 && c == 0) {  // the fused pass's tickets start at 0 (a kernel later)
    for (int i = static_cast<int>(threadIdx.x); i < a.batch; i += static_cast<int>(blockDim.x)) a.ws.race_tickets[i] = 0;
  }
  write_chunk_stats<T, SAMPLING, HAS_CUT>(a, r, c, arg_scratch, scratch);
}

// ---- pass 2: per batch row, combine partials, validate, accept/reject ---------------------------------------
// A ChunkStats that another block of the running kernel wrote (single_pass_kernel): loaded from L2 (ld.global.cg),
// never from this SM's L1, which is not coherent with other SMs' stores. The other kernels read what an earlier
// kernel wrote, with plain loads.
template <bool FROM_L2>
__device__ __forceinline__ ChunkStats load_stats(const ChunkStats* p) {
  if constexpr (!FROM_L2) {
    return *p;
  } else {
    ChunkStats out;
    out.raw_max = __ldcg(&p->raw_max);
    out.raw_arg = __ldcg(&p->raw_arg);
    out.m = __ldcg(&p->m);
    out.s = __ldcg(&p->s);
    out.bad = __ldcg(&p->bad);
    return out;
  }
}

// Batch row b's decision: its chunk partials combined into row_stats (R entries: the workspace's for the split
// passes and the single kernel, shared memory in the fused one), the row validated, its accept tests run. Every
// thread of the block must call it (barriers); all get the same result, a fixed function of the partials (a fixed
// combine order: one warp per logit row whatever the block size). FROM_L2: the partials were written during this
// kernel (load_stats).
template <typename T, bool SAMPLING, bool HAS_CUT, bool HAS_DRAFT, bool FROM_L2 = false>
__device__ Decision decide_row(const Args<T>& a, int b, ChunkStats* row_stats, int* s_invalid, int* s_first_reject) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int num_warps = static_cast<int>(blockDim.x) >> 5;
  const int num_positions = a.num_draft + 1;
  bool bad_limit;
  const int limit = row_limit(a, b, &bad_limit);  // n_b: drafts past it are never accepted
  const bool greedy = !SAMPLING || row_greedy(a, b);
  if (tid == 0) {
    *s_invalid = bad_limit ? 1 : 0;
    *s_first_reject = limit;
  }

  // One warp per logit row: fixed-order combine of its chunk partials.
  for (int j = warp; j < a.rows_per_batch; j += num_warps) {
    const ChunkStats* partials =
        a.ws.chunk_stats + (static_cast<int64_t>(b) * a.rows_per_batch + j) * a.num_chunks;
    ChunkStats acc = stats_identity();
    for (int c = lane; c < a.num_chunks; c += 32) acc = combine_stats(acc, load_stats<FROM_L2>(partials + c));
    acc = warp_reduce(acc, CombineStats{});
    if (lane == 0) row_stats[j] = acc;
  }
  __syncthreads();

  for (int j = tid; j < a.rows_per_batch; j += static_cast<int>(blockDim.x)) {
    if (!row_used(a, b, j)) continue;
    const ChunkStats s = row_stats[j];
    // NaN/+inf, or the whole row is -inf (sampling: of the scaled z, whose kept max is m; greedy: of the logits)
    const float alive = SAMPLING ? s.m : s.raw_max;
    if (s.bad || !(alive > -INFINITY)) atomicOr(s_invalid, 1);
  }
  for (int i = tid; i < limit; i += static_cast<int>(blockDim.x)) {
    const int64_t token = a.draft_tokens[static_cast<int64_t>(b) * a.num_draft + i];
    if (token < 0 || token >= a.vocab) {
      atomicOr(s_invalid, 1);
      continue;
    }
    const int x = static_cast<int>(token);
    bool accept;
    if (greedy) {
      accept = x == row_stats[i].raw_arg;
    } else {
      const float r = uniform_from_bits(
          philox_first_word(row_seed(a, b), static_cast<uint32_t>(i), row_id(a, b), row_offset(a, b), kStreamAccept));
      const RowRef<T> p_row = logit_row<T, HAS_CUT>(a, b, i);
      const float p_x = prob<T, HAS_CUT>(a, p_row, row_stats[i], x, to_float(p_row.ptr[x]));
      float q_x = 1.0f;  // one-hot q at the draft token
      if constexpr (HAS_DRAFT) {
        const RowRef<T> q_row = logit_row<T, HAS_CUT>(a, b, num_positions + i);
        q_x = prob<T, HAS_CUT>(a, q_row, row_stats[num_positions + i], x, to_float(q_row.ptr[x]));
      }
      accept = q_x > 0.0f && __fmul_rn(r, q_x) < p_x;
    }
    if (!accept) atomicMin(s_first_reject, i);
  }
  __syncthreads();
  return Decision{*s_first_reject, *s_invalid != 0 ? 1 : 0};  // n in 0..K
}

template <typename T, bool SAMPLING, bool HAS_CUT, bool HAS_DRAFT>
__global__ void __launch_bounds__(kDecideThreads) decide_kernel(const Args<T> a) {
  __shared__ int s_invalid;
  __shared__ int s_first_reject;
  const int b = static_cast<int>(blockIdx.x);
  ChunkStats* row_stats = a.ws.row_stats + static_cast<int64_t>(b) * a.rows_per_batch;
  const Decision decision = decide_row<T, SAMPLING, HAS_CUT, HAS_DRAFT>(a, b, row_stats, &s_invalid, &s_first_reject);
  if (threadIdx.x == 0) a.ws.decisions[b] = decision;
  if (!SAMPLING || row_greedy(a, b)) {  // race and finalize skip greedy rows
    write_outputs(a, b, decision.n, row_stats[decision.n].raw_arg, decision.invalid != 0);
  }
}

// x, evaluated once. nvcc 13.0 (sm_90) re-evaluated a race key's __fdiv_rn at its uses in the vector race loop:
// three correctly rounded divisions for one key on the common path of six of the eight ids of a 16-byte vector
// (~20 instructions per id). An empty asm that may change x pins the one division; the value is unchanged.
__device__ __forceinline__ float evaluated_once(float x) {
#if defined(__CUDA_ARCH__)
  asm("" : "+f"(x));
#endif
  return x;
}

// ---- pass 3: exponential race over the residual (and over p for the zero-residual fallback) -----------------
static_assert(kQuad == kWordsPerCall, "visit_quads' groups are the ids of one Philox call");
// The race over [start, end) of batch row b, whose decision accepted n drafts; row_stats: the row's R combined
// stats. Reduced over the block: the result is valid in thread 0. Every thread must call it (barriers).
template <typename T, bool HAS_CUT, bool HAS_DRAFT>
__device__ RacePartial race_range(const Args<T>& a, int b, int n, const ChunkStats* row_stats, int start, int end,
                                  RacePartial* scratch) {
  const int num_positions = a.num_draft + 1;
  bool bad_limit;
  const int limit = row_limit(a, b, &bad_limit);
  const RowRef<T> p_row = logit_row<T, HAS_CUT>(a, b, n);
  const ChunkStats p_stats = row_stats[n];
  const bool has_q = n < limit;  // q := 0 once all n_b drafts are accepted: the bonus token is drawn from p_n
  RowRef<T> q_row{nullptr, true, true, -INFINITY, 0, 1.0f, 1.0f, true};
  ChunkStats q_stats = stats_identity();
  int q_token = -1;
  if (has_q) {
    if constexpr (HAS_DRAFT) {
      q_row = logit_row<T, HAS_CUT>(a, b, num_positions + n);
      q_stats = row_stats[num_positions + n];
    } else {
      q_token = static_cast<int>(a.draft_tokens[static_cast<int64_t>(b) * a.num_draft + n]);
    }
  }
  const bool vec = p_row.vec && (q_row.ptr == nullptr || q_row.vec);
  const uint64_t seed = row_seed(a, b);
  const uint32_t offset = row_offset(a, b);
  const uint32_t rid = row_id(a, b);
  const uint32_t stream = a.stream_base + static_cast<uint32_t>(n);

  // The race over p decides only a row whose residual is 0 at every id (race_winner). Once this thread has seen a
  // positive residual its row is not one, so its p partial is never read: from then on it skips the p race (a
  // division and an argmax update per id). A row that does fall back had no positive residual anywhere, so every
  // thread raced every id over p, as before. At the bonus position (q = 0, residual = p) a thread stops racing p at its
  // first id with p > 0.
  RacePartial acc = race_identity();
  // An id with p == 0, cut by top-k/top-p (or underflowed): the residual max(0, 0 - q) is 0 and both keys are 0 / E = +0
  // whatever E is (E > 0), so its random number is not needed. Most of the vocabulary under a cut.
  const auto race_zero = [&](int v) {
    if (argmax_prefers(0.0f, v, acc.residual_value, acc.residual_index)) {
      acc.residual_value = 0.0f;
      acc.residual_index = v;
    }
    if (!acc.any_positive && argmax_prefers(0.0f, v, acc.p_value, acc.p_index)) {
      acc.p_value = 0.0f;
      acc.p_index = v;
    }
  };
  // Any id: p its probability, y its draft logit, bits its Philox word.
  const auto race_id = [&](int v, float p, float y, uint32_t bits) {
    if (p == 0.0f) {
      race_zero(v);
      return;
    }
    float q = 0.0f;
    if (has_q) {
      if constexpr (HAS_DRAFT) q = prob<T, HAS_CUT>(a, q_row, q_stats, v, y);
      else q = v == q_token ? 1.0f : 0.0f;
    }
    const float diff = __fsub_rn(p, q);
    const float residual = diff < 0.0f ? 0.0f : diff;  // torch.clamp(min=0) (keeps a NaN)
    const float e = exponential_from_bits(bits);
    const float residual_ratio = evaluated_once(__fdiv_rn(residual, e));
    if (argmax_prefers(residual_ratio, v, acc.residual_value, acc.residual_index)) {
      acc.residual_value = residual_ratio;
      acc.residual_index = v;
    }
    acc.any_positive |= static_cast<int>(residual > 0.0f);
    if (!acc.any_positive) {  // no positive residual seen yet by this thread: the p race may still decide the row
      const float p_ratio = evaluated_once(__fdiv_rn(p, e));
      if (argmax_prefers(p_ratio, v, acc.p_value, acc.p_index)) {
        acc.p_value = p_ratio;
        acc.p_index = v;
      }
    }
  };
  // A group of kQuad ids shares one Philox call (id v: word v % 4 of the call at c0 = v / 4), made only when one of
  // its ids has p != 0: under a cut most groups draw nothing (~20 instructions an id, not ~100).
  visit_quads(p_row.ptr, q_row.ptr, vec, start, end,
              [&](int v0, const float (&x)[kQuad], const float (&y)[kQuad], int first, int last) {
    float p[kQuad];
    bool draws = false;
#pragma unroll
    for (int k = 0; k < kQuad; ++k) {
      p[k] = 0.0f;
      if (k >= first && k < last) {
        p[k] = prob<T, HAS_CUT>(a, p_row, p_stats, v0 + k, x[k]);
        draws |= !(p[k] == 0.0f);
      }
    }
    if (!draws) {
#pragma unroll
      for (int k = 0; k < kQuad; ++k) {
        if (k >= first && k < last) race_zero(v0 + k);
      }
      return;
    }
    const PhiloxWords words = philox_words(seed, static_cast<uint32_t>(v0) / kQuad, rid, offset, stream);
#pragma unroll
    for (int k = 0; k < kQuad; ++k) {
      if (k >= first && k < last) race_id(v0 + k, p[k], y[k], words.w[k]);
    }
  });
  return block_reduce(acc, CombineRace{}, race_identity(), scratch);
}

template <typename T, bool HAS_CUT, bool HAS_DRAFT>
__global__ void __launch_bounds__(kStreamThreads) race_kernel(const Args<T> a) {
  __shared__ RacePartial scratch[32];
  const int b = static_cast<int>(blockIdx.x);
  const int c = static_cast<int>(blockIdx.y);
  const Decision decision = a.ws.decisions[b];
  // The same for the whole block: finalize writes -1 without reading partials; decide wrote a greedy row.
  if (decision.invalid || row_greedy(a, b)) return;
  const ChunkStats* row_stats = a.ws.row_stats + static_cast<int64_t>(b) * a.rows_per_batch;
  const int start = c * a.race_chunk;
  const int end = min(start + a.race_chunk, a.vocab);
  const RacePartial acc = race_range<T, HAS_CUT, HAS_DRAFT>(a, b, decision.n, row_stats, start, end, scratch);
  if (threadIdx.x == 0) a.ws.race[static_cast<int64_t>(b) * a.num_race_chunks + c] = acc;
}

// ---- pass 4: combine the race partials, write the outputs ---------------------------------------------------
// A race partial read from L2 (ld.global.cg): in the fused pass another block wrote it during this kernel.
__device__ __forceinline__ RacePartial load_race_partial(const RacePartial* p) {
  RacePartial out;
  out.residual_value = __ldcg(&p->residual_value);
  out.residual_index = __ldcg(&p->residual_index);
  out.p_value = __ldcg(&p->p_value);
  out.p_index = __ldcg(&p->p_index);
  out.any_positive = __ldcg(&p->any_positive);
  return out;
}

// The race's winner from a row's partials, combined in chunk order (never arrival order): called by one full warp,
// every lane gets the token. The residual race unless every residual is 0, then the race over p (reference: weights
// = where(max > 0, residual, p)).
__device__ __forceinline__ int race_winner(const RacePartial* partials, int count) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  RacePartial acc = race_identity();
  for (int c = lane; c < count; c += 32) acc = combine_race(acc, load_race_partial(partials + c));
  acc = warp_reduce(acc, CombineRace{});
  return __shfl_sync(kFullMask, acc.any_positive ? acc.residual_index : acc.p_index, 0);
}

template <typename T>
__global__ void __launch_bounds__(kFinalizeThreads) finalize_kernel(const Args<T> a) {
  const int b = static_cast<int>(blockIdx.x);
  if (row_greedy(a, b)) return;  // decide wrote it
  const Decision decision = a.ws.decisions[b];
  int next = -1;
  if (!decision.invalid) next = race_winner(a.ws.race + static_cast<int64_t>(b) * a.num_race_chunks, a.num_race_chunks);
  write_outputs(a, b, decision.n, next, decision.invalid != 0);
}

// ---- passes 2-4 fused (small batches, sampling): one kernel after chunk_stats --------------------------------
// Block (b, c) decides row b itself (every block of the row computes the same decision from the partials: a few
// KiB of L2 reads, cheaper at small B than two more dependent launches), races its kFusedRaceChunk ids, and the
// row's last block to finish (a ticket taken after a __threadfence, as CUDA's threadFenceReduction sample does)
// combines the partials in chunk order and writes the outputs. The tickets start at 0: chunk_stats zeroes them.
template <typename T, bool HAS_CUT, bool HAS_DRAFT>
__global__ void __launch_bounds__(kStreamThreads) decide_race_kernel(const Args<T> a) {
  extern __shared__ ChunkStats fused_row_stats[];  // [R]
  __shared__ int s_invalid;
  __shared__ int s_first_reject;
  __shared__ int s_last;
  __shared__ int s_next;
  __shared__ RacePartial scratch[32];
  const int b = static_cast<int>(blockIdx.x);
  const int c = static_cast<int>(blockIdx.y);
  const Decision decision =
      decide_row<T, true, HAS_CUT, HAS_DRAFT>(a, b, fused_row_stats, &s_invalid, &s_first_reject);
  const bool greedy = row_greedy(a, b);
  if (decision.invalid || greedy) {  // the same for the whole row: its first block writes it, no race
    if (c == 0) {
      write_outputs(a, b, decision.n, greedy ? fused_row_stats[decision.n].raw_arg : -1, decision.invalid != 0);
    }
    return;
  }
  const int start = c * a.race_chunk;
  const int end = min(start + a.race_chunk, a.vocab);
  const RacePartial acc =
      race_range<T, HAS_CUT, HAS_DRAFT>(a, b, decision.n, fused_row_stats, start, end, scratch);
  RacePartial* partials = a.ws.race + static_cast<int64_t>(b) * a.num_race_chunks;
  if (threadIdx.x == 0) {
    partials[c] = acc;
    __threadfence();  // the partial is visible device-wide before the ticket says so
    s_last = atomicAdd(a.ws.race_tickets + b, 1) == a.num_race_chunks - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  if (threadIdx.x < 32) {
    const int next = race_winner(partials, a.num_race_chunks);
    if (threadIdx.x == 0) s_next = next;
  }
  __syncthreads();
  write_outputs(a, b, decision.n, s_next, false);
}

// ---- every pass in one kernel (SPECULATIVE_KERNELS_VERIFY_PASSES=single; not the default until a GPU measured it) ---
// One launch, after a memset of its counters, of kStatsThreads-thread blocks that each run one work item, claimed in
// order from a global counter (next_item):
//   - items [0, S), S = B * R * num_chunks: pass 1 for (logit row r, chunk c), item r * num_chunks + c
//     (write_chunk_stats, the chunk_stats kernel's code). Then a ticket on the batch row's stats_done: the row's last
//     statistics block decides the row (decide_row: the same fixed-order combine into row_stats, the accept tests),
//     writes the outputs of a greedy or invalid row and publishes the decision (`decided`).
//   - sampling only, items [S, S + B * C), C = num_race_chunks (kFusedRaceChunk ids each): the race of (batch row b,
//     chunk c), once b is decided (thread 0 spins on `decided`), then a ticket on race_done: the row's last race block
//     combines the race partials in chunk order (race_winner) and writes the outputs.
// So greedy is one launch instead of chunk_stats + decide, and sampling one instead of two (fused) or four (split).
// The results are the other structures' bit for bit: the same partials, combines and races.
//
// Forward progress: a block claims its item only once it runs, and every statistics item is claimed before any race
// item, so the statistics blocks a race block waits for are already running and wait for nothing themselves: the spin
// ends whatever the grid size and the order in which the GPU starts blocks (the argument of decoupled look-back
// scans, which take their tile from a counter for the same reason).
// Memory ordering (CUDA's threadFenceReduction sample):
//   - release: each thread that stored data another block will read (a chunk or race partial; row_stats, the decision)
//     runs __threadfence() after its stores, the block synchronises, and only then does one thread announce them with
//     an atomicAdd (a ticket, or `decided`); a block that observes the count therefore observes the stores;
//   - acquire: the reader observes the count or flag in thread 0, runs __threadfence(), shares it through a barrier,
//     and every thread reads the published data with ld.global.cg (load_stats, load_race_partial, __ldcg): from L2,
//     never from a stale line of its SM's L1, which is not coherent with other SMs' stores.
// The CPU emulation runs blocks one after another, so it checks the items, tickets and combines, not the ordering.
constexpr unsigned kSpinNanoseconds = 64;

template <typename T, bool SAMPLING, bool HAS_CUT, bool HAS_DRAFT>
__global__ void __launch_bounds__(kStatsThreads) single_pass_kernel(const Args<T> a) {
  extern __shared__ ChunkStats single_row_stats[];  // [R] (sampling): a race item's copy of its row's stats
  __shared__ ArgMax arg_scratch[kStatsWarps];
  __shared__ float scratch[kStatsWarps];
  __shared__ RacePartial race_scratch[32];
  __shared__ int s_item;
  __shared__ int s_last;
  __shared__ int s_invalid;
  __shared__ int s_first_reject;
  __shared__ int s_next;
  const int tid = static_cast<int>(threadIdx.x);
  const SingleCounters counters = a.ws.single;
  if (tid == 0) s_item = atomicAdd(counters.next_item, 1);
  __syncthreads();
  const int item = s_item;
  const int stats_items = a.batch * a.rows_per_batch * a.num_chunks;
  if (item < stats_items) {
    const int r = item / a.num_chunks;
    const int b = r / a.rows_per_batch;
    write_chunk_stats<T, SAMPLING, HAS_CUT>(a, r, item - r * a.num_chunks, arg_scratch, scratch);
    if (tid == 0) {  // (thread 0 stored the partial)
      __threadfence();  // release: the partial is visible device-wide before the ticket counts it
      s_last = atomicAdd(counters.stats_done + b, 1) == a.rows_per_batch * a.num_chunks - 1;
      if (s_last) __threadfence();  // acquire: the other blocks' partials, announced by their tickets
    }
    __syncthreads();
    if (!s_last) return;
    ChunkStats* row_stats = a.ws.row_stats + static_cast<int64_t>(b) * a.rows_per_batch;
    const Decision decision =
        decide_row<T, SAMPLING, HAS_CUT, HAS_DRAFT, true>(a, b, row_stats, &s_invalid, &s_first_reject);
    const bool greedy = !SAMPLING || row_greedy(a, b);
    if (greedy || decision.invalid) {  // the same for the whole row: no race (its race items return)
      write_outputs(a, b, decision.n, greedy ? row_stats[decision.n].raw_arg : -1, decision.invalid != 0);
    }
    if constexpr (SAMPLING) {
      if (tid == 0) a.ws.decisions[b] = decision;
      __threadfence();  // release, in every thread: its row_stats stores (decide_row) and thread 0's decision
      __syncthreads();
      if (tid == 0) atomicAdd(counters.decided + b, 1);
    }
    return;
  }
  if constexpr (SAMPLING) {
    const int race_item = item - stats_items;
    const int b = race_item / a.num_race_chunks;
    const int c = race_item - b * a.num_race_chunks;
    if (tid == 0) {
      const volatile int* decided = counters.decided + b;
      while (*decided == 0) __nanosleep(kSpinNanoseconds);
      __threadfence();  // acquire: the decision and row_stats the flag announces
    }
    __syncthreads();
    const Decision decision{__ldcg(&a.ws.decisions[b].n), __ldcg(&a.ws.decisions[b].invalid)};
    if (decision.invalid || row_greedy(a, b)) return;  // the deciding block wrote the outputs
    const ChunkStats* row_stats = a.ws.row_stats + static_cast<int64_t>(b) * a.rows_per_batch;
    for (int j = tid; j < a.rows_per_batch; j += static_cast<int>(blockDim.x)) {
      single_row_stats[j] = load_stats<true>(row_stats + j);
    }
    __syncthreads();
    const int start = c * a.race_chunk;
    const int end = min(start + a.race_chunk, a.vocab);
    const RacePartial acc =
        race_range<T, HAS_CUT, HAS_DRAFT>(a, b, decision.n, single_row_stats, start, end, race_scratch);
    RacePartial* partials = a.ws.race + static_cast<int64_t>(b) * a.num_race_chunks;
    if (tid == 0) {
      partials[c] = acc;
      __threadfence();  // release: the partial before the ticket
      s_last = atomicAdd(counters.race_done + b, 1) == a.num_race_chunks - 1;
      if (s_last) __threadfence();  // acquire: the other race blocks' partials
    }
    __syncthreads();
    if (!s_last) return;
    if (tid < 32) {
      const int next = race_winner(partials, a.num_race_chunks);  // ld.global.cg loads, chunk order
      if (tid == 0) s_next = next;
    }
    __syncthreads();
    write_outputs(a, b, decision.n, s_next, false);
  }
}

// ---- host side ---------------------------------------------------------------------------------------------------
struct Layout {
  size_t chunk_stats, row_stats, decisions, race, race_tickets, single_counters, total;
};

size_t align_up(size_t bytes) { return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

int num_chunks_for(int vocab) { return (vocab + kChunkSize - 1) / kChunkSize; }

int num_fused_race_chunks_for(int vocab) { return (vocab + kFusedRaceChunk - 1) / kFusedRaceChunk; }

// The single kernel's counters (SingleCounters): next_item, then stats_done, decided and race_done per batch row.
size_t single_counter_bytes(int batch) { return (1 + 3 * static_cast<size_t>(batch)) * sizeof(int); }

// False when the sizes exceed what the grids can address.
bool make_layout(int batch, int num_draft, int vocab, bool has_draft, Layout* out) {
  if (batch < 0 || num_draft < 0 || vocab < 1 || vocab > INT_MAX - kChunkSize) return false;
  const int64_t num_chunks = num_chunks_for(vocab);
  const int64_t rows_per_batch = static_cast<int64_t>(num_draft) + 1 + (has_draft ? num_draft : 0);
  const int64_t logit_rows = static_cast<int64_t>(batch) * rows_per_batch;
  if (num_chunks > kMaxGridY || rows_per_batch > INT_MAX || logit_rows > INT_MAX) return false;
  const size_t rows = static_cast<size_t>(logit_rows);
  const size_t chunks = static_cast<size_t>(num_chunks);
  const size_t b = static_cast<size_t>(batch);
  out->chunk_stats = 0;
  out->row_stats = out->chunk_stats + align_up(rows * chunks * sizeof(ChunkStats));
  out->decisions = out->row_stats + align_up(rows * sizeof(ChunkStats));
  out->race = out->decisions + align_up(b * sizeof(Decision));
  // room for either pass structure's partials (the fused pass's chunks are smaller)
  const size_t race_chunks = static_cast<size_t>(num_fused_race_chunks_for(vocab));
  out->race_tickets = out->race + align_up(b * race_chunks * sizeof(RacePartial));
  out->single_counters = out->race_tickets + align_up(b * sizeof(int));
  out->total = out->single_counters + align_up(single_counter_bytes(batch));
  return true;
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

bool passes_setting_is(const char* value) {
  const char* setting = std::getenv(kVerifyPassesVariable);
  return setting != nullptr && std::strcmp(setting, value) == 0;
}

// Whether a sampling launch of these sizes fuses passes 2-4 into one kernel (decide_race_kernel).
// SPECULATIVE_KERNELS_VERIFY_PASSES=split or =fused overrides the batch-size rule (benchmarks compare both;
// the emulated tests run both).
bool use_fused_passes(int batch, int rows_per_batch, int vocab) {
  if (static_cast<size_t>(rows_per_batch) * sizeof(ChunkStats) > kFusedMaxSharedBytes) return false;
  if (num_fused_race_chunks_for(vocab) > kMaxGridY) return false;
  if (passes_setting_is("split")) return false;
  if (passes_setting_is("fused")) return true;
  return batch == 1 || static_cast<long long>(batch) * vocab <= kFusedMaxBatchVocab;
}

// The launches single_pass_kernel is built for, until a GPU run has measured it: bf16 logits without a top-k/top-p cut
// (issue 10's B = 1 configuration). Built for every type and cut it added ~75% to this file's sm_90 compile time
// (nvcc 13.0: 42.5 -> 75.8 s of CPU), which CI pays; bf16 with and without a cut still +30%.
template <typename T, bool HAS_CUT>
constexpr bool kHasSinglePass = std::is_same_v<T, __nv_bfloat16> && !HAS_CUT;

// Whether a launch runs every pass in single_pass_kernel: only on request (SPECULATIVE_KERNELS_VERIFY_PASSES=single,
// for the GPU run that compares it with the default structures), where it is built (kHasSinglePass), and where its
// 1-D grid of work items and its shared copy of the row's stats fit; otherwise the structure the batch size picks
// (the results are the same).
template <typename T>
bool use_single_pass(bool sampling, bool has_cut, int batch, int rows_per_batch, int num_chunks, int vocab) {
  if (!(has_cut ? kHasSinglePass<T, true> : kHasSinglePass<T, false>) || !passes_setting_is("single")) return false;
  if (static_cast<size_t>(rows_per_batch) * sizeof(ChunkStats) > kFusedMaxSharedBytes) return false;
  const long long race_items = sampling ? static_cast<long long>(batch) * num_fused_race_chunks_for(vocab) : 0;
  return static_cast<long long>(batch) * rows_per_batch * num_chunks + race_items <= INT_MAX;
}

template <typename T, bool SAMPLING, bool HAS_CUT, bool HAS_DRAFT>
cudaError_t run_single_pass(const Args<T>& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.ws.single.next_item, 0, single_counter_bytes(a.batch), stream);
  if (err != cudaSuccess) return err;
  const long long stats_items = static_cast<long long>(a.batch) * a.rows_per_batch * a.num_chunks;
  const long long race_items = SAMPLING ? static_cast<long long>(a.batch) * a.num_race_chunks : 0;
  const size_t shared_bytes = SAMPLING ? static_cast<size_t>(a.rows_per_batch) * sizeof(ChunkStats) : 0;
  const dim3 grid(static_cast<unsigned>(stats_items + race_items));
  single_pass_kernel<T, SAMPLING, HAS_CUT, HAS_DRAFT><<<grid, kStatsThreads, shared_bytes, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, bool SAMPLING, bool HAS_CUT, bool HAS_DRAFT>
cudaError_t run_passes(const Args<T>& a, cudaStream_t stream) {
  if constexpr (kHasSinglePass<T, HAS_CUT>) {  // greedy: one instance, the draft rows only change R
    if (a.ws.single.next_item != nullptr) return run_single_pass<T, SAMPLING, HAS_CUT, SAMPLING && HAS_DRAFT>(a, stream);
  }
  const dim3 stream_grid(static_cast<unsigned>(a.batch * a.rows_per_batch), static_cast<unsigned>(a.num_chunks));
  chunk_stats_kernel<T, SAMPLING, HAS_CUT><<<stream_grid, kStatsThreads, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (SAMPLING && a.ws.race_tickets != nullptr) {
    const dim3 fused_grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_race_chunks));
    const size_t shared_bytes = static_cast<size_t>(a.rows_per_batch) * sizeof(ChunkStats);
    decide_race_kernel<T, HAS_CUT, HAS_DRAFT><<<fused_grid, kStreamThreads, shared_bytes, stream>>>(a);
    return cudaGetLastError();
  }
  decide_kernel<T, SAMPLING, HAS_CUT, HAS_DRAFT><<<a.batch, kDecideThreads, 0, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess || !SAMPLING) return err;  // greedy: decide wrote the outputs
  const dim3 race_grid(static_cast<unsigned>(a.batch), static_cast<unsigned>(a.num_race_chunks));
  race_kernel<T, HAS_CUT, HAS_DRAFT><<<race_grid, kStreamThreads, 0, stream>>>(a);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  finalize_kernel<T><<<a.batch, kFinalizeThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_typed(const VerifyParams& p, const Layout& layout, void* workspace, cudaStream_t stream) {
  constexpr int kVec = VecWidth<T>::value;
  const bool has_draft = p.draft_logits != nullptr;
  const bool sampling = p.temperature > 0.0f || p.temperature_rows != nullptr;  // some row samples
  const bool has_cut = sampling && p.target_cut_source != nullptr;
  Args<T> a;
  a.target = static_cast<const T*>(p.target_logits);
  a.target_stride_b = p.target_stride_b;
  a.target_stride_j = p.target_stride_j;
  a.draft = static_cast<const T*>(p.draft_logits);
  a.draft_stride_b = p.draft_stride_b;
  a.draft_stride_j = p.draft_stride_j;
  a.target_vec = aligned16(p.target_logits) && p.target_stride_b % kVec == 0 && p.target_stride_j % kVec == 0;
  a.draft_vec = has_draft && aligned16(p.draft_logits) && p.draft_stride_b % kVec == 0 && p.draft_stride_j % kVec == 0;
  a.draft_tokens = p.draft_tokens;
  a.batch = p.batch;
  a.num_draft = p.num_draft;
  a.vocab = p.vocab;
  a.rows_per_batch = p.num_draft + 1 + (has_draft ? p.num_draft : 0);
  a.num_chunks = num_chunks_for(p.vocab);
  a.temperature = p.temperature;
  a.temperature_rows = p.temperature_rows;
  a.draft_limit = p.num_draft_tokens;
  a.target_cut_source = p.target_cut_source;
  a.target_cut_index = p.target_cut_index;
  a.draft_cut_source = p.draft_cut_source;
  a.draft_cut_index = p.draft_cut_index;
  a.seed = p.seed;
  a.seed_stride = p.seed_stride;
  a.offset = p.offset;
  a.offset_stride = p.offset_stride;
  a.seed_per_row = p.seed_per_row;
  a.stream_base = p.stream_base;
  a.tokens = p.tokens;
  a.num_accepted = p.num_accepted;
  char* base = static_cast<char*>(workspace);
  a.ws.chunk_stats = reinterpret_cast<ChunkStats*>(base + layout.chunk_stats);
  a.ws.row_stats = reinterpret_cast<ChunkStats*>(base + layout.row_stats);
  a.ws.decisions = reinterpret_cast<Decision*>(base + layout.decisions);
  a.ws.race = reinterpret_cast<RacePartial*>(base + layout.race);
  const bool single = use_single_pass<T>(sampling, has_cut, p.batch, a.rows_per_batch, a.num_chunks, p.vocab);
  const bool fused = !single && sampling && use_fused_passes(p.batch, a.rows_per_batch, p.vocab);
  a.ws.race_tickets = fused ? reinterpret_cast<int*>(base + layout.race_tickets) : nullptr;
  a.ws.single = SingleCounters{nullptr, nullptr, nullptr, nullptr};
  if (single) {
    int* counters = reinterpret_cast<int*>(base + layout.single_counters);
    a.ws.single = SingleCounters{counters, counters + 1, counters + 1 + p.batch, counters + 1 + 2 * p.batch};
  }
  a.race_chunk = fused || single ? kFusedRaceChunk : kChunkSize;
  a.num_race_chunks = fused || single ? num_fused_race_chunks_for(p.vocab) : a.num_chunks;

  if (!sampling) {  // top-k/top-p cannot change an argmax
    return SK_BOOL_SWITCH(has_draft, kHasDraft, [&] { return run_passes<T, false, false, kHasDraft>(a, stream); });
  }
  return SK_BOOL_SWITCH(has_cut, kHasCut, [&] {
    return SK_BOOL_SWITCH(has_draft, kHasDraft, [&] { return run_passes<T, true, kHasCut, kHasDraft>(a, stream); });
  });
}

// Host-side argument checks (no device access): cudaErrorInvalidValue on any violation.
bool params_ok(const VerifyParams& p) {
  if (p.target_logits == nullptr || p.tokens == nullptr || p.seed == nullptr || p.offset == nullptr) return false;
  if (p.num_draft > 0 && p.draft_tokens == nullptr) return false;
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) return false;
  if ((p.temperature > 0.0f || p.temperature_rows != nullptr) && p.target_cut_source != nullptr) {
    if (p.target_cut_index == nullptr) return false;
    if (p.draft_logits != nullptr && p.num_draft > 0 && (p.draft_cut_source == nullptr || p.draft_cut_index == nullptr))
      return false;
  }
  return p.dtype == LogitDtype::kFloat32 || p.dtype == LogitDtype::kFloat16 || p.dtype == LogitDtype::kBFloat16;
}

}  // namespace

bool verify_passes_setting_valid() {
  const char* setting = std::getenv(kVerifyPassesVariable);
  return setting == nullptr || setting[0] == '\0' || std::strcmp(setting, "split") == 0 ||
         std::strcmp(setting, "fused") == 0 || std::strcmp(setting, "single") == 0;
}

size_t verify_workspace_bytes(int batch, int num_draft, int vocab, bool has_draft_logits) {
  Layout layout;
  if (!make_layout(batch, num_draft, vocab, has_draft_logits, &layout)) return 0;
  return layout.total;
}

cudaError_t verify_launch(const VerifyParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Layout layout;
  if (!params_ok(p) || !make_layout(p.batch, p.num_draft, p.vocab, p.draft_logits != nullptr, &layout)) {
    return cudaErrorInvalidValue;
  }
  if (p.batch == 0) return cudaSuccess;
  if (workspace == nullptr || !aligned16(workspace) || workspace_bytes < layout.total) return cudaErrorInvalidValue;
  switch (p.dtype) {
    case LogitDtype::kFloat32:
      return launch_typed<float>(p, layout, workspace, stream);
    case LogitDtype::kFloat16:
      return launch_typed<__half>(p, layout, workspace, stream);
    case LogitDtype::kBFloat16:
      return launch_typed<__nv_bfloat16>(p, layout, workspace, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t sample_launch(LogitDtype dtype, const void* logits, int batch, int vocab, int64_t stride_b,
                          float temperature, const float* temperature_rows, const int32_t* cut_source,
                          const int32_t* cut_index, const int64_t* seed, int64_t seed_stride, const int64_t* offset,
                          int64_t offset_stride, bool seed_per_row, int64_t* tokens, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream) {
  // The sampler is verification with K = 0 and no draft: n = 0 and the token is raced from p_0, on its own stream.
  VerifyParams p;
  p.dtype = dtype;
  p.batch = batch;
  p.num_draft = 0;
  p.vocab = vocab;
  p.target_logits = logits;
  p.target_stride_b = stride_b;
  p.target_stride_j = 0;
  p.temperature = temperature;
  p.temperature_rows = temperature_rows;
  p.target_cut_source = cut_source;
  p.target_cut_index = cut_index;
  p.seed = seed;
  p.seed_stride = seed_stride;
  p.offset = offset;
  p.offset_stride = offset_stride;
  p.seed_per_row = seed_per_row;
  p.stream_base = kStreamDraft;
  p.tokens = tokens;
  p.num_accepted = nullptr;
  return verify_launch(p, workspace, workspace_bytes, stream);
}

}  // namespace speculative_kernels
