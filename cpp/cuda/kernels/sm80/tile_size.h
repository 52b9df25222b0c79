// The tuning table of the sm80 (mma.sync) kernel family: every tile shape in one place. Host code picks a row of it for
// a configuration and renders it into the kernel's translation unit as template arguments; the kernels only check it.
// Head dims are padded to a multiple of 16 (the mma k extent); a warp always owns 16 rows of the tile it iterates with.
#pragma once

#include "cpp/host_device.h"

namespace te_jax::cuda::sm80 {

TE_JAX_HOST_DEVICE constexpr int PadHeadDim(int d) { return (d + 15) / 16 * 16; }

struct TileSize {
  int warps;      // threads = 32 * warps
  int block_m;    // rows owned by the CTA (forward, dq: queries; dk/dv: keys) = 16 * warps * m_tiles
  int block_n;    // rows of the tile the CTA iterates over (forward, dq: keys; dk/dv: queries)
  int slices;     // dk/dv only: the CTA accumulates 1/slices of dk's and dv's columns (bounds accumulator registers)
  int m_tiles = 1;  // forward only: 16-row m tiles per warp; 2 halves the k/v shared-memory reads per mma
};

// Forward: q tile in shared memory, k/v double-buffered. Accumulators per thread: m_tiles * (block_n/2 (s) + dv/4 (o))
// floats. With one m tile per warp every k/v fragment read from shared memory feeds one mma pair and the kernel is
// bound by shared-memory bandwidth (H200, d = 128: 175 TFLOP/s); two m tiles per warp reuse each fragment twice.
//   d <= 128: 128 x 64, 4 warps x 2 m tiles (FlashAttention-2's sm80 shape): ~104 KB shared memory.
//   d <= 256: 128 x 64, 8 warps x 1 m tile: ~199 KB shared memory (sm90/sm100 opt-in limit 227 KB), one CTA per SM;
//     o alone is 128 registers at dv = 256, so a warp owns one m tile, and 8 warps per SM (rather than 4 with the
//     earlier 64 x 64 CTA) hide the ldmatrix/mma/softmax latencies.
TE_JAX_HOST_DEVICE constexpr TileSize ForwardTileSize(int d, int dv) {
  const int dmax = PadHeadDim(d) > PadHeadDim(dv) ? PadHeadDim(d) : PadHeadDim(dv);
  if (dmax <= 128) return {4, 128, 64, 1, 2};
  return {8, 128, 64, 1, 1};
}

// Backward dk/dv: a CTA owns 16 * warps keys of one kv head and visits every query tile of its query-head group.
// Accumulators: dk and dv slices, (d + dv) / (4 * slices) floats, plus s and dp, block_n / 2 each.
//   d + dv <= 256: one slice. Larger: two slices (s and dp are recomputed per slice, dk/dv registers halve).
TE_JAX_HOST_DEVICE constexpr TileSize BackwardDkDvTileSize(int d, int dv) {
  const int sum = PadHeadDim(d) + PadHeadDim(dv);
  return {4, 64, 64, sum <= 256 ? 1 : 2};
}

// Backward dq: a CTA owns 16 * warps queries and visits their key tiles; accumulator dq is d / 4 floats.
TE_JAX_HOST_DEVICE constexpr TileSize BackwardDqTileSize(int d, int dv) {
  (void)d;
  (void)dv;
  return {4, 64, 64, 1};
}

}  // namespace te_jax::cuda::sm80

namespace te_jax::cuda::sm80 {

// Shared-memory bytes of each kernel for a tile size (padded rows as in smem_tile.h). The kernels static_assert that
// their layout matches, so the launcher, which includes only this header, asks for exactly what they use.
TE_JAX_HOST_DEVICE constexpr int TileBytes(int rows, int padded_cols) { return rows * (padded_cols + 8) * 2; }

TE_JAX_HOST_DEVICE constexpr int ForwardSmemBytes(int d, int dv) {
  const TileSize t = ForwardTileSize(d, dv);
  return TileBytes(t.block_m, PadHeadDim(d)) + 2 * (TileBytes(t.block_n, PadHeadDim(d)) + TileBytes(t.block_n, PadHeadDim(dv))) +
         8 * t.block_m;  // + each row's visible key range (int2)
}

TE_JAX_HOST_DEVICE constexpr int BackwardDkDvSmemBytes(int d, int dv) {
  const TileSize t = BackwardDkDvTileSize(d, dv);
  return TileBytes(t.block_m, PadHeadDim(d)) + TileBytes(t.block_m, PadHeadDim(dv)) +
         2 * (TileBytes(t.block_n, PadHeadDim(d)) + TileBytes(t.block_n, PadHeadDim(dv)) + 2 * 4 * t.block_n);
}

TE_JAX_HOST_DEVICE constexpr int BackwardDqSmemBytes(int d, int dv) {
  const TileSize t = BackwardDqTileSize(d, dv);
  return TileBytes(t.block_m, PadHeadDim(d)) + TileBytes(t.block_m, PadHeadDim(dv)) +
         2 * (TileBytes(t.block_n, PadHeadDim(d)) + TileBytes(t.block_n, PadHeadDim(dv))) + 4 * t.block_m;
}

// Threads per block of the backward preprocess kernel (one warp per query row).
inline constexpr int kPreprocessThreads = 256;

}  // namespace te_jax::cuda::sm80
