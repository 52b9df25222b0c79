// The CUDA backend's entry points, shared by the FFI handlers and the legacy custom calls: validate, find the compiled
// module for the configuration, launch on the caller's stream. No synchronisation; errors are launch errors only
// (run-time length errors are reported in-kernel as NaN outputs, see kernels/sm80/block_range.h).
#pragma once

#include <cuda.h>

#include "cpp/attention_params.h"
#include "cpp/cuda/kernel_registry.h"
#include "cpp/status.h"

namespace te_jax::cuda {

Status AttentionForward(const AttentionParams& params, const ForwardBuffers& buffers, CUstream stream);
// Bytes of BackwardBuffers::workspace the backward of `params` needs (0 when deterministic).
int64_t BackwardWorkspaceBytes(const AttentionParams& params);

Status AttentionBackward(const AttentionParams& params, const BackwardBuffers& buffers, CUstream stream);

// Lowering-time preparation: compiles (or finds in the disk cache) and loads the module of this configuration for
// the current device. `arch` empty: the current device's.
Status Prepare(const AttentionParams& params, Direction direction, JitReport* report);

}  // namespace te_jax::cuda
