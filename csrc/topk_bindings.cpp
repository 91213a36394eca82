// Thin PyTorch binding of the k-th largest select (topk_kernels.cuh): checks the logits and k, allocates the output
// and the zeroed workspace with torch's allocator, takes the current stream and calls the launcher. Registered as
// torch.ops.speculative_kernels_cuda.kth_largest_index (a fragment of the library that bindings.cpp defines); the fake
// implementation lives in speculative_kernels/ops/cuda_backend.py.
// Tensor and the per-operator headers of the functions called (not ATen/ATen.h, which declares every operator:
// this file parses in about half the time, and the macro makes an accidental use of another operator an error)
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <climits>

#include "topk_kernels.cuh"

namespace speculative_kernels {
namespace {

int checked_select_size(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= INT_MAX, what, " = ", value, " is out of the supported range [0, 2^31)");
  return static_cast<int>(value);
}

// The device's multiprocessor count, queried once per device (a query in a captured region is allowed, but the
// first call of a decode loop is normally its eager warm-up, outside any capture).
int multiprocessor_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  if (device >= 0 && device < static_cast<int>(cache.size())) {
    const int known = cache[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int count = 0;
  const cudaError_t err = cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  TORCH_CHECK(err == cudaSuccess, "kth_largest_index: cannot read the multiprocessor count: ", cudaGetErrorString(err));
  if (device >= 0 && device < static_cast<int>(cache.size())) cache[device].store(count, std::memory_order_relaxed);
  return count;
}

// logits: [B, V] or [B, J, V] float32 / float16 / bfloat16 (any strides; made unit-stride over V) -> [B] or [B, J]
// int32: the smallest index of each row holding its k-th largest value (1 <= k <= V).
at::Tensor kth_largest_index_cuda(const at::Tensor& logits_in, int64_t k) {
  TORCH_CHECK(logits_in.dim() == 2 || logits_in.dim() == 3, "logits must be [B, V] or [B, J, V], got shape ",
              logits_in.sizes());
  TORCH_CHECK(logits_in.is_cuda(), "logits must be a CUDA tensor, got one on ", logits_in.device());
  const at::ScalarType dtype = logits_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "logits must be float32, float16 or bfloat16, got ", dtype);
  const int64_t vocab = logits_in.size(-1);
  TORCH_CHECK(vocab >= 1, "logits has an empty vocabulary dimension");
  TORCH_CHECK(k >= 1 && k <= vocab, "k must be in [1, V] = [1, ", vocab, "], got ", k);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.stride(-1) == 1 ? logits_in : logits_in.contiguous();
  const bool flat = logits.dim() == 2;
  KthLargestParams p;
  p.key_bits = dtype == at::kFloat ? 32 : 16;
  p.logits = logits.data_ptr();
  p.batch = checked_select_size(logits.size(0), "batch size");
  p.positions = flat ? 1 : checked_select_size(logits.size(1), "number of positions");
  p.vocab = checked_select_size(vocab, "vocabulary size");
  p.stride_b = logits.stride(0);
  p.stride_j = flat ? 0 : logits.stride(1);
  p.k = static_cast<int>(k);
  at::Tensor out = at::empty(logits.sizes().slice(0, logits.dim() - 1), logits.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  const int rows = checked_select_size(out.numel(), "number of rows (B * J)");
  p.out = out.data_ptr<int32_t>();
  const int sm_count = multiprocessor_count(logits.device().index());
  const int blocks_per_row = kth_largest_blocks_per_row(rows, p.vocab, sm_count);
  const size_t bytes = kth_largest_workspace_bytes(p.key_bits, rows);
  at::Tensor workspace = at::zeros({static_cast<int64_t>(bytes)}, logits.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(logits.device().index()).stream();
  const cudaError_t err = kth_largest_launch(p, blocks_per_row, workspace.data_ptr(), bytes, stream);
  TORCH_CHECK(err == cudaSuccess, "speculative_kernels_cuda::kth_largest_index: kernel launch failed: ",
              cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace speculative_kernels

TORCH_LIBRARY_FRAGMENT(speculative_kernels_cuda, m) { m.def("kth_largest_index(Tensor logits, int k) -> Tensor"); }

TORCH_LIBRARY_IMPL(speculative_kernels_cuda, CUDA, m) {
  m.impl("kth_largest_index", &speculative_kernels::kth_largest_index_cuda);
}
