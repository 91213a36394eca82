// Framework-free launcher of the KV-cache compaction ("rollback") kernel.
//
// Semantics: speculative_kernels/ops/compaction.py (compact_kv_reference), bit for bit. Per row b and head h of
// kv [B, H, S, D], the real slots (slot_mask[b, s] != 0) move to the left in slot order; the slots past the row's
// real count keep their contents. In place; elements are copied as raw bytes, so any dtype of 1, 2, 4 or 8 bytes
// works. The launcher allocates nothing, never synchronises with the host and returns the launch error (CUDA-graph
// safe).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace speculative_kernels {

struct CompactParams {
  void* kv = nullptr;        // [B, H, S, D], unit stride over D; strides below in elements
  int element_bytes = 0;     // 1, 2, 4 or 8
  int batch = 0;             // B
  int heads = 0;             // H
  int slots = 0;             // S
  int head_dim = 0;          // D
  int64_t stride_b = 0;
  int64_t stride_h = 0;
  int64_t stride_s = 0;
  const int8_t* slot_mask = nullptr;  // [B, S] int8, nonzero = real
  int64_t mask_stride_b = 0;
};

// Slots per tile of the kernel's walk (one warp ballot per tile).
constexpr int kCompactTile = 32;
// Bytes of each slot a block stages in shared memory (tile bytes = kCompactTile * this = 32 KiB). A longer slot row
// (e.g. a 576-wide bf16 latent cache: 1152 bytes) is split into column chunks of this size, one block each.
constexpr int kCompactChunkBytes = 1024;

// Compacts every (b, h) row in place, any head dimension. Returns cudaErrorInvalidValue for an unsupported element
// size or sizes beyond the grid, else the launch error.
cudaError_t compact_kv_launch(const CompactParams& params, cudaStream_t stream);

}  // namespace speculative_kernels
