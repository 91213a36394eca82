// Counter-based random numbers, bit-identical to speculative_kernels/ops/philox.py (the reference).
//
// Philox4x32-10 keyed by a 64-bit seed, counter (c0, c1, c2, c3). The accept test and the row keys use the first
// output word; a vocabulary-indexed stream (the races) gives id v word v % 4 of the call at c0 = v / 4.
// Every floating-point step is an explicitly rounded intrinsic so that no FMA contraction or fast-math
// flag can change a bit: the torch reference runs each step as a separate elementwise op.
#pragma once

#include <cstdint>

#include "philox_streams.h"  // the stream ids (kStreamAccept, kStreamPosition, kStreamDraft), defined in philox.py

namespace speculative_kernels {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Ids per Philox call in a vocabulary-indexed stream: id v takes word v % kWordsPerCall of the call at
// c0 = v / kWordsPerCall (philox.py's vocabulary_bits).
constexpr int kWordsPerCall = 4;

struct PhiloxWords {
  uint32_t w[kWordsPerCall];
};

// The four output words of Philox4x32-10(seed; c0, c1, c2, c3).
__device__ __forceinline__ PhiloxWords philox_words(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2,
                                                    uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed);
  uint32_t k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < kPhiloxRounds; ++round) {
    const uint32_t hi0 = __umulhi(kPhiloxM0, c0);
    const uint32_t lo0 = kPhiloxM0 * c0;
    const uint32_t hi1 = __umulhi(kPhiloxM1, c2);
    const uint32_t lo1 = kPhiloxM1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return PhiloxWords{{c0, c1, c2, c3}};
}

// First output word of Philox4x32-10(seed; c0, c1, c2, c3) (the compiler drops the other words' last products).
__device__ __forceinline__ uint32_t philox_first_word(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2,
                                                      uint32_t c3) {
  return philox_words(seed, c0, c1, c2, c3).w[0];
}

// uniform(x) = float32(x >> 8) * 2^-24, in [0, 1); exact.
__device__ __forceinline__ float uniform_from_bits(uint32_t x) {
  return __fmul_rn(__uint2float_rn(x >> 8), 0x1p-24f);
}

// exponential(x) = -log1p(-u), u = min(max(float32(x) * 2^-32, 2^-33), 1 - 2^-24); the series
// u * (1 + u * (1/2 + u * (1/3))) below 2^-8 and -log(1 - u) otherwise: finite, so a positive weight's key w / E is
// never 0 (see philox.py). Same rounding, step by step, as philox.py.
__device__ __forceinline__ float exponential_from_bits(uint32_t x) {
  float u = __fmul_rn(__uint2float_rn(x), 0x1p-32f);
  u = fminf(fmaxf(u, 0x1p-33f), 0x1.fffffep-1f);
  if (u < 0x1p-8f) {
    const float third = static_cast<float>(1.0 / 3.0);
    const float inner = __fadd_rn(0.5f, __fmul_rn(u, third));
    return __fmul_rn(u, __fadd_rn(1.0f, __fmul_rn(u, inner)));
  }
  return -logf(__fsub_rn(1.0f, u));
}

}  // namespace speculative_kernels
