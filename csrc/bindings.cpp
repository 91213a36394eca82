// Thin PyTorch binding of the verification kernels: checks shapes / dtypes / devices (each error names the
// argument), allocates the outputs and the workspace with torch's allocator, takes the current stream and calls the
// framework-free launchers of verify_kernels.cuh. Registered as torch.ops.speculative_kernels_cuda.{verify,sample};
// the fake (meta) implementations live in speculative_kernels/ops/cuda_backend.py.
#include <Python.h>  // only for the empty module init below, so that `import speculative_kernels._C` loads the ops

// Tensor and the per-operator headers of the functions called (not ATen/ATen.h, which declares every operator:
// this file parses in about half the time, and the macro makes an accidental use of another operator an error)
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "philox_streams.h"
#include "verify_kernels.cuh"

namespace speculative_kernels {
namespace {

LogitDtype logit_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return LogitDtype::kFloat32;
    case at::kHalf:
      return LogitDtype::kFloat16;
    case at::kBFloat16:
      return LogitDtype::kBFloat16;
    default:
      TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
  return LogitDtype::kFloat32;  // unreachable
}

void check_on_device(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the logits are on ", device);
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " must have shape ", expected, ", got ", t.sizes());
}

int checked_int(int64_t value, const char* what) {
  TORCH_CHECK(value >= 0 && value <= INT_MAX, what, " = ", value, " is out of the supported range [0, 2^31)");
  return static_cast<int>(value);
}

float checked_temperature(double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature >= 0.0, "temperature must be finite and >= 0, got ",
              temperature);
  return static_cast<float>(temperature);
}

// Logits with unit stride over the vocabulary (the kernels' only layout requirement).
at::Tensor unit_stride_vocab(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// seed / offset: [B] int64 on the logits' device; any stride (an expanded scalar has stride 0).
void check_row_tensor(const at::Tensor& t, const char* name, int64_t batch, const at::Device& device) {
  check_on_device(t, name, device);
  TORCH_CHECK(t.scalar_type() == at::kLong, name, " must be int64, got ", t.scalar_type());
  check_shape(t, name, {batch});
}

// A top-k/top-p cut tensor (int32 source or tie-break vocabulary ids, one per logit row), made contiguous.
at::Tensor cut_tensor(const std::optional<at::Tensor>& t, const char* name, at::IntArrayRef shape,
                      const at::Device& device) {
  TORCH_CHECK(t.has_value(), name, " is required when a top-k/top-p cut is given");
  check_on_device(*t, name, device);
  TORCH_CHECK(t->scalar_type() == at::kInt, name, " must be int32, got ", t->scalar_type());
  check_shape(*t, name, shape);
  return t->contiguous();
}

// Optional per-row tensor (temperature_rows: float32, num_draft_tokens: int64) of shape [B], made contiguous.
at::Tensor optional_row_tensor(const std::optional<at::Tensor>& t, const char* name, at::ScalarType dtype,
                               int64_t batch, const at::Device& device) {
  if (!t.has_value()) return at::Tensor();
  check_on_device(*t, name, device);
  TORCH_CHECK(t->scalar_type() == dtype, name, " must be ", dtype, ", got ", t->scalar_type());
  check_shape(*t, name, {batch});
  return t->contiguous();
}

// A benchmarking knob, but a typo must not silently mean "the default".
void check_passes_setting() {
  TORCH_CHECK_VALUE(verify_passes_setting_valid(), kVerifyPassesVariable,
                    " must be 'split', 'fused' or unset (or 'single': every pass in one kernel), got '",
                    std::getenv(kVerifyPassesVariable), "'");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "speculative_kernels_cuda::", op, ": kernel launch failed: ", cudaGetErrorString(err));
}

std::tuple<at::Tensor, at::Tensor> verify_cuda(const at::Tensor& target_logits_in,
                                               const std::optional<at::Tensor>& draft_logits_in,
                                               const at::Tensor& draft_tokens_in, double temperature_in,
                                               const std::optional<at::Tensor>& temperature_rows_in,
                                               const std::optional<at::Tensor>& target_cut_source_in,
                                               const std::optional<at::Tensor>& target_cut_index_in,
                                               const std::optional<at::Tensor>& draft_cut_source_in,
                                               const std::optional<at::Tensor>& draft_cut_index_in,
                                               const at::Tensor& seed, const at::Tensor& offset, bool seed_per_row,
                                               const std::optional<at::Tensor>& num_draft_tokens_in) {
  TORCH_CHECK(target_logits_in.dim() == 3, "target_logits must be [B, K+1, V], got shape ", target_logits_in.sizes());
  const at::Device device = target_logits_in.device();
  check_on_device(target_logits_in, "target_logits", device);
  const c10::cuda::CUDAGuard guard(device);
  const int64_t batch = target_logits_in.size(0);
  const int64_t num_draft = target_logits_in.size(1) - 1;
  const int64_t vocab = target_logits_in.size(2);
  TORCH_CHECK(num_draft >= 0, "target_logits must have at least one position, got shape ", target_logits_in.sizes());
  TORCH_CHECK(vocab >= 1, "target_logits has an empty vocabulary dimension");
  const float temperature = checked_temperature(temperature_in);
  const at::Tensor temperature_rows = optional_row_tensor(temperature_rows_in, "temperature_rows", at::kFloat, batch,
                                                          device);
  const bool sampling = temperature > 0.0f || temperature_rows.defined();  // some row samples
  const at::Tensor num_draft_tokens = optional_row_tensor(num_draft_tokens_in, "num_draft_tokens", at::kLong, batch,
                                                          device);

  at::Tensor target_logits = unit_stride_vocab(target_logits_in);
  logit_dtype(target_logits, "target_logits");
  at::Tensor draft_logits;
  if (draft_logits_in.has_value()) {
    draft_logits = unit_stride_vocab(*draft_logits_in);
    check_on_device(draft_logits, "draft_logits", device);
    logit_dtype(draft_logits, "draft_logits");
    check_shape(draft_logits, "draft_logits", {batch, num_draft, vocab});
    if (draft_logits.scalar_type() != target_logits.scalar_type()) {
      // Mixed dtypes: promote both to float32, which represents every fp16/bf16 value exactly.
      target_logits = target_logits.to(at::kFloat);
      draft_logits = draft_logits.to(at::kFloat);
    }
  }
  check_on_device(draft_tokens_in, "draft_tokens", device);
  TORCH_CHECK(draft_tokens_in.scalar_type() == at::kLong || draft_tokens_in.scalar_type() == at::kInt,
              "draft_tokens must be int64 or int32, got ", draft_tokens_in.scalar_type());
  check_shape(draft_tokens_in, "draft_tokens", {batch, num_draft});
  const at::Tensor draft_tokens = draft_tokens_in.to(at::kLong).contiguous();
  check_row_tensor(seed, "seed", batch, device);
  check_row_tensor(offset, "offset", batch, device);

  VerifyParams p;
  p.dtype = logit_dtype(target_logits, "target_logits");
  p.batch = checked_int(batch, "batch size");
  p.num_draft = checked_int(num_draft, "number of draft tokens");
  p.vocab = checked_int(vocab, "vocabulary size");
  p.target_logits = target_logits.data_ptr();
  p.target_stride_b = target_logits.stride(0);
  p.target_stride_j = target_logits.stride(1);
  if (draft_logits.defined()) {
    p.draft_logits = draft_logits.data_ptr();
    p.draft_stride_b = draft_logits.stride(0);
    p.draft_stride_j = draft_logits.stride(1);
  }
  p.draft_tokens = draft_tokens.data_ptr<int64_t>();
  p.temperature = temperature;
  p.temperature_rows = temperature_rows.defined() ? temperature_rows.data_ptr<float>() : nullptr;
  p.num_draft_tokens = num_draft_tokens.defined() ? num_draft_tokens.data_ptr<int64_t>() : nullptr;
  at::Tensor target_cut_source, target_cut_index, draft_cut_source, draft_cut_index;
  if (sampling && target_cut_source_in.has_value()) {
    target_cut_source = cut_tensor(target_cut_source_in, "target_cut_source", {batch, num_draft + 1}, device);
    target_cut_index = cut_tensor(target_cut_index_in, "target_cut_index", {batch, num_draft + 1}, device);
    p.target_cut_source = target_cut_source.data_ptr<int32_t>();
    p.target_cut_index = target_cut_index.data_ptr<int32_t>();
    if (draft_logits.defined()) {
      draft_cut_source = cut_tensor(draft_cut_source_in, "draft_cut_source", {batch, num_draft}, device);
      draft_cut_index = cut_tensor(draft_cut_index_in, "draft_cut_index", {batch, num_draft}, device);
      p.draft_cut_source = draft_cut_source.data_ptr<int32_t>();
      p.draft_cut_index = draft_cut_index.data_ptr<int32_t>();
    }
  }
  p.seed = seed.data_ptr<int64_t>();
  p.seed_stride = seed.stride(0);
  p.offset = offset.data_ptr<int64_t>();
  p.offset_stride = offset.stride(0);
  p.seed_per_row = seed_per_row;
  p.stream_base = kStreamPosition;

  const auto long_options = target_logits.options().dtype(at::kLong);
  at::Tensor tokens = at::empty({batch, num_draft + 1}, long_options);
  at::Tensor num_accepted = at::empty({batch}, long_options);
  if (batch == 0) return {tokens, num_accepted};
  p.tokens = tokens.data_ptr<int64_t>();
  p.num_accepted = num_accepted.data_ptr<int64_t>();

  check_passes_setting();
  const size_t workspace_bytes = verify_workspace_bytes(p.batch, p.num_draft, p.vocab, draft_logits.defined());
  TORCH_CHECK(workspace_bytes > 0, "verify: sizes B=", batch, " K=", num_draft, " V=", vocab,
              " exceed the kernels' grid limits");
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, target_logits.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  check_launch(verify_launch(p, workspace.data_ptr(), workspace_bytes, stream), "verify");
  return {tokens, num_accepted};
}

at::Tensor sample_cuda(const at::Tensor& logits_in, double temperature_in,
                       const std::optional<at::Tensor>& temperature_rows_in,
                       const std::optional<at::Tensor>& cut_source_in, const std::optional<at::Tensor>& cut_index_in,
                       const at::Tensor& seed, const at::Tensor& offset, bool seed_per_row) {
  TORCH_CHECK(logits_in.dim() == 2, "logits must be [B, V], got shape ", logits_in.sizes());
  const at::Device device = logits_in.device();
  check_on_device(logits_in, "logits", device);
  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor logits = unit_stride_vocab(logits_in);
  const LogitDtype dtype = logit_dtype(logits, "logits");
  const int64_t batch = logits.size(0);
  const int64_t vocab = logits.size(1);
  TORCH_CHECK(vocab >= 1, "logits has an empty vocabulary dimension");
  const float temperature = checked_temperature(temperature_in);
  const at::Tensor temperature_rows = optional_row_tensor(temperature_rows_in, "temperature_rows", at::kFloat, batch,
                                                          device);
  check_row_tensor(seed, "seed", batch, device);
  check_row_tensor(offset, "offset", batch, device);
  at::Tensor cut_source, cut_index;
  if ((temperature > 0.0f || temperature_rows.defined()) && cut_source_in.has_value()) {
    cut_source = cut_tensor(cut_source_in, "cut_source", {batch}, device);
    cut_index = cut_tensor(cut_index_in, "cut_index", {batch}, device);
  }

  at::Tensor tokens = at::empty({batch}, logits.options().dtype(at::kLong));
  if (batch == 0) return tokens;
  const int b = checked_int(batch, "batch size");
  const int v = checked_int(vocab, "vocabulary size");
  check_passes_setting();
  const size_t workspace_bytes = verify_workspace_bytes(b, 0, v, false);
  TORCH_CHECK(workspace_bytes > 0, "sample: sizes B=", batch, " V=", vocab, " exceed the kernels' grid limits");
  at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, logits.options().dtype(at::kByte));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const cudaError_t err = sample_launch(
      dtype, logits.data_ptr(), b, v, logits.stride(0), temperature,
      temperature_rows.defined() ? temperature_rows.data_ptr<float>() : nullptr,
      cut_source.defined() ? cut_source.data_ptr<int32_t>() : nullptr,
      cut_index.defined() ? cut_index.data_ptr<int32_t>() : nullptr, seed.data_ptr<int64_t>(), seed.stride(0),
      offset.data_ptr<int64_t>(), offset.stride(0), seed_per_row, tokens.data_ptr<int64_t>(), workspace.data_ptr(),
      workspace_bytes, stream);
  check_launch(err, "sample");
  return tokens;
}

}  // namespace
}  // namespace speculative_kernels

// The one TORCH_LIBRARY of the namespace; further op files (e.g. the KV-cache rollback kernel of issue 4, in its own
// .cu + binding) register with TORCH_LIBRARY_FRAGMENT(speculative_kernels_cuda, m) and TORCH_LIBRARY_IMPL.
TORCH_LIBRARY(speculative_kernels_cuda, m) {
  m.def(
      "verify(Tensor target_logits, Tensor? draft_logits, Tensor draft_tokens, float temperature, "
      "Tensor? temperature_rows, Tensor? target_cut_source, Tensor? target_cut_index, Tensor? draft_cut_source, "
      "Tensor? draft_cut_index, Tensor seed, Tensor offset, bool seed_per_row, Tensor? num_draft_tokens) "
      "-> (Tensor, Tensor)");
  m.def(
      "sample(Tensor logits, float temperature, Tensor? temperature_rows, Tensor? cut_source, Tensor? cut_index, "
      "Tensor seed, Tensor offset, bool seed_per_row) -> Tensor");
}

TORCH_LIBRARY_IMPL(speculative_kernels_cuda, CUDA, m) {
  m.impl("verify", &speculative_kernels::verify_cuda);
  m.impl("sample", &speculative_kernels::sample_cuda);
}

// `import speculative_kernels._C` (the prebuilt extension) runs the registrations above; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT,
                               "_C",
                               "speculative-kernels CUDA ops (torch.ops.speculative_kernels_cuda)",
                               -1,
                               nullptr,
                               nullptr,
                               nullptr,
                               nullptr,
                               nullptr};
  return PyModule_Create(&module);
}
