// Framework-free launchers for the speculative verification step and the draft-side sampler.
//
// Semantics: speculative_kernels/ops/reference.py, bit for bit where the arithmetic allows (see README of the ops).
// The launchers take raw device pointers, sizes, strides and a stream; they allocate nothing, never synchronise
// with the host and return the first launch error (CUDA-graph safe). The caller owns the workspace
// (verify_workspace_bytes).
//
// Pipeline (grid over (row, vocabulary chunk) so that a batch of one still fills the GPU):
//   1. chunk_stats: per (row, chunk) the raw float32 argmax, a NaN/+inf flag and, when sampling, the online-softmax
//      partials (max, sum exp) of the warped logits z = x / T (top-k/top-p cut applied).
//   2. decide (one block per batch row): combines the partials into per-row (max, sum), flags invalid rows,
//      gathers p_i(x_i), q_i(x_i), draws the accept uniforms and finds n. Greedy: writes the outputs and stops.
//   3. race: per (batch row, chunk) the exponential race argmax w_v / E_v over the residual max(0, p_n - q_n) and,
//      for the all-zero-residual fallback, over p_n, with Philox noise generated in the kernel.
//   4. finalize (one warp per batch row): combines the race partials and writes tokens / num_accepted.
// Sampling at B = 1, or while B x V <= 131072 (use_fused_passes), fuses 2-4 into one kernel, decide_race, over
// (batch row, 512-id race chunk): each block decides its row itself from the partials (the same fixed-order
// combine as decide), races its chunk, and the row's last block (a ticket taken after a __threadfence; chunk_stats
// zeroes the tickets) combines the race partials in chunk order and writes the outputs: two launches instead of
// four, four times the blocks in the race at B = 1.
// SPECULATIVE_KERNELS_VERIFY_PASSES=single (not the default: written without a GPU, not yet measured; bf16 logits
// without a top-k/top-p cut only, other launches keep the default structure) runs every pass in one kernel after a memset of its counters, greedy and
// sampling: blocks claim work items in order (the statistics
// chunks first, then the race chunks); the last statistics block of a batch row decides it (greedy ends there), the
// race blocks of a row wait for that decision, and the row's last race block writes the outputs.
// The results are identical either way. SPECULATIVE_KERNELS_VERIFY_PASSES=split / =fused / =single forces one
// structure at every batch size (benchmarks and tests compare them); it is read at each launch (a CUDA graph keeps
// what it captured).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "philox_streams.h"

namespace speculative_kernels {

enum class LogitDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Vocabulary elements per thread block in the streaming passes.
constexpr int kChunkSize = 2048;
// Threads per block of the race pass.
constexpr int kStreamThreads = 256;
// Threads per block of chunk_stats: 32 bf16 elements per thread (ncu: with 256 threads, 8 elements each, the per-thread
// setup and the block reduction cost more instructions than the elements).
constexpr int kStatsThreads = 64;

struct VerifyParams {
  LogitDtype dtype = LogitDtype::kFloat32;  // element type of both logit tensors
  int batch = 0;                            // B
  int num_draft = 0;                        // K (0 for the sampler)
  int vocab = 0;                            // V
  // target_logits: [B, K+1, V], unit stride over V; strides in elements.
  const void* target_logits = nullptr;
  int64_t target_stride_b = 0;
  int64_t target_stride_j = 0;
  // draft_logits: [B, K, V], unit stride over V; nullptr means a one-hot q at the draft token.
  const void* draft_logits = nullptr;
  int64_t draft_stride_b = 0;
  int64_t draft_stride_j = 0;
  // draft_tokens: [B, K] int64, contiguous (unused when K == 0).
  const int64_t* draft_tokens = nullptr;
  float temperature = 1.0f;  // 0 means greedy
  // Per-row temperature: [B] float32 contiguous, or nullptr (the scalar for every row). When given it replaces the
  // scalar: a row at 0 is greedy, the others sample (greedy and sampled rows in one launch).
  const float* temperature_rows = nullptr;
  // Per-row draft limit n_b: [B] int64 contiguous in 0..K, or nullptr (K for every row). Row b accepts a prefix of its
  // first n_b drafts and reads no logits or draft tokens past them; a value outside 0..K marks the row invalid.
  const int64_t* num_draft_tokens = nullptr;
  // top-k/top-p cut per row: keep v iff z_v > z_s or (z_v == z_s and v >= cut_index), s = cut_source. The cut value
  // is the warped logit of element s computed here, with the kernels' own arithmetic, so the caller's arithmetic
  // (e.g. Triton's approximate division under torch.compile) cannot move the cut by an ulp. A cut_source outside
  // [0, V) marks the row invalid. nullptr = no cut.
  const int32_t* target_cut_source = nullptr;  // [B, K+1] contiguous
  const int32_t* target_cut_index = nullptr;   // [B, K+1] contiguous
  const int32_t* draft_cut_source = nullptr;   // [B, K] contiguous (needed with draft_logits and a target cut)
  const int32_t* draft_cut_index = nullptr;    // [B, K] contiguous
  // seed, offset: [B] int64 (any stride, 0 allowed).
  const int64_t* seed = nullptr;
  int64_t seed_stride = 0;
  const int64_t* offset = nullptr;
  int64_t offset_stride = 0;
  bool seed_per_row = false;  // Philox c1 = 0 instead of the batch row
  uint32_t stream_base = kStreamPosition;  // Philox c3 of the race at position j is stream_base + j
  // Outputs: tokens [B, K+1] int64 contiguous; num_accepted [B] int64 or nullptr.
  int64_t* tokens = nullptr;
  int64_t* num_accepted = nullptr;
};

// The environment variable that forces the passes' structure ("split", "fused" or "single"; unset or empty: by batch
// size), and whether its current value is one of those (the bindings refuse a launch otherwise, naming it).
constexpr const char* kVerifyPassesVariable = "SPECULATIVE_KERNELS_VERIFY_PASSES";
bool verify_passes_setting_valid();

// Bytes of workspace verify_launch needs for these sizes (0 on invalid sizes).
size_t verify_workspace_bytes(int batch, int num_draft, int vocab, bool has_draft_logits);

// Speculative verification: tokens [B, K+1] (accepted drafts, the next token, then -1) and num_accepted [B]
// (n in 0..K, or -1 with all tokens -1 for an invalid row). workspace: >= verify_workspace_bytes(...) bytes,
// 16-byte aligned, contents irrelevant.
cudaError_t verify_launch(const VerifyParams& params, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// Draft-side sampler: tokens [B] from softmax(warp(logits[B, V])) with the STREAM_DRAFT counters (argmax when
// temperature == 0), -1 for an invalid row. temperature_rows: [B] or nullptr, cut_source/cut_index: [B] or nullptr
// (see VerifyParams). workspace: >= verify_workspace_bytes(batch, 0, vocab, false) bytes.
cudaError_t sample_launch(LogitDtype dtype, const void* logits, int batch, int vocab, int64_t stride_b,
                          float temperature, const float* temperature_rows, const int32_t* cut_source,
                          const int32_t* cut_index, const int64_t* seed, int64_t seed_stride, const int64_t* offset,
                          int64_t offset_stride, bool seed_per_row, int64_t* tokens, void* workspace,
                          size_t workspace_bytes, cudaStream_t stream);

}  // namespace speculative_kernels
