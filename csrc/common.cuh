// Small device helpers shared by the kernels: logit loads, warp reductions, compile-time switches.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

namespace speculative_kernels {

// ---- compile-time switches (flash-attention's BOOL_SWITCH): one template instance per branch -------------
#define SK_BOOL_SWITCH(COND, CONST_NAME, ...)  \
  [&] {                                        \
    if (COND) {                                \
      constexpr static bool CONST_NAME = true; \
      return __VA_ARGS__();                    \
    } else {                                   \
      constexpr static bool CONST_NAME = false;\
      return __VA_ARGS__();                    \
    }                                          \
  }()

// ---- logit element types -------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Elements per 16-byte load.
template <typename T>
struct VecWidth {
  static constexpr int value = 16 / static_cast<int>(sizeof(T));
};

template <typename T>
struct alignas(16) Vec16 {
  T v[VecWidth<T>::value];
};

// Ids per group of visit_quads: an aligned group [v0, v0 + 4) by vocabulary index (v0 a multiple of 4), the ids that
// share one Philox call (philox.cuh's kWordsPerCall).
constexpr int kQuad = 4;

// One group of visit_quads read element by element: its ids in [start, end), k in [first, last), are loaded.
template <typename T, typename F>
__device__ __forceinline__ void visit_quad_elements(const T* __restrict__ row0, const T* __restrict__ row1, int v0,
                                                    int start, int end, F&& f) {
  const int first = start > v0 ? start - v0 : 0;
  const int last = end - v0 < kQuad ? end - v0 : kQuad;
  float x[kQuad], y[kQuad];
#pragma unroll
  for (int k = 0; k < kQuad; ++k) {
    x[k] = 0.0f;
    y[k] = 0.0f;
    if (k >= first && k < last) {
      x[k] = to_float(row0[v0 + k]);
      if (row1 != nullptr) y[k] = to_float(row1[v0 + k]);
    }
  }
  f(v0, x, y, first, last);
}

// Calls f(v0, x, y, first, last) for every aligned group of kQuad ids [v0, v0 + kQuad) (v0 a multiple of kQuad) that
// meets [start, end): the group's ids in the range are v0 + k for k in [first, last), with x[k] = row0[v0 + k] and
// y[k] = row1[v0 + k] (x, y: const float (&)[kQuad]; 0 outside the range, and y is 0 where row1 is nullptr). One
// thread visits a whole group, its groups in increasing v0. With vectorized == true both row pointers must be
// 16-byte aligned and start a multiple of the vector width (whole groups: 4 or 8 ids); a partial last vector is read
// element by element. Otherwise (an unaligned row) thread t visits groups t, t + blockDim.x, ... of the range.
template <typename T, typename F>
__device__ __forceinline__ void visit_quads(const T* __restrict__ row0, const T* __restrict__ row1, bool vectorized,
                                            int start, int end, F&& f) {
  constexpr int kVec = VecWidth<T>::value;
  static_assert(kVec % kQuad == 0, "a 16-byte vector holds whole groups");
  if (start >= end) return;
  if (vectorized) {
    for (int base = start + static_cast<int>(threadIdx.x) * kVec; base < end;
         base += static_cast<int>(blockDim.x) * kVec) {
      if (base + kVec <= end) {
        const Vec16<T> a = *reinterpret_cast<const Vec16<T>*>(row0 + base);
        Vec16<T> b;
        if (row1 != nullptr) b = *reinterpret_cast<const Vec16<T>*>(row1 + base);
#pragma unroll
        for (int g = 0; g < kVec; g += kQuad) {
          float x[kQuad], y[kQuad];
#pragma unroll
          for (int k = 0; k < kQuad; ++k) {
            x[k] = to_float(a.v[g + k]);
            y[k] = row1 != nullptr ? to_float(b.v[g + k]) : 0.0f;
          }
          f(base + g, x, y, 0, kQuad);
        }
      } else {
        for (int v0 = base; v0 < end; v0 += kQuad) visit_quad_elements(row0, row1, v0, start, end, f);
      }
    }
  } else {
    const int last_group = (end - 1) / kQuad;  // end > start >= 0
    for (int g = start / kQuad + static_cast<int>(threadIdx.x); g <= last_group; g += static_cast<int>(blockDim.x)) {
      visit_quad_elements(row0, row1, g * kQuad, start, end, f);
    }
  }
}

// Calls f(base, x) for every element of [start, end) in groups x = row[base .. base + N) (a const T (&)[N]), each
// thread visiting its groups in increasing base: N = VecWidth<T> for a full 16-byte vector, N = 1 for the elements of
// a partial last vector and of an unaligned row. blockDim.x must be THREADS. A chunk of FULL elements, the common case,
// is read with all of a thread's vectors loaded before the first call (its loads in flight together). With
// vectorized == true, row must be 16-byte aligned and start a multiple of the vector width.
template <int THREADS, int FULL, typename T, typename F>
__device__ __forceinline__ void visit_groups(const T* __restrict__ row, bool vectorized, int start, int end, F&& f) {
  constexpr int kVec = VecWidth<T>::value;
  constexpr int kPerThread = FULL / (THREADS * kVec);
  static_assert(FULL % (THREADS * kVec) == 0, "a full chunk must be whole vectors for every thread");
  const int tid = static_cast<int>(threadIdx.x);
  if (vectorized && end - start == FULL) {
    Vec16<T> x[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      x[i] = *reinterpret_cast<const Vec16<T>*>(row + start + (i * THREADS + tid) * kVec);
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) f(start + (i * THREADS + tid) * kVec, x[i].v);
  } else if (vectorized) {
    for (int base = start + tid * kVec; base < end; base += THREADS * kVec) {
      if (base + kVec <= end) {
        const Vec16<T> x = *reinterpret_cast<const Vec16<T>*>(row + base);
        f(base, x.v);
      } else {
        for (int v = base; v < end; ++v) {
          const T x[1] = {row[v]};
          f(v, x);
        }
      }
    }
  } else {
    for (int v = start + tid; v < end; v += THREADS) {
      const T x[1] = {row[v]};
      f(v, x);
    }
  }
}

// ---- NaN-propagating maxima -------------------------------------------------------------------------------------
// max(a, b), NaN if either is NaN (fmaxf drops a NaN): one max.NaN on sm_80+.
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float out;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(out) : "f"(a), "f"(b));
  return out;
#else
  return isnan(a) || isnan(b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
#endif
}

// NaN-propagating max of a group, as float32 (exact: every element converts exactly).
template <typename T, int N>
__device__ __forceinline__ float group_max_nan(const T (&x)[N]) {
  float out = to_float(x[0]);
#pragma unroll
  for (int k = 1; k < N; ++k) out = fmax_nan(out, to_float(x[k]));
  return out;
}

// A 16-byte vector of bf16 / fp16: pairs first, two elements per packed max.NaN.
template <typename T2, typename T>
__device__ __forceinline__ float packed_max_nan(const T (&x)[8]) {
  T2 pairs[4];
  memcpy(pairs, x, sizeof(pairs));
  const T2 top = __hmax2_nan(__hmax2_nan(pairs[0], pairs[1]), __hmax2_nan(pairs[2], pairs[3]));
  return fmax_nan(__low2float(top), __high2float(top));
}
__device__ __forceinline__ float group_max_nan(const __nv_bfloat16 (&x)[8]) {
  return packed_max_nan<__nv_bfloat162>(x);
}
__device__ __forceinline__ float group_max_nan(const __half (&x)[8]) { return packed_max_nan<__half2>(x); }

// Index in x of its first element equal to top (top: an element of x, not NaN).
template <typename T, int N>
__device__ __forceinline__ int first_equal(const T (&x)[N], float top) {
  int k = N - 1;
#pragma unroll
  for (int i = N - 2; i >= 0; --i) k = to_float(x[i]) == top ? i : k;
  return k;
}

// ---- reductions -------------------------------------------------------------------------------------------
constexpr unsigned kFullMask = 0xffffffffu;

// __shfl_xor_sync for a trivially copyable struct made of 4-byte words.
template <typename S>
__device__ __forceinline__ S shfl_xor_struct(const S& value, int lane_mask) {
  static_assert(sizeof(S) % 4 == 0, "struct must be made of 4-byte words");
  constexpr int kWords = static_cast<int>(sizeof(S) / 4);
  int words[kWords];
  memcpy(words, &value, sizeof(S));
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = __shfl_xor_sync(kFullMask, words[i], lane_mask);
  S out;
  memcpy(&out, words, sizeof(S));
  return out;
}

// Butterfly reduction over a full warp; lane 0's result is a fixed function of the 32 inputs (deterministic).
template <typename S, typename Op>
__device__ __forceinline__ S warp_reduce(S value, Op op) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) value = op(value, shfl_xor_struct(value, mask));
  return value;
}

// Block-wide reduction of NUM_WARPS full warps whose result every thread gets (combined in the same fixed order in
// each). scratch: >= NUM_WARPS entries of shared memory. Contains __syncthreads: every thread must call it.
template <int NUM_WARPS, typename S, typename Op>
__device__ __forceinline__ S block_all_reduce(S value, Op op, S* scratch) {
  value = warp_reduce(value, op);
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = value;
  __syncthreads();
  value = scratch[0];
#pragma unroll
  for (int w = 1; w < NUM_WARPS; ++w) value = op(value, scratch[w]);
  __syncthreads();  // scratch may be reused by the caller
  return value;
}

// Block-wide reduction; the result is valid in thread 0. scratch: >= 32 entries of shared memory.
// blockDim.x must be a multiple of 32. Contains __syncthreads: every thread of the block must call it.
template <typename S, typename Op>
__device__ __forceinline__ S block_reduce(S value, Op op, const S& identity, S* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int num_warps = static_cast<int>(blockDim.x) >> 5;
  value = warp_reduce(value, op);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < num_warps ? scratch[lane] : identity;
    value = warp_reduce(value, op);
  }
  __syncthreads();  // scratch may be reused by the caller
  return value;
}

// (value, index) argmax with torch.argmax's rules: NaN beats everything, ties go to the smaller index.
// Returns true when (va, ia) should win over (vb, ib).
__device__ __forceinline__ bool argmax_prefers(float va, int ia, float vb, int ib) {
  const bool a_nan = isnan(va);
  const bool b_nan = isnan(vb);
  if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
  return va > vb || (va == vb && ia < ib);
}

}  // namespace speculative_kernels
