// A [kRows x kCols] tile of 16-bit elements in shared memory, stored as kCols / 64 column blocks of kRows rows x 128
// bytes, each row's 16-byte chunks permuted within its block by XOR with row % 8: chunk c of row r sits at chunk
// (c % 8) ^ (r % 8) of the row's 128 bytes in block c / 8. That is the layout a TMA copy with the 128-byte swizzle
// writes (primitives/swizzled_tile.h, when the tile starts on a 1024-byte boundary), so cp.async and TMA fill the same tile.
// The same interface as PaddedTile (smem_tile.h), for tiles filled from global memory at full bandwidth.
//
// Why not PaddedTile's padding: its rows are 16 bytes longer than their data, so every other row starts 16 bytes off a
// 32-byte boundary, that row's 32-byte global sectors land across two 32-byte shared sectors, and cp.async asks the L2
// for such a sector twice. ncu on the decode kernel (H200): 1.5x the ideal L2 sectors on every cp.async, the
// duplicates a third of the L2's traffic at 91% of its throughput. Here a global sector (chunks 2j, 2j + 1) stays in
// one aligned shared sector (chunks 2j ^ s, 2j ^ s ^ 1), and the 8 rows of an ldmatrix matrix still read 8 different
// 16-byte bank groups (the XOR takes 8 values).
#pragma once

#include "cpp/cuda/kernels/primitives/async_load_rows.h"
#include "cpp/cuda/kernels/primitives/cp_async.h"

namespace te_jax::cuda {

template <int kRows_, int kCols_>
struct XorSwizzledTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kPitch = 64;  // elements from a row to the next within a column block
  static constexpr int kBlockBytes = kRows * 128;
  static constexpr int kBytes = kRows * kCols * 2;
  static_assert(kCols % 64 == 0, "rows are whole 128-byte groups of 8 chunks");

  uint16_t* data;

  // Byte offset of (row, col) from the tile's start.
  static __device__ __forceinline__ uint32_t Offset(int row, int col) {
    const int chunk = (col >> 3 & 7) ^ (row & 7);
    return static_cast<uint32_t>((col >> 6) * kBlockBytes + row * 128 + chunk * 16 + (col & 7) * 2);
  }

  __device__ __forceinline__ uint32_t Address(int row, int col) const { return SmemAddress(data) + Offset(row, col); }

  // Rows a multiple of 8 apart have the same swizzle, so they are kPitch elements a row apart (within a block).
  static constexpr bool LinearRowStep(int step) { return step % 8 == 0; }

  // AsyncLoadRows (async_load_rows.h) into this tile.
  template <int kThreads>
  __device__ __forceinline__ void AsyncLoad(const uint16_t* base, int64_t row_stride, int row0, int valid_rows,
                                            int cols, int tid) const {
    AsyncLoadRows<kThreads>(*this, base, row_stride, row0, valid_rows, cols, tid);
  }

  // Element (row, col), for the scalar scans of nonfinite_tile.h.
  __device__ __forceinline__ uint16_t* At(int row, int col) const { return data + Offset(row, col) / 2; }

  // The fragment loaders of PaddedTile, for rows that are multiples of 8 and columns that are multiples of 16.
  __device__ __forceinline__ void LoadA(int row, int col, int lane, uint32_t (&a)[4]) const {
    LdMatrixX4(Fragment(LaneAddress(lane & 15, lane >> 4), row, col), a);
  }

  __device__ __forceinline__ void LoadBNK(int n, int k, int lane, uint32_t (&b)[4]) const {
    LdMatrixX4(Fragment(LaneAddress((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1), n, k), b);
  }

  __device__ __forceinline__ void LoadATrans(int m, int k, int lane, uint32_t (&a)[4]) const {
    LdMatrixX4Trans(Fragment(LaneAddress((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1), k, m), a);
  }

  __device__ __forceinline__ void LoadBKN(int k, int n, int lane, uint32_t (&b)[4]) const {
    LdMatrixX4Trans(Fragment(LaneAddress((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4), k, n), b);
  }

  __device__ __forceinline__ void LoadRows16(int row, int col, int lane, uint32_t (&r)[2]) const {
    LdMatrixX2(Fragment(LaneAddress(lane & 15, 0), row, col), r);
  }

  __device__ __forceinline__ void LoadRows16Trans(int row, int col, int lane, uint32_t (&r)[2]) const {
    LdMatrixX2Trans(Fragment(LaneAddress(lane & 15, 0), row, col), r);
  }

 private:
  // The lane's 16-byte row of an 8 x 8 matrix at (0, 0): row lane_row, chunk lane_chunk (0 or 1) XOR the row's key.
  __device__ __forceinline__ uint32_t LaneAddress(int lane_row, int lane_chunk) const {
    return SmemAddress(data) + static_cast<uint32_t>(lane_row * 128 + (((lane_chunk ^ lane_row) & 7) << 4));
  }

  // The lane's row of the matrices at (row0, col0), row0 a multiple of 8 (the key stays the lane's), col0 of 8. The
  // column's chunk within its block XORs into the address's bits 4-6, which in the lane's address hold only its chunk
  // when the tile starts on a 128-byte line (the kernels static_assert their tiles' offsets and align their shared
  // memory): one LOP3 on one per-lane register, the rest an ldmatrix immediate.
  static __device__ __forceinline__ uint32_t Fragment(uint32_t lane_address, int row0, int col0) {
    return (lane_address ^ static_cast<uint32_t>((col0 >> 3 & 7) << 4)) +
           static_cast<uint32_t>(row0 * 128 + (col0 >> 6) * kBlockBytes);
  }
};

}  // namespace te_jax::cuda
