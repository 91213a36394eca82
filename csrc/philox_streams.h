// Philox stream ids (counter word c3), generated from speculative_kernels/ops/philox.py, which defines them:
// (a comment line never ends in a backslash here: nvcc's -Wcomment would warn of a multi-line comment)
//   python -c 'from speculative_kernels.ops.philox import streams_header as h; print(h(), end="")' >
//       csrc/philox_streams.h
// Do not edit by hand (tests/ops/test_random_streams.py checks that this file is current).
#pragma once

#include <cstdint>

namespace speculative_kernels {

constexpr uint32_t kStreamAccept = 0x00000000u;  // accept-test uniforms, c0 = draft position i
constexpr uint32_t kStreamPosition = 0x00000001u;  // + block position j: the race at position j of verify
constexpr uint32_t kStreamDraft = 0x40000000u;  // the draft-side sampler
constexpr uint32_t kStreamRowKey = 0x60000000u;  // + 0, + 1: the two words of a row's key (randomness.row_keys)

}  // namespace speculative_kernels
