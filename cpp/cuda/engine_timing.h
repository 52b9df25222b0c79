// Measures one engine on this GPU at lowering time, for engine="auto" (te_jax/engine.py): the call `params` describes
// (its engine, its direction) runs on scratch buffers of its shapes, on a private stream of the current device, and the
// time per call is returned. The data is a finite constant: neither engine's speed depends on values.
#pragma once

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "cpp/cuda/kernel_config.h"

namespace te_jax::cuda {

// Milliseconds per call: the best of a few back-to-back batches, after a warm-up. Prepares (compiles or builds) the
// engine's kernels first, so the first call's cost is not counted. Allocates and frees its own buffers.
Status TimeAttention(const AttentionParams& params, Direction direction, double* milliseconds);

// "NVIDIA H200" and the driver version, for the key of the measurements' disk cache.
Status DeviceDescription(std::string* name, int* driver_version);

}  // namespace te_jax::cuda
