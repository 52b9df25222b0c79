// How a decode-shaped call (kernels/decode/tile_size.h) is laid out on the GPU: which of the two decode kernels, how
// the query heads and positions of a K/V head are packed into CTA tiles, and into how many splits the keys are cut so
// the CTAs fill the GPU once. Host-only; the kernels read the result from DecodeArgs.
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"

namespace te_jax::cuda {

// Whether te_jax's CUDA forward of these params takes the decode kernels (few query positions: kMaxDecodeSeqlenQ, cpp/core/limits.h).
bool UsesDecodeKernels(const AttentionParams& p);

struct DecodeGeometry {
  int kernel = 0;  // entry point of the decode module (kernels/decode/tile_size.h): 0, 1 or kShallowKernel
  int heads_per_block = 1;
  int positions_per_block = 1;
  int head_blocks = 1;
  int row_blocks = 1;
  int splits = 1;
  int tiles_per_split = 1;
  int64_t ctas_per_split = 0;  // batch x K/V heads x row blocks
};

// The decode module's deep-ring entry point for a call: 0 (one 16-row tile) when a K/V head's query heads x positions
// fit in 16 rows, else 1 (four). DecodeGeometryFor may take the shallow ring's one-row-tile kernel instead.
int DecodeKernelFor(const AttentionParams& p);

// How many CTAs of a decode kernel the GPU runs at once (SMs x CTAs per SM): of the deep ring's kernel the call takes
// (DecodeKernelFor) and of the shallow ring's.
struct DecodeSlots {
  int64_t deep = 0;
  int64_t shallow = 0;
};

// A one-row-tile call whose CTAs fit in one wave of the shallow ring's slots takes the shallow ring; the keys are split
// so the CTAs fill whole waves of the kernel taken's slots.
DecodeGeometry DecodeGeometryFor(const AttentionParams& p, DecodeSlots slots);

// The split partials' workspace (float out and lse per split), for the most slots any GPU has (so it follows from the
// params alone, as the lowering needs); 0 when the call does not take the decode kernels.
int64_t DecodeWorkspaceBytes(const AttentionParams& p);

// DecodeGeometryFor on a GPU of `multiprocessors` SMs with `smem_per_multiprocessor` bytes of shared memory each, the
// decode module's entry points taking smem_bytes[0 .. count) (LoadedModule's; a module without the shallow ring's
// entry point has count <= kShallowKernel). With `registers` (LoadedModule's, per entry point) and the SM's register
// file, an SM's CTAs are also bounded by their registers: an FP8 KV cache's half-size stages fit more CTAs than its
// registers do (d 128, shallow ring: 5 by shared memory, 3 by 158 registers a thread).
DecodeGeometry DecodeGeometryOnGpu(const AttentionParams& p, const int* smem_bytes, int count, int multiprocessors,
                                   int smem_per_multiprocessor, const int* registers = nullptr,
                                   int registers_per_multiprocessor = 0);

}  // namespace te_jax::cuda
