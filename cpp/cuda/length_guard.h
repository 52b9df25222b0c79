// Host side of the length guard (kernels/common/length_guard.cuh) for engines that trust their run-time lengths.
#pragma once

#include <cuda.h>

#include <initializer_list>
#include <utility>

#include "cpp/attention_params.h"
#include "cpp/status.h"

namespace te_jax::cuda {

// Bytes of workspace the guard's clamped lengths and flags take (rounded up to 256 so what follows stays aligned).
int64_t LengthGuardBytes(const AttentionParams& params);

// Writes clamped copies of the lengths to guarded[0, B) (q) and guarded[B, 2B) (kv) and the invalid flags after them.
Status GuardLengths(const AttentionParams& params, const int32_t* q_seqlens, const int32_t* kv_seqlens,
                    int32_t* guarded, CUstream stream);

// Fills with NaN every batch entry of each (batch-major tensor, bytes per batch entry) whose flag GuardLengths set.
Status PoisonInvalidBatches(const AttentionParams& params, const int32_t* guarded,
                            std::initializer_list<std::pair<void*, int64_t>> outputs, CUstream stream);

}  // namespace te_jax::cuda
