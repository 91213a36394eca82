// The k-th largest element per logit row by a multi-block radix select: see topk_kernels.cuh.
#include <climits>

#include "common.cuh"
#include "topk_kernels.cuh"

namespace speculative_kernels {
namespace {

constexpr int kRadixBits = 8;
constexpr int kBuckets = 1 << kRadixBits;
// About this many select blocks per SM in all, each over at least kSelectMinChunk ids (8 per thread): at B = 1
// (9 rows of a K = 4 verification) a row spreads over ~60 blocks of an H200's 132 SMs.
constexpr int kSelectBlocksPerSm = 4;
constexpr int kSelectMinChunk = 2048;
// A block's chunk is a multiple of this many ids, so that a 16-byte aligned row gives 16-byte aligned chunks.
constexpr int kChunkAlign = 8;

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

// The workspace: per pass and row the digit counts and the row's ticket; per row the smallest index holding each
// bucket of the last pass (INT_MAX - v, 0 for none), the prefix of the digits selected so far and the remaining k.
struct SelectWorkspace {
  size_t counts, best, tickets, prefix, remaining, total;
};

SelectWorkspace select_layout(int passes, int rows) {
  SelectWorkspace w;
  const size_t r = static_cast<size_t>(rows);
  w.counts = 0;
  w.best = w.counts + align_up(passes * r * kBuckets * sizeof(unsigned));
  w.tickets = w.best + align_up(r * kBuckets * sizeof(int));
  w.prefix = w.tickets + align_up(passes * r * sizeof(unsigned));
  w.remaining = w.prefix + align_up(r * sizeof(unsigned));
  w.total = w.remaining + align_up(r * sizeof(unsigned));
  return w;
}

struct SelectArgs {
  const void* logits;
  int positions, vocab, k;
  int64_t stride_b, stride_j;
  int32_t* out;
  int chunk;   // ids per block
  int blocks_per_row;
  int pass;    // 0 = the top digit
  int shift;   // the digit of this pass is (key >> shift) & 255
  unsigned* counts;     // [rows, 256] of this pass
  unsigned* tickets;    // [rows] of this pass
  int* best;            // [rows, 256] (the last pass)
  unsigned* prefix;     // [rows]
  unsigned* remaining;  // [rows]
};

// The order-preserving key of a logit's bits U (uint16_t: fp16/bf16, uint32_t: float32): unsigned key order refines
// the float order (a negative value has all its bits flipped, a positive one its sign bit set).
template <typename U>
__device__ __forceinline__ unsigned order_key(U bits) {
  constexpr unsigned kSign = 1u << (8 * sizeof(U) - 1);
  const unsigned u = bits;
  return (u & kSign) ? static_cast<unsigned>(static_cast<U>(~u)) : (u | kSign);
}

// Calls f(v, key) for every id v in [start, end) of row: 16-byte loads where the chunk is aligned (a partial last
// vector element by element), else one element per thread per step.
template <typename U, typename F>
__device__ __forceinline__ void for_each_key(const U* __restrict__ row, int start, int end, F&& f) {
  constexpr int kVec = VecWidth<U>::value;
  const int tid = static_cast<int>(threadIdx.x);
  int scalar_start = start;
  if (reinterpret_cast<uintptr_t>(row + start) % 16 == 0) {
    const int full_end = start + (end - start) / kVec * kVec;
    for (int base = start + tid * kVec; base < full_end; base += kSelectThreads * kVec) {
      const Vec16<U> x = *reinterpret_cast<const Vec16<U>*>(row + base);
#pragma unroll
      for (int i = 0; i < kVec; ++i) f(base + i, order_key(x.v[i]));
    }
    scalar_start = full_end;
  }
  for (int v = scalar_start + tid; v < end; v += kSelectThreads) f(v, order_key(row[v]));
}

// One pass over blocks (row, chunk), blockIdx.x = row * blocks_per_row + chunk. The row's last block picks the
// bucket holding the k-th largest key (warp 0: lane l sums buckets 255 - 8l .. 248 - 8l, a scan over the lanes
// from the top).
template <typename U, bool LAST>
__global__ void __launch_bounds__(kSelectThreads) radix_pass(SelectArgs a) {
  __shared__ unsigned s_counts[kBuckets];
  __shared__ int s_best[kBuckets];
  __shared__ int s_last;
  const int tid = static_cast<int>(threadIdx.x);
  const int r = static_cast<int>(blockIdx.x) / a.blocks_per_row;
  const int chunk = static_cast<int>(blockIdx.x) - r * a.blocks_per_row;
  const int b = r / a.positions;
  const int j = r - b * a.positions;
  const U* row = static_cast<const U*>(a.logits) + b * a.stride_b + j * a.stride_j;
  for (int i = tid; i < kBuckets; i += kSelectThreads) {
    s_counts[i] = 0;
    if (LAST) s_best[i] = 0;
  }
  const bool first = a.pass == 0;
  const unsigned prefix = first ? 0u : a.prefix[r];  // written by the previous pass's kernel
  const int shift = a.shift;
  __syncthreads();
  const int start = chunk * a.chunk;
  const int end = min(a.vocab, start + a.chunk);
  for_each_key(row, start, end, [&](int v, unsigned key) {
    if (first || (key >> (shift + kRadixBits)) == prefix) {
      const unsigned digit = (key >> shift) & (kBuckets - 1);
      atomicAdd(&s_counts[digit], 1u);
      if (LAST) atomicMax(&s_best[digit], INT_MAX - v);  // the smallest id of the bucket in this block
    }
  });
  __syncthreads();
  unsigned* counts = a.counts + static_cast<size_t>(r) * kBuckets;
  int* best = a.best + static_cast<size_t>(r) * kBuckets;
  for (int i = tid; i < kBuckets; i += kSelectThreads) {
    if (s_counts[i] != 0) {
      atomicAdd(counts + i, s_counts[i]);
      if (LAST) atomicMax(best + i, s_best[i]);
    }
  }
  __threadfence();  // this block's counts are visible device-wide before its ticket says so
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(a.tickets + r, 1u) == static_cast<unsigned>(a.blocks_per_row - 1);
  __syncthreads();
  if (!s_last || tid >= 32) return;
  __threadfence();
  const int lane = tid;
  const unsigned k = first ? static_cast<unsigned>(a.k) : a.remaining[r];
  unsigned c[kBuckets / 32];
  unsigned sum = 0;
#pragma unroll
  for (int i = 0; i < kBuckets / 32; ++i) {
    c[i] = __ldcg(counts + (kBuckets - 1 - (kBuckets / 32) * lane - i));
    sum += c[i];
  }
  unsigned above = sum;  // the row's matching elements in this lane's buckets and every bucket above them
  for (int offset = 1; offset < 32; offset <<= 1) {
    const unsigned y = static_cast<unsigned>(__shfl_sync(0xffffffffu, static_cast<int>(above),
                                                         lane >= offset ? lane - offset : lane));
    if (lane >= offset) above += y;
  }
  // The lanes holding fewer than k from the top precede the one whose buckets hold the k-th (there is one: the
  // matching elements number at least k).
  const int target = __popc(__ballot_sync(0xffffffffu, above < k));
  if (lane != target) return;
  unsigned rest = k - (above - sum);
  int bucket = kBuckets - 1 - (kBuckets / 32) * lane;
#pragma unroll
  for (int i = 0; i < kBuckets / 32; ++i) {
    if (rest <= c[i]) break;
    rest -= c[i];
    --bucket;
  }
  if (LAST) {
    a.out[r] = INT_MAX - __ldcg(best + bucket);
  } else {
    a.prefix[r] = (prefix << kRadixBits) | static_cast<unsigned>(bucket);
    a.remaining[r] = rest;
  }
}

template <typename U, bool LAST>
cudaError_t launch_pass(const SelectArgs& a, dim3 grid, cudaStream_t stream) {
  radix_pass<U, LAST><<<grid, kSelectThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename U>
cudaError_t launch_passes(SelectArgs a, int passes, dim3 grid, int rows, char* base, const SelectWorkspace& w,
                          cudaStream_t stream) {
  for (int pass = 0; pass < passes; ++pass) {
    a.pass = pass;
    a.shift = static_cast<int>(8 * sizeof(U)) - kRadixBits * (pass + 1);
    a.counts = reinterpret_cast<unsigned*>(base + w.counts) + static_cast<size_t>(pass) * rows * kBuckets;
    a.tickets = reinterpret_cast<unsigned*>(base + w.tickets) + static_cast<size_t>(pass) * rows;
    const cudaError_t err = pass == passes - 1 ? launch_pass<U, true>(a, grid, stream)
                                               : launch_pass<U, false>(a, grid, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace

int kth_largest_blocks_per_row(int rows, int vocab, int sm_count) {
  if (rows < 1 || vocab < 1 || sm_count < 1) return 0;
  const long long wanted = (static_cast<long long>(kSelectBlocksPerSm) * sm_count + rows - 1) / rows;
  const long long most = (vocab + kSelectMinChunk - 1) / kSelectMinChunk;
  return static_cast<int>(wanted < most ? (wanted > 1 ? wanted : 1) : most);
}

size_t kth_largest_workspace_bytes(int key_bits, int rows) {
  if ((key_bits != 16 && key_bits != 32) || rows < 0) return 0;
  return select_layout(key_bits / kRadixBits, rows).total;
}

cudaError_t kth_largest_launch(const KthLargestParams& p, int blocks_per_row, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  if (p.batch < 0 || p.positions < 0 || p.vocab < 1 || p.k < 1 || p.k > p.vocab || blocks_per_row < 1 ||
      (p.key_bits != 16 && p.key_bits != 32)) {
    return cudaErrorInvalidValue;
  }
  const long long rows = static_cast<long long>(p.batch) * p.positions;
  if (rows == 0) return cudaSuccess;
  const int per_block = (p.vocab + blocks_per_row - 1) / blocks_per_row;
  const int chunk = (per_block + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  const int blocks = (p.vocab + chunk - 1) / chunk;  // <= blocks_per_row: no empty block
  if (rows * blocks > INT_MAX || workspace_bytes < kth_largest_workspace_bytes(p.key_bits, static_cast<int>(rows))) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(rows * blocks));
  const int passes = p.key_bits / kRadixBits;
  const SelectWorkspace w = select_layout(passes, static_cast<int>(rows));
  char* base = static_cast<char*>(workspace);
  SelectArgs a;
  a.logits = p.logits;
  a.positions = p.positions;
  a.vocab = p.vocab;
  a.k = p.k;
  a.stride_b = p.stride_b;
  a.stride_j = p.stride_j;
  a.out = p.out;
  a.chunk = chunk;
  a.blocks_per_row = blocks;
  a.best = reinterpret_cast<int*>(base + w.best);
  a.prefix = reinterpret_cast<unsigned*>(base + w.prefix);
  a.remaining = reinterpret_cast<unsigned*>(base + w.remaining);
  return p.key_bits == 16 ? launch_passes<uint16_t>(a, passes, grid, static_cast<int>(rows), base, w, stream)
                          : launch_passes<uint32_t>(a, passes, grid, static_cast<int>(rows), base, w, stream);
}

}  // namespace speculative_kernels
