// The token entries of a key tile (kernels/common/token_mask.h) staged in shared memory by the sm80 kernels that step
// over key tiles (the forward and the dq kernel), copied with cp.async beside the tile's k and v.
#pragma once

#include "cpp/cuda/kernels/primitives/cp_async.h"
#include "cpp/cuda/kernels/primitives/shared_memory.h"

namespace te_jax::cuda::sm80 {

// Entry i of `stage` is key tile * kBlockN + i's; keys past Skv get zeros (the index range hides them from every row).
template <int kBlockN, int kThreads>
__device__ __forceinline__ void LoadKeyTokens(int2* stage, const int2* keys, int tile, int seqlen_kv, int tid) {
  for (int i = tid; i < kBlockN; i += kThreads) {
    const int key = tile * kBlockN + i;
    const bool valid = key < seqlen_kv;
    CpAsync8(SmemAddress(stage + i), keys + (valid ? key : 0), valid);
  }
}

}  // namespace te_jax::cuda::sm80
