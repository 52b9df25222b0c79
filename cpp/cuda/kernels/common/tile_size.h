// The tuning table of what both kernel families share in the backward: where the default backward accumulates dq in
// float, the layout of that accumulator, and the row kernels around the dk/dv kernels (backward_row_kernels.cuh). Host
// and device compile it.
#pragma once

#include "cpp/core/host_device.h"
#include "cpp/cuda/kernels/primitives/padded_tile_size.h"

namespace te_jax::cuda {

// The dk/dv kernels hold dk and dv in registers, in two column slices (each recomputing s and dp) where the padded
// head dims sum to more than 256.
TE_JAX_HOST_DEVICE constexpr int BackwardDkDvSlices(int d, int dv) {
  return PadHeadDim(d) + PadHeadDim(dv) <= 256 ? 1 : 2;
}

// Whether the default backward (deterministic=False) accumulates dq in the dk/dv kernel: with one slice. With two, the
// fused kernel measured slower than the three-kernel one (H200, d = 256, s >= 2k: forward + backward 0.34-0.36x cuDNN
// against 0.35-0.39x, sm80 kernels).
TE_JAX_HOST_DEVICE constexpr bool BackwardAccumulatesDq(int d, int dv) { return BackwardDkDvSlices(d, dv) == 1; }

// The fast backward's float dq accumulator (the call's workspace): [B][H][slices][Sq rounded up to row_block][cols],
// cols = one dk/dv slice's dq columns. The rows x cols block one dk/dv step adds to is contiguous, so the sm90 kernel
// adds it with a single bulk reduction, and the rounding gives the last query tile's rows somewhere to go: row_block is
// a multiple of every step (sm80's 64 query rows, 32 with a bias; sm90's 64 or 128, sm90/tile_size.h).
// Within a row, column c is stored at c ^ 4 * (row & swizzle). Rows are a multiple of 128 bytes apart, so without it
// the 8 rows a warp's fragment store touches in the shared-memory copy of a block share their banks (8-way
// conflicts); 16-byte chunks stay contiguous.
inline constexpr int kDqAccumRowBlock = 128;  // row_block of every layout: a multiple of both families' steps

struct DqAccumLayout {
  int slices;
  int cols;       // floats per row
  int row_block;  // Sq is rounded up to a multiple of it
  int swizzle;    // a power of two minus one: the row bits XORed into the 16-byte chunk index
};

TE_JAX_HOST_DEVICE constexpr DqAccumLayout BackwardDqAccumLayout(int d, int dv) {
  const int slices = BackwardDkDvSlices(d, dv);
  const int cols = (PadHeadDim(d) / 16 + slices - 1) / slices * 16;
  const int chunks = cols / 4;  // a multiple of 4
  return {slices, cols, kDqAccumRowBlock, chunks % 8 == 0 ? 7 : 3};
}

// Threads per block of the backward's row-wise kernels (preprocess, dq conversion; one warp per query row).
inline constexpr int kRowKernelThreads = 256;

}  // namespace te_jax::cuda
