// Thin PyTorch binding of the KV-cache compaction kernel (rollback_kernels.cuh): checks shapes / dtypes / devices,
// takes the current stream and calls the framework-free launcher. Registered as
// torch.ops.speculative_kernels_cuda.compact_kv_ (a fragment of the library that bindings.cpp defines); the fake
// implementation lives in speculative_kernels/ops/compaction_cuda.py.
// Tensor and the per-operator headers of the functions called (not ATen/ATen.h, which declares every operator:
// this file parses in about half the time, and the macro makes an accidental use of another operator an error)
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

#include "rollback_kernels.cuh"

namespace speculative_kernels {
namespace {

int checked_size(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= INT_MAX, what, " = ", value, " is out of the supported range [0, 2^31)");
  return static_cast<int>(value);
}

void compact_kv_cuda(at::Tensor kv, const at::Tensor& slot_mask) {
  TORCH_CHECK(kv.dim() == 4, "kv must be [B, H, S, D], got shape ", kv.sizes());
  TORCH_CHECK(kv.is_cuda(), "kv must be a CUDA tensor, got one on ", kv.device());
  TORCH_CHECK(slot_mask.dim() == 2, "slot_mask must be [B, S], got shape ", slot_mask.sizes());
  TORCH_CHECK(slot_mask.device() == kv.device(), "slot_mask is on ", slot_mask.device(), " but kv is on ",
              kv.device());
  TORCH_CHECK(slot_mask.scalar_type() == at::kChar, "slot_mask must be int8, got ", slot_mask.scalar_type());
  TORCH_CHECK(slot_mask.size(0) == kv.size(0) && slot_mask.size(1) == kv.size(2), "slot_mask has shape ",
              slot_mask.sizes(), " but kv has ", kv.sizes(), " ([B, S] must match)");
  TORCH_CHECK(slot_mask.stride(1) == 1 || slot_mask.size(1) <= 1, "slot_mask must have unit stride over slots");
  TORCH_CHECK(kv.stride(3) == 1 || kv.size(3) <= 1, "kv must have unit stride over the head dimension, got strides ",
              kv.strides());
  const c10::cuda::CUDAGuard guard(kv.device());
  CompactParams p;
  p.kv = kv.data_ptr();
  p.element_bytes = static_cast<int>(kv.element_size());
  p.batch = checked_size(kv.size(0), "batch size");
  p.heads = checked_size(kv.size(1), "number of heads");
  p.slots = checked_size(kv.size(2), "number of slots");
  p.head_dim = checked_size(kv.size(3), "head dimension");
  TORCH_CHECK(p.element_bytes == 1 || p.element_bytes == 2 || p.element_bytes == 4 || p.element_bytes == 8,
              "kv must have 1-, 2-, 4- or 8-byte elements, got ", kv.scalar_type());
  p.stride_b = kv.stride(0);
  p.stride_h = kv.stride(1);
  p.stride_s = kv.stride(2);
  p.slot_mask = slot_mask.data_ptr<int8_t>();
  p.mask_stride_b = slot_mask.stride(0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(kv.device().index()).stream();
  const cudaError_t err = compact_kv_launch(p, stream);
  TORCH_CHECK(err == cudaSuccess, "speculative_kernels_cuda::compact_kv_: kernel launch failed: ",
              cudaGetErrorString(err));
}

}  // namespace
}  // namespace speculative_kernels

TORCH_LIBRARY_FRAGMENT(speculative_kernels_cuda, m) { m.def("compact_kv_(Tensor(a!) kv, Tensor slot_mask) -> ()"); }

TORCH_LIBRARY_IMPL(speculative_kernels_cuda, CUDA, m) { m.impl("compact_kv_", &speculative_kernels::compact_kv_cuda); }
