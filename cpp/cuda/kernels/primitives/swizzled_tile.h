// The shared-memory layout of the sm90 family's tiles: what a TMA copy with the 128-byte swizzle writes and what wgmma
// reads through its descriptors. A [kRows x kCols] tile of 16-bit elements (kCols a multiple of 64) is stored as
// kCols / 64 column blocks of kRows rows x 128 bytes; within a block, the 16-byte chunk c of row r sits at chunk
// c ^ (r % 8). The swizzle is a function of the address bits, so every block starts on a 1024-byte boundary (8 rows).
#pragma once

#include "cpp/cuda/kernels/primitives/wgmma.h"

namespace te_jax::cuda {

template <int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0 && kRows % 8 == 0, "whole 64-column blocks of whole 8-row swizzle atoms");
  static constexpr int kTileRows = kRows;
  static constexpr int kBlockBytes = kRows * 128;  // one 64-column block
  static constexpr int kBytes = kRows * kCols * 2;

  uint32_t base;  // shared-window address, 1024-byte aligned

  // The operand of a K-major product (rows = M or N, columns = K), k16 step kk, starting at row `row0` (a multiple of
  // 8): each row's 16 k values are 32 bytes inside its 128-byte line; 8-row groups are 1024 bytes apart (the stride
  // byte offset); the leading byte offset is unused with this swizzle.
  __device__ __forceinline__ uint64_t KMajor(int row0, int kk) const {
    return AdvanceDescriptor(MatrixDescriptor(base + row0 * 128, 16, 1024), (kk / 4) * kBlockBytes + (kk % 4) * 32);
  }

  // An operand whose K runs along the rows (B of p v: K = keys, N = columns; A of dq = ds k from ds^T): k16 step kk,
  // M or N from column `col0` (a multiple of 64, or of 32 for a 32-wide product: like KMajor's k steps, an offset
  // inside the 128-byte line, which the swizzle, a function of the address, follows). M or N steps across 64-column
  // blocks by the leading byte offset, K across 8-row groups by the stride byte offset.
  __device__ __forceinline__ uint64_t MNMajor(int kk, int col0) const {
    return AdvanceDescriptor(MatrixDescriptor(base, kBlockBytes, 1024),
                             (col0 / 64) * kBlockBytes + (col0 % 64) * 2 + kk * 16 * 128);
  }

  // The address of element (row, col), for the rare scalar reads.
  __device__ __forceinline__ uint32_t Address(int row, int col) const {
    return base + (col / 64) * kBlockBytes + row * 128 + ((((col % 64) / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
  }
};

}  // namespace te_jax::cuda
