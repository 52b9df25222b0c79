// Warp-level GEMM loops of the sm80 family over PaddedTile operands, built from mma.h's m16n8k16 products. A warp owns
// kMT m tiles of 16 rows; every B fragment read from shared memory feeds kMT mma pairs, which is what bounds the
// shared-memory traffic per mma (the kernels' main cost).
#pragma once

#include "cpp/cuda/kernels/primitives/fragment.h"
#include "cpp/cuda/kernels/primitives/padded_tile.h"

namespace te_jax::cuda {

template <int kMT, int kN8>
__device__ __forceinline__ void ZeroFragments(float (&acc)[kMT][kN8][4]) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int j = 0; j < kN8; ++j) acc[mt][j][0] = acc[mt][j][1] = acc[mt][j][2] = acc[mt][j][3] = 0.0f;
}

// acc[mt] (16 x kN) += A B^T over k in [0, kK): A's m tile mt is rows a_row + 16 mt of a row-major tile, B is rows
// [0, kN) of a tile stored [n][k] (k and q^T, v and dout^T, ...).
template <typename Element, int kMT, int kK, int kN, typename ATile, typename BTile>
__device__ __forceinline__ void WarpGemmABt(float (&acc)[kMT][kN / 8][4], ATile a_tile, int a_row,
                                            BTile b_tile, int lane) {
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kMT][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) a_tile.LoadA(a_row + 16 * mt, kk * 16, lane, a[mt]);
#pragma unroll
    for (int nn = 0; nn < kN / 16; ++nn) {
      uint32_t bb[4];
      b_tile.LoadBNK(nn * 16, kk * 16, lane, bb);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma16816<Element>(acc[mt][2 * nn], a[mt], bb[0], bb[1]);
        Mma16816<Element>(acc[mt][2 * nn + 1], a[mt], bb[2], bb[3]);
      }
    }
  }
}

// acc[mt] (16 x kN) += a[mt] (16 x 16, in registers) B, B the 16 x kN block at (k0, n0) of a tile stored [k][n]. Column
// blocks at or past n_end (the padded head dim, when a CTA owns a slice of the columns) are skipped.
template <typename Element, int kMT, int kN, typename BTile>
__device__ __forceinline__ void WarpMmaRegA(float (&acc)[kMT][kN / 8][4], const uint32_t (&a)[kMT][4], BTile b_tile,
                                            int k0, int n0, int n_end, int lane) {
#pragma unroll
  for (int nn = 0; nn < kN / 16; ++nn) {
    if (n0 + nn * 16 < n_end) {
      uint32_t bb[4];
      b_tile.LoadBKN(k0, n0 + nn * 16, lane, bb);
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        Mma16816<Element>(acc[mt][2 * nn], a[mt], bb[0], bb[1]);
        Mma16816<Element>(acc[mt][2 * nn + 1], a[mt], bb[2], bb[3]);
      }
    }
  }
}

}  // namespace te_jax::cuda
