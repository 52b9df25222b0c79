// The cp.async copy of consecutive rows of a row-major global tensor into a shared-memory tile (PaddedTile or
// XorSwizzledTile: anything with kRows, kCols, kPitch, Address(row, col) and LinearRowStep(step)): the loader of every
// tile whose rows are one stride apart in global memory.
#pragma once

#include "cpp/cuda/kernels/primitives/cp_async.h"

namespace te_jax::cuda {

// Asynchronously copies rows [row0, row0 + Tile::kRows) of a row-major global tensor with `row_stride` elements
// between rows and `cols` valid columns (a multiple of 8) per row into `tile`; rows at or past `valid_rows` and columns
// past `cols` are zero-filled. Every thread of the CTA calls it.
template <int kThreads, typename Tile>
__device__ __forceinline__ void AsyncLoadRows(const Tile& tile, const uint16_t* base, int64_t row_stride, int row0,
                                              int valid_rows, int cols, int tid) {
  constexpr int kRows = Tile::kRows;
  constexpr int kChunksPerRow = Tile::kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  if constexpr (kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0) {
    // Each thread copies one column chunk of every (kThreads / kChunksPerRow)-th row. The source pointer advances by a
    // stride the compiler cannot see through (the empty asm), so it does not keep one 64-bit pointer per chunk live
    // across the whole kernel (that cost ~30 registers and spills in the main loops).
    constexpr int kRowStep = kThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow;
    const int col = (tid % kChunksPerRow) * 8;
    const bool col_ok = col < cols;
    int64_t step = kRowStep * row_stride;
    const uint16_t* src = base + static_cast<int64_t>(row0 + r0) * row_stride + col;
    const uint32_t dst = tile.Address(r0, col);
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const bool valid = col_ok && row0 + r0 + i * kRowStep < valid_rows;
      // Where rows kRowStep apart keep their layout (Tile::LinearRowStep), the chunk's address is an immediate.
      const uint32_t chunk_dst = Tile::LinearRowStep(kRowStep) ? dst + i * kRowStep * Tile::kPitch * 2
                                                                : tile.Address(r0 + i * kRowStep, col);
      CpAsync16(chunk_dst, valid ? src : base, valid);
      asm volatile("" : "+l"(step));
      src += step;
    }
  } else {
    // A fixed trip count (tid < kThreads), so the loop unrolls completely.
#pragma unroll
    for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
      const int c = tid + i * kThreads;
      if (kChunks % kThreads != 0 && c >= kChunks) break;
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = row0 + r < valid_rows && col < cols;
      const uint16_t* src = valid ? base + static_cast<int64_t>(row0 + r) * row_stride + col : base;
      CpAsync16(tile.Address(r, col), src, valid);
    }
  }
}

}  // namespace te_jax::cuda
