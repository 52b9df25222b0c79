#include "legacy/cuda_legacy_handlers.h"

#include "cpp/cuda/attention_cuda.h"
#include "cpp/cuda/dynamic_libs.h"
#include "legacy/flex_descriptor.h"
#include "legacy/legacy_buffers.h"
#include "legacy/legacy_failure.h"

namespace te_jax::legacy {
namespace {

// run(params, inputs, outputs); poison_more(params, outputs, fill) fills a failed call's outputs past the fixed ones.
template <int kNumInputs, int kNumOutputs, typename OutputBytes, typename Run, typename PoisonMore>
void RunLegacyCuda(const char* target, CUstream stream, void** buffers, const char* opaque, size_t opaque_len,
                   OutputBytes output_bytes, Run run, PoisonMore poison_more) {
  AttentionParams params;
  Status status = UnpackOpaque(opaque, opaque_len, &params);
  if (!status.ok()) {
    RecordLegacyFailure(target, status);  // without params the output sizes are unknown: nothing can be poisoned
    return;
  }
  // The mods' captures follow the fixed operands (legacy_buffers.h), so the results start after them.
  const void* const* inputs = buffers;
  void* const* outputs = buffers + kNumInputs + params.flex.num_captures();
  status = run(params, inputs, outputs);
  if (status.ok()) return;
  size_t bytes[kNumOutputs];
  output_bytes(params, bytes);
  const cuda::DriverApi* driver = nullptr;
  if (cuda::GetDriver(&driver).ok()) {
    const auto fill = [&](void* at, size_t n) {
      driver->cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(at), 0xFF, n, stream);
    };
    for (int i = 0; i < kNumOutputs; ++i) {
      if (bytes[i] > 0) fill(outputs[i], bytes[i]);
    }
    poison_more(params, outputs, fill);
  }
  RecordLegacyFailure(target, status);
}

}  // namespace
}  // namespace te_jax::legacy

extern "C" void TeJaxLegacyAttentionForwardCuda(CUstream stream, void** buffers, const char* opaque, size_t opaque_len,
                                                XlaCustomCallStatus*) {
  using namespace te_jax;
  legacy::RunLegacyCuda<legacy::kForwardInputs, legacy::kForwardOutputs>(
      "te_jax_attention_forward_cuda_legacy", stream, buffers, opaque, opaque_len, legacy::ForwardOutputBytes,
      [&](const AttentionParams& params, const void* const* in, void* const* out) {
        return cuda::AttentionForward(params, legacy::ForwardBuffersFromLegacy(in, out, cuda::ForwardWorkspaceBytes(params)),
                                      stream);
      },
      [](const AttentionParams&, void* const*, auto) {});
}

extern "C" void TeJaxLegacyAttentionBackwardCuda(CUstream stream, void** buffers, const char* opaque,
                                                 size_t opaque_len, XlaCustomCallStatus*) {
  using namespace te_jax;
  legacy::RunLegacyCuda<legacy::kBackwardInputs, legacy::kBackwardOutputs>(
      "te_jax_attention_backward_cuda_legacy", stream, buffers, opaque, opaque_len, legacy::BackwardOutputBytes,
      [&](const AttentionParams& params, const void* const* in, void* const* out) {
        return cuda::AttentionBackward(
            params, legacy::BackwardBuffersFromLegacy(in, out, cuda::BackwardWorkspaceBytes(params)), stream);
      },
      [&](const AttentionParams& params, void* const* out, auto fill) {
        const BackwardBuffers b = legacy::BackwardBuffersFromLegacy(buffers, out, 0);
        legacy::PoisonCaptureGradients(params, b, fill);
      });
}
