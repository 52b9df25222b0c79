// The run-time length check of engines that trust their lengths (cuDNN reads seq_len_q / seq_len_kv as they come), so
// that every engine keeps te_jax's contract for traced lengths outside [0, S]: nothing is read out of bounds (the
// engine sees clamped lengths) and every output of that batch entry is NaN (as the sm80 kernels do in-kernel,
// kernels/sm80/block_range.h).
#pragma once

#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

// One thread per batch entry (any grid that covers the batch).
__device__ __forceinline__ void GuardLengths(const LengthGuardArgs& a) {
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < a.batch; b += gridDim.x * blockDim.x) {
    const int q = a.q_seqlens[b];
    const int kv = a.kv_seqlens[b];
    a.guarded[b] = q < 0 ? 0 : (q > a.seqlen_q ? a.seqlen_q : q);
    a.guarded[a.batch + b] = kv < 0 ? 0 : (kv > a.seqlen_kv ? a.seqlen_kv : kv);
    a.guarded[2 * a.batch + b] = q < 0 || q > a.seqlen_q || kv < 0 || kv > a.seqlen_kv;
  }
}

// Grid (x: any, y: batch, z: output). A block of a valid batch entry returns at once, so the cost when every length is
// valid is one small launch.
__device__ __forceinline__ void PoisonInvalidBatches(const LengthGuardArgs& a) {
  const int b = blockIdx.y;
  const int o = blockIdx.z;
  if (o >= a.num_outputs || !a.guarded[2 * a.batch + b]) return;
  const int64_t words = a.output_batch_bytes[o] / 4;
  uint32_t* base = static_cast<uint32_t*>(a.outputs[o]) + b * words;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < words;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    base[i] = 0x7FFF7FFFu;  // NaN as float32, and as two bfloat16 or float16
  }
}

}  // namespace te_jax::cuda
