#include "legacy/cpu_legacy_handlers.h"

#include <cstring>

#include "cpp/cpu/attention_cpu.h"
#include "legacy/flex_descriptor.h"
#include "legacy/legacy_buffers.h"
#include "legacy/legacy_failure.h"

namespace te_jax::legacy {
namespace {

template <int kNumOutputs, typename OutputBytes, typename Run>
void RunLegacyCpu(const char* target, void* out, const char* opaque, size_t opaque_len, OutputBytes output_bytes,
                  Run run) {
  AttentionParams params;
  Status status = UnpackOpaque(opaque, opaque_len, &params);
  if (!status.ok()) {
    RecordLegacyFailure(target, status);  // without params the output sizes are unknown: nothing can be poisoned
    return;
  }
  void* const* outputs = static_cast<void* const*>(out);
  status = run(params, outputs);
  if (status.ok()) return;
  size_t bytes[kNumOutputs];
  output_bytes(params, bytes);
  for (int i = 0; i < kNumOutputs; ++i) {
    if (bytes[i] > 0) std::memset(outputs[i], 0xFF, bytes[i]);  // a zero-size output may have no address
  }
  RecordLegacyFailure(target, status);
}

}  // namespace
}  // namespace te_jax::legacy

extern "C" void TeJaxLegacyAttentionForwardCpu(void* out, const void** in, const char* opaque, size_t opaque_len,
                                               XlaCustomCallStatus*) {
  using namespace te_jax;
  legacy::RunLegacyCpu<legacy::kForwardOutputs>(
      "te_jax_attention_forward_cpu_legacy", out, opaque, opaque_len, legacy::ForwardOutputBytes,
      [&](const AttentionParams& params, void* const* outputs) {
        return cpu::AttentionForward(params, legacy::ForwardBuffersFromLegacy(in, outputs, 0),
                                     cpu::DefaultTaskScheduler());
      });
}

extern "C" void TeJaxLegacyAttentionBackwardCpu(void* out, const void** in, const char* opaque, size_t opaque_len,
                                                XlaCustomCallStatus*) {
  using namespace te_jax;
  legacy::RunLegacyCpu<legacy::kBackwardOutputs>(
      "te_jax_attention_backward_cpu_legacy", out, opaque, opaque_len, legacy::BackwardOutputBytes,
      [&](const AttentionParams& params, void* const* outputs) {
        const BackwardBuffers buffers =
            legacy::BackwardBuffersFromLegacy(in, outputs, cpu::BackwardWorkspaceBytes(params));
        const Status status = cpu::AttentionBackward(params, buffers, cpu::DefaultTaskScheduler());
        if (!status.ok()) {
          legacy::PoisonCaptureGradients(params, buffers,
                                         [](void* at, size_t bytes) { std::memset(at, 0xFF, bytes); });
        }
        return status;
      });
}
