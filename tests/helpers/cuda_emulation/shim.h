// Host (CPU) execution of the project's CUDA sources: every CUDA thread is a fiber (ucontext), one block at a time,
// __shared__ = static (one block at a time), barriers / warp shuffles are real rendezvous points with divergence and
// deadlock detection. Included before the unmodified csrc headers (g++ -include shim.h).
#pragma once
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <bit>
#include <functional>
#include <source_location>
using std::isnan;
inline int min(int a, int b) { return a < b ? a : b; }

#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)

namespace emu {
struct Idx { unsigned x, y, z; };
extern Idx g_thread, g_block, g_blockdim, g_griddim;
void block_wait(const std::source_location& loc, int pred, int* out);
void warp_exchange(unsigned mask, const std::source_location& loc, int value, int src_lane, bool xor_mode, int* out);
unsigned warp_ballot(unsigned mask, const std::source_location& loc, int pred);
void* dynamic_shared();  // this launch's dynamic shared memory (extern __shared__), ending at an inaccessible page
void fail(const char* what, const std::source_location& loc);
}  // namespace emu

#define threadIdx (::emu::g_thread)
#define blockIdx (::emu::g_block)
#define blockDim (::emu::g_blockdim)
#define gridDim (::emu::g_griddim)

inline void __syncthreads(std::source_location loc = std::source_location::current()) {
  emu::block_wait(loc, 0, nullptr);
}
inline int __syncthreads_or(int pred, std::source_location loc = std::source_location::current()) {
  int out;
  emu::block_wait(loc, pred != 0, &out);
  return out;
}
inline int __shfl_xor_sync(unsigned mask, int v, int lane_mask, int width = 32,
                           std::source_location loc = std::source_location::current()) {
  if (width != 32) emu::fail("shfl width != 32 not emulated", loc);
  int out;
  emu::warp_exchange(mask, loc, v, lane_mask, true, &out);
  return out;
}
inline int __shfl_sync(unsigned mask, int v, int src, int width = 32,
                       std::source_location loc = std::source_location::current()) {
  if (width != 32) emu::fail("shfl width != 32 not emulated", loc);
  int out;
  emu::warp_exchange(mask, loc, v, src, false, &out);
  return out;
}
inline unsigned __ballot_sync(unsigned mask, int pred, std::source_location loc = std::source_location::current()) {
  return emu::warp_ballot(mask, loc, pred);
}
inline int __popc(unsigned x) { return std::popcount(x); }
inline int atomicOr(int* p, int v) { int o = *p; *p = o | v; return o; }
inline int atomicMin(int* p, int v) { int o = *p; *p = o < v ? o : v; return o; }
inline int atomicAdd(int* p, int v) { int o = *p; *p = o + v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p = o + v; return o; }
inline int atomicMax(int* p, int v) { int o = *p; *p = o > v ? o : v; return o; }
inline void __threadfence() {}  // one block runs at a time: its writes are visible to the blocks after it
// A spin-wait's back-off: reached only when a block waits for a block that has not run, which one block at a time
// never releases (a kernel that claims its work in order never gets here): an error, not a hang.
inline void __nanosleep(unsigned, std::source_location loc = std::source_location::current()) {
  emu::fail("spin-wait on a block that never runs (blocks run one after another)", loc);
}
template <typename V>
inline V __ldcg(const V* p) { return *p; }

// IEEE round-to-nearest float ops (compiled with -ffp-contract=off -fno-fast-math: no fusion)
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32); }
namespace emu {
// Runs every block of the grid, one after another; shared_bytes of dynamic shared memory (fresh and filled with a
// garbage pattern for each block). A launch configuration the device would refuse is an error.
void launch(const std::function<void()>& kernel, dim3 grid, dim3 block, size_t shared_bytes = 0);
// Kernel launches and cudaMemsetAsync calls so far (emu_stream_ops): the tests count a call's stream operations.
extern long long n_launches, n_memsets;
}
