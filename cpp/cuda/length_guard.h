// Host side of the length guard (kernels/common/length_guard.cuh) for engines that trust their run-time lengths: run
// GuardLengths before the engine (and hand it the clamped lengths), EnforceLengthContract after it.
#pragma once

#include <cuda.h>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"

namespace te_jax::cuda {

// Lowering time: compiles (or finds in the disk cache) and loads the guard's module for the current device, so an
// execution never waits for NVRTC.
Status PrepareLengthGuard();

// Bytes of workspace the guard's clamped lengths and flags take (rounded up to 256 so what follows stays aligned).
int64_t LengthGuardBytes(const AttentionParams& params);

// Writes clamped copies of the lengths to guarded[0, B) (q) and guarded[B, 2B) (kv) and the invalid flags after them.
Status GuardLengths(const AttentionParams& params, const int32_t* q_seqlens, const int32_t* kv_seqlens,
                    int32_t* guarded, CUstream stream);

// After the engine: te_jax's values on the rows and keys the (guarded) lengths cut, NaN on invalid batch entries.
Status EnforceLengthContract(const AttentionParams& params, const int32_t* guarded, const ForwardBuffers& buffers,
                             CUstream stream);
Status EnforceLengthContract(const AttentionParams& params, const int32_t* guarded, const BackwardBuffers& buffers,
                             CUstream stream);

}  // namespace te_jax::cuda
