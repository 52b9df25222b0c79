// The CUDA backend's entry points, shared by the FFI handlers and the legacy custom calls: validate, then run the engine
// the lowering chose (params.engine): te_jax's kernels (find the compiled module for the configuration, launch on the
// caller's stream) or cuDNN's graphs (cpp/cuda/cudnn/). No synchronisation; errors are launch errors only (run-time
// length errors are reported in-kernel as NaN outputs, see kernels/common/block_range.h).
#pragma once

#include <cuda.h>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "cpp/cuda/kernel_registry.h"

namespace te_jax::cuda {

Status AttentionForward(const AttentionParams& params, const ForwardBuffers& buffers, CUstream stream);
// Bytes of ForwardBuffers::workspace and BackwardBuffers::workspace the call needs (te_jax's kernels: none for the
// forward, the dq accumulator of the default backward).
int64_t ForwardWorkspaceBytes(const AttentionParams& params);
int64_t BackwardWorkspaceBytes(const AttentionParams& params);

Status AttentionBackward(const AttentionParams& params, const BackwardBuffers& buffers, CUstream stream);

// Lowering-time preparation of the chosen engine for the current device: te_jax's kernels are compiled (or found in
// the disk cache) and loaded; cuDNN's graph is built (report.origin "cudnn").
Status Prepare(const AttentionParams& params, Direction direction, JitReport* report);

}  // namespace te_jax::cuda
