// How a decode-shaped call (kernels/decode/tile_size.h) is laid out on the GPU: which of the two decode kernels, how
// the query heads and positions of a K/V head are packed into CTA tiles, and into how many splits the keys are cut so
// the CTAs fill the GPU once. Host-only; the kernels read the result from DecodeArgs.
#pragma once

#include <cstdint>

#include "cpp/attention_params.h"

namespace te_jax::cuda {

// Whether te_jax's CUDA forward of these params takes the decode kernels (few query positions: kMaxSeqlenQ).
bool UsesDecodeKernels(const AttentionParams& p);

struct DecodeGeometry {
  int kernel = 0;  // entry point of the decode module: 0 (one 16-row tile) or 1 (four)
  int heads_per_block = 1;
  int positions_per_block = 1;
  int head_blocks = 1;
  int row_blocks = 1;
  int splits = 1;
  int tiles_per_split = 1;
  int64_t ctas_per_split = 0;  // batch x K/V heads x row blocks
};

// The decode module's entry point a call takes: 0 (one 16-row tile) when a K/V head's query heads x positions fit in
// 16 rows, else 1 (four).
int DecodeKernelFor(const AttentionParams& p);

// `slots`: how many CTAs of the call's decode kernel the GPU runs at once (SMs x CTAs per SM); splits fill them once.
DecodeGeometry DecodeGeometryFor(const AttentionParams& p, int64_t slots);

// The split partials' workspace (float out and lse per split), for the most slots any GPU has (so it follows from the
// params alone, as the lowering needs); 0 when the call does not take the decode kernels.
int64_t DecodeWorkspaceBytes(const AttentionParams& p);

// The slots of the current device for a decode kernel of `smem_bytes` shared memory, at most the bound above.
int64_t DecodeSlots(int multiprocessors, int smem_per_multiprocessor, int smem_bytes);

}  // namespace te_jax::cuda
