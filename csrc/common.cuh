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

// Calls f(v, row0[v], row1[v]) for every v in [start, end), each thread visiting its elements in increasing v.
// row1 may be nullptr (then 0 is passed for it). With vectorized == true both row pointers must be 16-byte
// aligned and start a multiple of the vector width; a partial last vector is read element by element.
template <typename T, typename F>
__device__ __forceinline__ void visit_chunk(const T* __restrict__ row0, const T* __restrict__ row1, bool vectorized,
                                            int start, int end, F&& f) {
  constexpr int kVec = VecWidth<T>::value;
  if (vectorized) {
    for (int base = start + static_cast<int>(threadIdx.x) * kVec; base < end;
         base += static_cast<int>(blockDim.x) * kVec) {
      if (base + kVec <= end) {
        const Vec16<T> a = *reinterpret_cast<const Vec16<T>*>(row0 + base);
        Vec16<T> b;
        if (row1 != nullptr) b = *reinterpret_cast<const Vec16<T>*>(row1 + base);
#pragma unroll
        for (int k = 0; k < kVec; ++k) f(base + k, to_float(a.v[k]), row1 != nullptr ? to_float(b.v[k]) : 0.0f);
      } else {
        for (int v = base; v < end; ++v) f(v, to_float(row0[v]), row1 != nullptr ? to_float(row1[v]) : 0.0f);
      }
    }
  } else {
    for (int v = start + static_cast<int>(threadIdx.x); v < end; v += static_cast<int>(blockDim.x)) {
      f(v, to_float(row0[v]), row1 != nullptr ? to_float(row1[v]) : 0.0f);
    }
  }
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
