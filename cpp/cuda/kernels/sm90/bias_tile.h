// The additive logit bias in the sm90 family: a tile's block of the bias, rows [m0, m0 + kRows) (query
// positions) x columns [n0, n0 + kCols) (keys) of one (batch, head), copied by TMA into a ring stage beside the tile's
// k and v (the forward) or the step's tiles (the backward: the step's queries x the owned keys in the dk/dv kernel, the
// owned queries x the step's keys in the dq kernel), and read by the consumers element by element.
//
// The tensor map (cpp/cuda/tensor_maps.h) sees the operand as [B' H'][Sq'][Skv'], its own dims with the broadcast
// ones 1, so a box's coordinates are (key, query row or 0, b' H' + h'). TMA copies rows whose stride is a whole number
// of 16-byte chunks, so the family serves a bias whose key extent is one (KernelConfig::bias_fits_tma); the sm80
// family takes the rest, key-broadcast biases ([.., Sq, 1]) included. The tile is stored as the k and v tiles are
// (swizzled_tile.h): column blocks of 128-byte rows (64 16-bit or 32 float elements) with the 128-byte swizzle, so the
// 8 rows of a fragment's loads fall in 8 different bank groups. A query-broadcast bias ([.., 1, Skv], e.g. a key mask)
// stages one row, which every row reads.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/bias_element.h"
#include "cpp/cuda/kernels/primitives/pipeline.h"
#include "cpp/cuda/kernels/sm90/tile_size.h"

namespace te_jax::cuda::sm90 {

// Where a CTA's bias boxes are in the tensor map: the row coordinate of the CTA's first row (0 for a query-broadcast
// bias, whose box is one row) and the (batch, head) coordinate.
struct BiasBoxes {
  bool one_row;
  int row0;
  int plane;

  static __device__ __forceinline__ BiasBoxes Of(const BiasArgs& a, int num_heads, int b, int head, int m0) {
    const int heads = a.head_stride == 0 ? 1 : num_heads;
    return {a.query_stride == 0, a.query_stride == 0 ? 0 : m0,
            (a.batch_stride == 0 ? 0 : b) * heads + (a.head_stride == 0 ? 0 : head)};
  }
};

template <typename Bias, int kRows, int kCols>
struct BiasTile {
  using Element = BiasElementOf<Bias>;
  static constexpr int kSize = static_cast<int>(sizeof(typename Element::Storage));
  static constexpr int kBlockCols = 128 / kSize;  // the columns of one 128-byte swizzle block
  static constexpr int kBlockBytes = kRows * 128;
  static constexpr int kBytes = kRows * kCols * kSize;
  static_assert(kCols % kBlockCols == 0 && kRows % 8 == 0, "whole 128-byte blocks of whole 8-row swizzle atoms");
  static_assert(kBytes == BiasTileBytes(kRows, kCols, kSize), "tile_size.h and the bias tile disagree");

  uint32_t base;  // shared-window address, 1024-byte aligned

  // The producer thread: the tile at keys `n0`, in boxes of the tensor map's kBoxRows rows (one row for a
  // query-broadcast bias) per column block, counted on `full` with one arrival.
  template <int kBoxRows>
  __device__ __forceinline__ void Load(const void* map, uint32_t full, const BiasBoxes& boxes, int n0) const {
    static_assert(kRows % kBoxRows == 0, "whole boxes");
    StressDelay();
    MbarrierArriveExpectBytes(full, (boxes.one_row ? 1 : kRows) * kCols * kSize);
    const int boxes_per_block = boxes.one_row ? 1 : kRows / kBoxRows;
#pragma unroll
    for (int c = 0; c < kCols / kBlockCols; ++c) {
      for (int r = 0; r < boxes_per_block; ++r) {
        TmaLoad3d(base + c * kBlockBytes + r * kBoxRows * 128, map, full, n0 + c * kBlockCols,
                  boxes.row0 + r * kBoxRows, boxes.plane);
      }
    }
  }

  // The address of element (row, col): column block, row, then the swizzled 16-byte chunk.
  __device__ __forceinline__ uint32_t Address(int row, int col) const {
    const int byte = (col % kBlockCols) * kSize;
    return base + (col / kBlockCols) * kBlockBytes + row * 128 + (((byte / 16) ^ (row % 8)) * 16) + byte % 16;
  }

  // Elements (row, col) and (row, col + 1), col even: one 4- or 8-byte word of a 16-byte chunk.
  __device__ __forceinline__ float2 Pair(int row, int col) const { return Element::LoadSharedPair(Address(row, col)); }

  __device__ __forceinline__ float At(int row, int col) const { return Element::LoadShared(Address(row, col)); }
};

}  // namespace te_jax::cuda::sm90
