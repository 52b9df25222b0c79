// NaN and inf in a shared-memory tile. A tile product adds 0 * NaN = NaN to every row, also to the rows whose
// probability for that key is 0 because they do not see it; keys a row does not see must never affect it. Only tiles
// that straddle a row's range edge hold such keys, so only they are scanned (one pass over the tile in shared memory,
// about a hundredth of the tile's products), and a tile with a non-finite value (rare: only non-finite inputs) takes
// the slow path: the rows that see the value are poisoned directly and the product runs on the tile with the value
// zeroed.
#pragma once

#include "cpp/cuda/kernels/primitives/element.h"
#include "cpp/cuda/kernels/primitives/fp8_tile.h"
#include "cpp/cuda/kernels/primitives/padded_tile.h"

namespace te_jax::cuda {

// The scans below reach elements through the tile's At(row, col) (PaddedTile's padded rows, XorSwizzledTile's permuted
// chunks); a 16-byte chunk (8 columns from a multiple of 8) is stored whole in both. Element is the type of the values
// the tile holds: its 16-bit columns are byte pairs of an FP8 tile (primitives/fp8_tile.h), whose every byte is tested.

// Element (row, col) of a tile of Element, in the low bits.
template <typename Element, typename Tile>
__device__ __forceinline__ uint32_t ElementAt(const Tile& tile, int row, int col) {
  if constexpr (Element::kBytes == 1) return reinterpret_cast<const uint8_t*>(tile.At(row, col >> 1))[col & 1];
  return *tile.At(row, col);
}

// Whether any element of the tile (padding included: the loader zero-fills it) is inf or NaN; every thread of the CTA
// calls it between barriers, and each looks at its share of 16-byte chunks.
template <typename Element, int kThreads, typename Tile>
__device__ __forceinline__ bool ThreadSeesNonFinite(const Tile& tile, int tid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;
  bool any = false;
  for (int c = tid; c < Tile::kRows * kChunksPerRow; c += kThreads) {
    const uint4 chunk = *reinterpret_cast<const uint4*>(tile.At(c / kChunksPerRow, c % kChunksPerRow * 8));
    any |= WordHasNonFinite<Element>(chunk.x) || WordHasNonFinite<Element>(chunk.y) ||
           WordHasNonFinite<Element>(chunk.z) || WordHasNonFinite<Element>(chunk.w);
  }
  return any;
}

// Replaces every inf and NaN of the tile by 0 (each thread its share; a barrier must follow before the tile is read).
template <typename Element, int kThreads, typename Tile>
__device__ __forceinline__ void ZeroNonFinite(const Tile& tile, int tid) {
  constexpr int kWords = Tile::kCols / 2;  // a word: two 16-bit columns, 4-byte aligned in both tiles
  for (int e = tid; e < Tile::kRows * kWords; e += kThreads) {
    uint32_t& w = *reinterpret_cast<uint32_t*>(tile.At(e / kWords, e % kWords * 2));
    if (WordHasNonFinite<Element>(w)) w = WordWithoutNonFinite<Element>(w);
  }
}

// Sets o to NaN in the columns where a key the thread's rows see holds a non-finite value (IEEE would give inf or NaN
// there; the product of the zeroed tile then adds only the finite rest). o holds kMT 16-row m tiles in the m16n8
// accumulator layout (columns as FragmentColumn says); ranges[16 mt + row] is the visible key range of the m tile's row; the tile's row 0 is key n0, and
// the warp multiplies keys [key_begin, key_end) of it. sees(16 mt + row, key) says whether the row sees a key of its
// range (false where packed sequences' tokens hide it).
template <typename Element, int kMT, int kN8, typename VTile, typename Sees>
__device__ __forceinline__ void PoisonColumnsOfNonFiniteValues(float (&o)[kMT][kN8][4], const int2* ranges,
                                                               const VTile& v_tile, int n0, int key_begin,
                                                               int key_end, int g, int t, const Sees& sees) {
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int2 keys = ranges[mt * 16 + g + 8 * r];
      const int first = keys.x > key_begin ? keys.x : key_begin;
      const int last = keys.y < key_end ? keys.y : key_end;
#pragma unroll 1
      for (int key = first; key < last; ++key) {
        if (!sees(mt * 16 + g + 8 * r, key)) continue;
#pragma unroll
        for (int j = 0; j < kN8; ++j)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const uint32_t x = ElementAt<Element>(v_tile, key - n0, FragmentColumn<Element>(j, 2 * t + c));
            if (IsNonFinite<Element>(x)) o[mt][j][2 * r + c] = __int_as_float(0x7fffffff);
          }
      }
    }
  }
}

}  // namespace te_jax::cuda
