// FP8 tiles as f16 operands of mma.sync (the decode kernels' FP8 KV cache). A stage holds the raw bytes: a tile of
// rows x d FP8 values is, byte for byte, a 16-bit tile (PaddedTile, XorSwizzledTile) of rows x d / 2 byte pairs, so
// the 16-bit tiles' copies, swizzles and ldmatrix addressing serve it unchanged, and the bytes become f16 in registers
// (E4M3/E5M2::ToHalf2, exact). Fp8Tile has the 16-bit tiles' B-fragment loaders, so warp_gemm.h's loops run the
// products in f16 on it, with two conventions the caller keeps (g = lane / 4, t = lane % 4):
//   - B stored [n][k] (K in q k^T), LoadBNK: a plain ldmatrix gives lane (g, t) the bytes 4t..4t+3 of key g's 16-dim
//     chunk, so the fragment's logical k {2t, 2t+1, 2t+8, 2t+9} are the dims {4t, 4t+1, 4t+2, 4t+3}: the A operand
//     (q) must hold its columns in that order within every 16-column chunk (PermuteChunkWords).
//   - B stored [k][n] (V in p v), LoadBKN: a transposed ldmatrix gives lane (g, t) keys 2t, 2t+1 (and 2t+8, 2t+9) of
//     the dim pair 2g, 2g+1; two byte permutes regroup them into the fragment of dim 2g and the fragment of dim 2g + 1.
//     So the n8 accumulator block 2i holds the even dims of 16-dim chunk i and block 2i + 1 its odd dims
//     (FragmentColumn).
#pragma once

#include "cpp/cuda/kernels/primitives/element.h"
#include "cpp/cuda/kernels/primitives/mma.h"

namespace te_jax::cuda {

// The bytes of {a, b} (a's 0-3, b's 4-7) that `selector`'s nibbles name, lowest first.
__device__ __forceinline__ uint32_t BytePermute(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

// The column that n8 accumulator block j's column n (0..7) holds in a product whose B operand is a tile of Element:
// 8 j + n, or with FP8 (LoadBKN above) the even and odd dims of each 16-dim chunk.
template <typename Element>
__device__ __forceinline__ int FragmentColumn(int j, int n) {
  return Element::kBytes == 1 ? 16 * (j >> 1) + 2 * n + (j & 1) : 8 * j + n;
}

// The A operand's order of a 16-column chunk for FP8 B operands stored [n][k] (LoadBNK): its eight words (column
// pairs) in the order 0, 2, 4, 6, 1, 3, 5, 7, i.e. word u holds the dims 4u, 4u + 1 for u < 4 and 4u - 14, 4u - 13 after.
__device__ __forceinline__ int PermutedChunkWord(int u) { return u < 4 ? 2 * u : 2 * u - 7; }

template <typename Fp8, typename Tile>
struct Fp8Tile {
  static constexpr int kRows = Tile::kRows;
  static constexpr int kCols = 2 * Tile::kCols;  // FP8 values

  Tile tile;

  // The f16 B fragments of keys n..n+15 x dims k..k+15 (k a multiple of 16) of a tile stored [n][k]: b[0], b[1] for
  // n..n+7, b[2], b[3] for n+8..n+15, in the permuted k order above.
  __device__ __forceinline__ void LoadBNK(int n, int k, int lane, uint32_t (&b)[4]) const {
    uint32_t r[2];
    tile.LoadRows16(n, k / 2, lane, r);
    Fp8::ToHalf2(r[0], b[0], b[1]);
    Fp8::ToHalf2(r[1], b[2], b[3]);
  }

  // The f16 B fragments of keys k..k+15 x dims n..n+15 (n a multiple of 16) of a tile stored [k][n]: b[0], b[1] those
  // of the even dims n + 2g, b[2], b[3] those of the odd dims n + 2g + 1.
  __device__ __forceinline__ void LoadBKN(int k, int n, int lane, uint32_t (&b)[4]) const {
    uint32_t r[2];  // r[0]: bytes V[2t][2g], V[2t][2g+1], V[2t+1][2g], V[2t+1][2g+1]; r[1]: keys 2t+8, 2t+9
    tile.LoadRows16Trans(k, n / 2, lane, r);
    Fp8::ToHalf2(BytePermute(r[0], r[1], 0x6420u), b[0], b[1]);
    Fp8::ToHalf2(BytePermute(r[0], r[1], 0x7531u), b[2], b[3]);
  }
};

// The operand the products read from a K or V stage tile of Element: the tile itself (16-bit), or Fp8Tile over it.
template <typename Element, typename Tile, int kBytes = Element::kBytes>
struct KvOperand {
  using Type = Tile;
};
template <typename Element, typename Tile>
struct KvOperand<Element, Tile, 1> {
  using Type = Fp8Tile<Element, Tile>;
};

// The element type of the products with K/V of KvElement and q, out of Element: Element, or f16 for FP8.
template <typename Element, typename KvElement, int kBytes = KvElement::kBytes>
struct ProductElement {
  using Type = Element;
};
template <typename Element, typename KvElement>
struct ProductElement<Element, KvElement, 1> {
  using Type = Float16;
};

}  // namespace te_jax::cuda
