// The C entry points of the CUDA emulation (tests/helpers/cuda_emulation): guarded allocations, and verify/sample
// launched as bindings.cpp launches them (VerifyParams, the workspace), on the host build of verify_kernels.cu,
// kth_largest_index as topk_bindings.cpp launches it, on the host build of topk_kernels.cu, and
// compact_kv as rollback_bindings.cpp launches it (CompactParams), on the host build of rollback_kernels.cu.
#include "rollback_kernels.cuh"
#include "topk_kernels.cuh"
#include "verify_kernels.cuh"
#include <sys/mman.h>
#include <unistd.h>
namespace emu { extern long long n_switches; extern int errors; extern int reverse_order; extern int reverse_blocks; }
using namespace speculative_kernels;
extern "C" {
// nbytes of memory, 16-byte aligned, whose end (rounded up to 16) touches a PROT_NONE page (and one before it).
void* emu_alloc(size_t nbytes) {
  const size_t page = 4096;
  const size_t rounded = (nbytes + 15) / 16 * 16;
  const size_t data_pages = (rounded + page - 1) / page;
  const size_t total = (data_pages + 2) * page;
  char* m = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (m == MAP_FAILED) return nullptr;
  mprotect(m, page, PROT_NONE);
  mprotect(m + (data_pages + 1) * page, page, PROT_NONE);
  return m + (data_pages + 1) * page - rounded;
}
int emu_errors() { return emu::errors; }
void emu_set_reverse_order(int reverse) { emu::reverse_order = reverse; }
void emu_set_reverse_blocks(int reverse) { emu::reverse_blocks = reverse; }
long long emu_switches() { return emu::n_switches; }
// Stream operations so far: kernel launches (emu::launch) and cudaMemsetAsync calls.
long long emu_launches() { return emu::n_launches; }
long long emu_memsets() { return emu::n_memsets; }
size_t emu_workspace_bytes(int batch, int num_draft, int vocab, int has_draft) {
  return verify_workspace_bytes(batch, num_draft, vocab, has_draft != 0);
}
int emu_verify(int dtype, int batch, int num_draft, int vocab, const void* target, int64_t tsb, int64_t tsj,
               const void* draft, int64_t dsb, int64_t dsj, const int64_t* draft_tokens, float temperature,
               const float* temperature_rows, const int64_t* num_draft_tokens, const int32_t* tcs, const int32_t* tci,
               const int32_t* dcs, const int32_t* dci, const int64_t* seed, int64_t seed_stride, const int64_t* offset,
               int64_t offset_stride, int seed_per_row, int64_t* tokens, int64_t* num_accepted, void* ws,
               size_t ws_bytes) {
  VerifyParams p;
  p.dtype = static_cast<LogitDtype>(dtype);
  p.batch = batch; p.num_draft = num_draft; p.vocab = vocab;
  p.target_logits = target; p.target_stride_b = tsb; p.target_stride_j = tsj;
  p.draft_logits = draft; p.draft_stride_b = dsb; p.draft_stride_j = dsj;
  p.draft_tokens = draft_tokens; p.temperature = temperature; p.temperature_rows = temperature_rows;
  p.num_draft_tokens = num_draft_tokens;
  p.target_cut_source = tcs; p.target_cut_index = tci; p.draft_cut_source = dcs; p.draft_cut_index = dci;
  p.seed = seed; p.seed_stride = seed_stride; p.offset = offset; p.offset_stride = offset_stride;
  p.seed_per_row = seed_per_row != 0; p.stream_base = kStreamPosition;
  p.tokens = tokens; p.num_accepted = num_accepted;
  return static_cast<int>(verify_launch(p, ws, ws_bytes, nullptr));
}
int emu_sample(int dtype, const void* logits, int batch, int vocab, int64_t stride_b, float temperature,
               const float* temperature_rows, const int32_t* cs, const int32_t* ci, const int64_t* seed,
               int64_t seed_stride, const int64_t* offset, int64_t offset_stride, int seed_per_row, int64_t* tokens,
               void* ws, size_t ws_bytes) {
  return static_cast<int>(sample_launch(static_cast<LogitDtype>(dtype), logits, batch, vocab, stride_b, temperature,
                                        temperature_rows, cs, ci, seed, seed_stride, offset, offset_stride,
                                        seed_per_row != 0, tokens, ws, ws_bytes, nullptr));
}
size_t emu_kth_workspace_bytes(int key_bits, int rows) { return kth_largest_workspace_bytes(key_bits, rows); }
int emu_kth_blocks_per_row(int rows, int vocab, int sm_count) {
  return kth_largest_blocks_per_row(rows, vocab, sm_count);
}
int emu_kth_largest(int key_bits, const void* logits, int batch, int positions, int vocab, int64_t stride_b,
                    int64_t stride_j, int k, int32_t* out, int blocks_per_row, void* ws, size_t ws_bytes) {
  KthLargestParams p;
  p.key_bits = key_bits; p.logits = logits;
  p.batch = batch; p.positions = positions; p.vocab = vocab; p.stride_b = stride_b; p.stride_j = stride_j;
  p.k = k; p.out = out;
  return static_cast<int>(kth_largest_launch(p, blocks_per_row, ws, ws_bytes, nullptr));
}
int emu_compact_kv(void* kv, int element_bytes, int batch, int heads, int slots, int head_dim, int64_t stride_b,
                   int64_t stride_h, int64_t stride_s, const int8_t* slot_mask, int64_t mask_stride_b) {
  CompactParams p;
  p.kv = kv; p.element_bytes = element_bytes;
  p.batch = batch; p.heads = heads; p.slots = slots; p.head_dim = head_dim;
  p.stride_b = stride_b; p.stride_h = stride_h; p.stride_s = stride_s;
  p.slot_mask = slot_mask; p.mask_stride_b = mask_stride_b;
  return static_cast<int>(compact_kv_launch(p, nullptr));
}
}
