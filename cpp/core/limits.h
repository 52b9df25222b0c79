// The limits every backend's validation (validate.h) and the kernels' host code share, so no backend-neutral header
// needs a kernel family's tables.
#pragma once

#include <cstdint>

namespace te_jax {

// The largest head dim each backend compiles for (head dims must also be multiples of 8).
inline constexpr int64_t kMaxHeadDim = 256;
// Window sizes beyond any sequence mean "unbounded" (-1 says so); the bound keeps them in the kernels' 32-bit range.
inline constexpr int64_t kMaxWindow = (int64_t{1} << 31) - 1;
// Batch and heads are CUDA grid dimensions (y and z are at most 65535).
inline constexpr int64_t kMaxCudaGridDim = 65535;
// A paged KV cache's page size: a multiple of kPageSizeMultiple up to kMaxPageSize (attention_params.h: page_size).
inline constexpr int64_t kPageSizeMultiple = 8;
inline constexpr int64_t kMaxPageSize = 256;

// Up to this many query positions the CUDA forward runs on the decode kernels (cpp/cuda/kernels/decode/), which also
// read a paged KV cache in place. Above it a call is better served by the prefill kernels: H200, bf16, b 8, h 32 / kv 8,
// d 128, 8k keys, 16 positions took 167-207 us on the decode kernels against 252 us for 17 positions on the sm90
// forward (which reads each K/V head once per query head); 32 positions would be two 64-row decode tiles per K/V head,
// each reading the K/V again (~330 us).
inline constexpr int64_t kMaxDecodeSeqlenQ = 16;

}  // namespace te_jax
