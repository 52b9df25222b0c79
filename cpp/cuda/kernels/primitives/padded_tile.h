// A [kRows x kCols] tile of 16-bit elements in shared memory, rows padded by 16 bytes so the 8 row addresses of an
// ldmatrix land in 8 different bank groups (row pitch an odd multiple of 16 bytes). kCols is the head dim padded to
// 16; the padding columns and rows past the valid length are zero-filled by the loader, so they add nothing.
#pragma once

#include "cpp/cuda/kernels/primitives/async_load_rows.h"
#include "cpp/cuda/kernels/primitives/cp_async.h"
#include "cpp/cuda/kernels/primitives/padded_tile_size.h"

namespace te_jax::cuda {

template <int kRows_, int kCols_>
struct PaddedTile {
  static constexpr int kRows = kRows_;
  static constexpr int kCols = kCols_;
  static constexpr int kPitch = kCols + 8;  // elements
  static constexpr int kBytes = kRows * kPitch * 2;
  static_assert(kCols % 16 == 0, "tile columns are padded to the mma k extent");
  static_assert(kBytes == PaddedTileBytes(kRows, kCols), "padded_tile_size.h and the tile disagree");

  uint16_t* data;

  // Byte offset of (row, col) from the tile's start.
  static __device__ __forceinline__ uint32_t Offset(int row, int col) {
    return static_cast<uint32_t>(row * kPitch + col) * 2u;
  }

  // Shared-window address of (row, col), in 32-bit arithmetic on the converted base (a 64-bit generic add + convert per
  // access cost ~4 integer instructions per ldmatrix and ~30 registers of addresses).
  __device__ __forceinline__ uint32_t Address(int row, int col) const { return SmemAddress(data) + Offset(row, col); }

  // Element (row, col), for the scalar scans of nonfinite_tile.h.
  __device__ __forceinline__ uint16_t* At(int row, int col) const { return data + (row * kPitch + col); }

  // Rows any step apart are kPitch elements a row apart.
  static constexpr bool LinearRowStep(int /*step*/) { return true; }

  // AsyncLoadRows (async_load_rows.h) into this tile.
  template <int kThreads>
  __device__ __forceinline__ void AsyncLoad(const uint16_t* base, int64_t row_stride, int row0, int valid_rows,
                                            int cols, int tid) const {
    AsyncLoadRows<kThreads>(*this, base, row_stride, row0, valid_rows, cols, tid);
  }

  // The fragment loaders add the lane's part of the address and the fragment's (row, col) as separate terms, so a
  // compile-time (row, col) becomes the ldmatrix immediate.
  // A fragment (16 x 16) at (row, col) of a row-major tile: matrices (r0-7,c0-7) (r8-15,c0-7) (r0-7,c8-15) (r8-15,c8-15).
  __device__ __forceinline__ void LoadA(int row, int col, int lane, uint32_t (&a)[4]) const {
    LdMatrixX4(SmemAddress(data) + Offset(lane & 15, (lane >> 4) * 8) + Offset(row, col), a);
  }

  // B fragments of two n8 tiles (n 0..15) and k 0..15 from a tile stored [n][k]: b[0], b[1] for n 0..7 and b[2], b[3]
  // for n 8..15.
  __device__ __forceinline__ void LoadBNK(int n, int k, int lane, uint32_t (&b)[4]) const {
    LdMatrixX4(SmemAddress(data) + Offset((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8) + Offset(n, k), b);
  }

  // An A fragment (16 x 16, m x k) at (m, k) from a tile stored [k][m] (ldmatrix.trans): the matrices (m0-7, k0-7)
  // (m8-15, k0-7) (m0-7, k8-15) (m8-15, k8-15) are stored rows k, columns m.
  __device__ __forceinline__ void LoadATrans(int m, int k, int lane, uint32_t (&a)[4]) const {
    LdMatrixX4Trans(SmemAddress(data) + Offset((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8) + Offset(k, m), a);
  }

  // Stores two adjacent 16-bit elements (packed, low half at col) at (row, col); col even.
  __device__ __forceinline__ void StorePair(int row, int col, uint32_t packed) const {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(SmemAddress(data) + Offset(row, col)), "r"(packed) : "memory");
  }

  // The same two n8 B tiles from a tile stored [k][n] (ldmatrix.trans).
  __device__ __forceinline__ void LoadBKN(int k, int n, int lane, uint32_t (&b)[4]) const {
    LdMatrixX4Trans(SmemAddress(data) + Offset((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8) + Offset(k, n), b);
  }

  // The 8 x 8 matrices at rows row..row+7 and row+8..row+15 of the 8 columns from col, plain or transposed (the FP8
  // tiles' fragments, fp8_tile.h).
  __device__ __forceinline__ void LoadRows16(int row, int col, int lane, uint32_t (&r)[2]) const {
    LdMatrixX2(SmemAddress(data) + Offset(lane & 15, 0) + Offset(row, col), r);
  }
  __device__ __forceinline__ void LoadRows16Trans(int row, int col, int lane, uint32_t (&r)[2]) const {
    LdMatrixX2Trans(SmemAddress(data) + Offset(lane & 15, 0) + Offset(row, col), r);
  }
};

}  // namespace te_jax::cuda
