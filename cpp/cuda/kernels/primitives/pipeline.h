// The pieces of the sm90 family's producer/consumer pipelines: where the i-th tile of a ring sits, loading a whole tile
// into a stage with TMA (or ahead into L2), and a consumer warp handing a stage back.
#pragma once

#include "cpp/cuda/kernels/primitives/mbarrier.h"
#include "cpp/cuda/kernels/primitives/tma.h"

namespace te_jax::cuda {

// The i-th tile through a ring of kStages stages: its stage, and the parity of the phase of that stage's barriers it
// waits for (a producer waiting for the stage to be empty waits for the other parity).
template <int kStages>
__device__ __forceinline__ int StageOf(int i) {
  return i % kStages;
}
template <int kStages>
__device__ __forceinline__ uint32_t ParityOf(int i) {
  return static_cast<uint32_t>(i / kStages) & 1u;
}

// Copies a whole tile of one (batch, head), rows from `row`: each 64-column block in boxes of the tensor map's kBoxRows
// rows. The copies count their bytes on `full`, with one arrival; `extra_bytes` are those of the phase's other copies
// on `full` (BulkLoad), which the arrival expects too.
template <int kBoxRows, typename Tile>
__device__ __forceinline__ void LoadTile(Tile tile, const void* map, uint32_t full, int head, int row, int b,
                                         uint32_t extra_bytes = 0) {
  static_assert(Tile::kTileRows % kBoxRows == 0 && kBoxRows % 8 == 0, "whole boxes of whole swizzle atoms");
  StressDelay();
  MbarrierArriveExpectBytes(full, Tile::kBytes + extra_bytes);
#pragma unroll
  for (int c = 0; c < Tile::kBytes / Tile::kBlockBytes; ++c) {
#pragma unroll
    for (int r = 0; r < Tile::kTileRows / kBoxRows; ++r) {
      TmaLoad4d(tile.base + c * Tile::kBlockBytes + r * kBoxRows * 128, map, full, 64 * c, head, row + r * kBoxRows, b);
    }
  }
}

// Copies a whole tile in boxes of `box_rows` rows (the tensor map's; a multiple of 8 that divides the tile's rows, so
// at most 32 boxes) from rows anywhere in batch entry b of a 4-D map (a gather: the pages of a KV cache): lane r of
// the calling warp copies box r from row `row` (its own; a row past the tensor's end gives zeros, read from nothing),
// after lane 0 has armed `full` with the tile's bytes (one arrival, as LoadTile's). (One thread issuing a paged tile's
// boxes in a loop held its registers through the decode kernel's main loop, which then spilled at d 128.)
template <typename Tile>
__device__ __forceinline__ void LoadTileBoxes(Tile tile, const void* map, uint32_t full, int head, int row, int b,
                                              int box_rows, int lane) {
  if (lane == 0) {
    StressDelay();
    MbarrierArriveExpectBytes(full, Tile::kBytes);
  }
  __syncwarp();
  const int r = lane * box_rows;
  if (r < Tile::kTileRows) {
#pragma unroll
    for (int c = 0; c < Tile::kBytes / Tile::kBlockBytes; ++c) {
      TmaLoad4d(tile.base + c * Tile::kBlockBytes + r * 128, map, full, 64 * c, head, row, b);
    }
  }
}

// Brings the tile LoadTile would copy into L2 (TmaPrefetch4d), box by box.
template <int kBoxRows, typename Tile>
__device__ __forceinline__ void PrefetchTileToL2(const void* map, int head, int row, int b) {
#pragma unroll
  for (int c = 0; c < Tile::kBytes / Tile::kBlockBytes; ++c) {
#pragma unroll
    for (int r = 0; r < Tile::kTileRows / kBoxRows; ++r) TmaPrefetch4d(map, 64 * c, head, row + r * kBoxRows, b);
  }
}

// A generic pointer to a shared-window address, for plain loads and stores (they compile to LDS and STS).
template <typename T>
__device__ __forceinline__ T* SharedPointer(uint32_t addr) {
  return static_cast<T*>(__cvta_shared_to_generic(addr));
}

// A consumer warp is done with a stage: its lane 0 arrives on the stage's empty barrier, which counts warps.
__device__ __forceinline__ void ReleaseStage(uint32_t empty, int lane) {
  StressDelay();
  __syncwarp();
  if (lane == 0) MbarrierArrive(empty);
}

}  // namespace te_jax::cuda
