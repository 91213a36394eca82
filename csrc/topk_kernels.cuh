// Framework-free launcher of the k-th largest element per logit row: the top-k cut of the CUDA backend
// (speculative_kernels/ops/cuda_host.py, _top_k_cut) without torch.topk.
//
// A radix select over order-preserving integer keys of the logits' bits (16-bit keys for fp16/bf16, 32-bit for
// float32: the sign bit flipped for a positive value, every bit for a negative one, so that unsigned key order refines
// float order: -0 < +0, a NaN above +inf or below -inf by its sign). Passes of 8 bits from the top: each pass is one
// kernel over (row, chunk of the vocabulary) that histograms the current digit of the elements whose higher digits
// match the prefix found so far (shared-memory histogram, then atomics into the row's global [256] counts); the row's
// last block to finish (a ticket taken after a __threadfence) picks the bucket holding the k-th largest key, counting
// from the top, and keeps the prefix and the remaining k for the next pass. The last pass also keeps, per bucket, the
// smallest index holding it (atomicMax of INT_MAX - v), so the row's last block writes the index of the k-th largest
// key directly: 2 kernels for fp16/bf16, 4 for float32, after the caller zeroed the workspace. The result is the
// smallest index holding the k-th largest key, whatever the grid: deterministic.
//
// Ties: the k-th largest VALUE is what the cut needs (top-k keeps every element >= it, HF's TopKLogitsWarper keeps
// ties), and any total order refining <= gives the same k-th value; -0 and +0 are equal values. A row with a NaN gets
// an unspecified element (the verification kernels flag such a row whatever its cut).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace speculative_kernels {

// Threads per block of the select passes.
constexpr int kSelectThreads = 256;

struct KthLargestParams {
  int key_bits = 16;  // 16 (fp16 / bf16 bits) or 32 (float32 bits)
  // logits: [B, J, V] raw bits (uint16 or uint32 elements), unit stride over V; strides in elements. Rows are
  // r = b * J + j.
  const void* logits = nullptr;
  int batch = 0;  // B
  int positions = 0;  // J
  int vocab = 0;  // V
  int64_t stride_b = 0;
  int64_t stride_j = 0;
  int k = 1;  // 1 <= k <= V: the k-th largest, counting from 1
  // out: [B, J] int32 contiguous: the smallest index v of the row whose key is the k-th largest.
  int32_t* out = nullptr;
};

// Blocks per row for these sizes on a device of sm_count multiprocessors: about kSelectBlocksPerSm blocks per SM in
// all, each over at least kSelectMinChunk ids (a batch of one still spreads over the GPU; a large batch gets one
// block per row). 0 on invalid sizes.
int kth_largest_blocks_per_row(int rows, int vocab, int sm_count);

// Bytes of workspace for these sizes (0 on invalid sizes). The workspace must be zeroed before each launch.
size_t kth_largest_workspace_bytes(int key_bits, int rows);

// Launches the select passes (2 kernels for 16-bit keys, 4 for 32-bit) on stream; blocks_per_row >= 1 (any value
// gives the same result; kth_largest_blocks_per_row's is the tuned one). workspace: >= kth_largest_workspace_bytes
// bytes, 16-byte aligned, ZEROED. Returns the first launch error.
cudaError_t kth_largest_launch(const KthLargestParams& params, int blocks_per_row, void* workspace,
                               size_t workspace_bytes, cudaStream_t stream);

}  // namespace speculative_kernels
