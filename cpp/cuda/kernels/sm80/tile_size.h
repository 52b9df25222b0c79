// The tuning table of the sm80 (mma.sync) kernel family: every tile shape in one place. Host code picks a row of it for
// a configuration and renders it into the kernel's translation unit as template arguments; the kernels only check it.
// Head dims are padded to a multiple of 16 (the mma k extent); a warp always owns 16 rows of the tile it iterates with.
#pragma once

#include "cpp/core/host_device.h"
#include "cpp/cuda/kernels/common/tile_size.h"
#include "cpp/cuda/kernels/primitives/padded_tile_size.h"

namespace te_jax::cuda::sm80 {

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
// With an additive bias every kernel iterates tiles of kBiasBlockN rows instead (the forward and dq kernels
// 32 keys, the dk/dv kernel 32 queries per step): the two bias stages (kernels/sm80/bias_tile.h) then take about the
// shared memory the halved k/v (q/dout) stages free, so a kernel keeps the CTAs per SM it has without a bias (the d =
// 128 forward two, with a float32 bias too), and a float32 bias fits beside the d = 256 kernels at all. The
// query-block sizes, warps and m tiles stay.
inline constexpr int kBiasBlockN = 32;

TE_JAX_HOST_DEVICE constexpr TileSize ForwardTileSize(int d, int dv, bool bias = false) {
  const int dmax = PadHeadDim(d) > PadHeadDim(dv) ? PadHeadDim(d) : PadHeadDim(dv);
  const int block_n = bias ? kBiasBlockN : 64;
  if (dmax <= 128) return {4, 128, block_n, 1, 2};
  return {8, 128, block_n, 1, 1};
}

// Backward dk/dv: a CTA owns 16 * warps keys of one kv head and visits every query tile of its query-head group.
// Accumulators: dk and dv slices, (d + dv) / (4 * slices) floats, plus s and dp, block_n / 2 each.
//   d + dv <= 256: one slice. Larger: two slices (s and dp are recomputed per slice, dk/dv registers halve;
//   common/tile_size.h, since the dq accumulator's layout follows them).
// With accumulate_dq (the default, non-deterministic backward) the same CTA also adds each step's ds k to a float dq
// accumulator (one bulk reduction per step on sm90), so the dq kernel and its recomputation of s and dp go. For
// 128 < d + dv <= 256 it takes 128 keys (8 warps, ~155 KB, one CTA per SM): half the dq traffic per mma of 64 keys.
// H200, d = 128, b * s = 16k, backward TFLOP/s, 8 warps / 4 warps: s = 8k 236 / 240, causal 221 / 212; s = 2k 220 / 226,
// causal 178 / 185: 8 warps for the steadier worst case. d = 64: 4 warps (203 / 212).
TE_JAX_HOST_DEVICE constexpr TileSize BackwardDkDvTileSize(int d, int dv, bool accumulate_dq, bool bias = false) {
  const int sum = PadHeadDim(d) + PadHeadDim(dv);
  const int block_n = bias ? kBiasBlockN : 64;
  if (accumulate_dq && sum > 128 && sum <= 256) return {8, 128, block_n, 1};
  return {4, 64, block_n, BackwardDkDvSlices(d, dv)};
}

// Backward dq: a CTA owns 16 * warps queries and visits their key tiles; accumulator dq is d / 4 floats.
TE_JAX_HOST_DEVICE constexpr TileSize BackwardDqTileSize(int d, int dv, bool bias = false) {
  (void)d;
  (void)dv;
  return {4, 64, bias ? kBiasBlockN : 64, 1};
}

// Shared-memory bytes of each kernel for a tile size (PaddedTile's rows, primitives/padded_tile_size.h). The kernels
// static_assert that their layout matches, so the launcher, which includes only this header, asks for exactly what
// they use.

// With segment ids or positions (tokens) the kernels also stage token-table entries (kernels/common/token_mask.h):
// 16 bytes per query row and 8 per key. With a bias of bias_bytes per element (0: none) they stage two bias tiles
// (BiasTileBytes, as kernels/sm80/bias_tile.h lays them out), and the dk/dv kernel a float tile of the step's dS for
// dbias (BiasGradTileBytes).
TE_JAX_HOST_DEVICE constexpr int BiasTileBytes(int rows, int cols, int bias_bytes) {
  return bias_bytes == 0 ? 0 : rows * (cols + 16 / bias_bytes) * bias_bytes;
}
TE_JAX_HOST_DEVICE constexpr int BiasGradTileBytes(int queries, int keys) { return queries * (keys + 4) * 4; }

TE_JAX_HOST_DEVICE constexpr int ForwardSmemBytes(int d, int dv, bool tokens = false, int bias_bytes = 0) {
  const TileSize t = ForwardTileSize(d, dv, bias_bytes > 0);
  return PaddedTileBytes(t.block_m, PadHeadDim(d)) + 2 * (PaddedTileBytes(t.block_n, PadHeadDim(d)) + PaddedTileBytes(t.block_n, PadHeadDim(dv))) +
         8 * t.block_m +  // + each row's visible key range (int2)
         (tokens ? 16 * t.block_m + 2 * 8 * t.block_n + 4 * t.block_m : 0) +  // + rows, keys per stage, rows' "seen" flags
         2 * BiasTileBytes(t.block_m, t.block_n, bias_bytes);
}

TE_JAX_HOST_DEVICE constexpr int BackwardDkDvSmemBytes(int d, int dv, bool accumulate_dq, bool tokens = false,
                                                       int bias_bytes = 0) {
  const TileSize t = BackwardDkDvTileSize(d, dv, accumulate_dq, bias_bytes > 0);
  return PaddedTileBytes(t.block_m, PadHeadDim(d)) + PaddedTileBytes(t.block_m, PadHeadDim(dv)) +
         2 * (PaddedTileBytes(t.block_n, PadHeadDim(d)) + PaddedTileBytes(t.block_n, PadHeadDim(dv)) + 2 * 4 * t.block_n +
              (tokens ? 16 * t.block_n : 0) +  // + each stage's query rows
              BiasTileBytes(t.block_n, t.block_m, bias_bytes)) +
         (accumulate_dq ? PaddedTileBytes(t.block_m, t.block_n) : 0) +  // + ds^T [keys][queries]
         (bias_bytes > 0 ? BiasGradTileBytes(t.block_n, t.block_m) : 0);
}

TE_JAX_HOST_DEVICE constexpr int BackwardDqSmemBytes(int d, int dv, bool tokens = false, int bias_bytes = 0) {
  const TileSize t = BackwardDqTileSize(d, dv, bias_bytes > 0);
  return PaddedTileBytes(t.block_m, PadHeadDim(d)) + PaddedTileBytes(t.block_m, PadHeadDim(dv)) +
         2 * (PaddedTileBytes(t.block_n, PadHeadDim(d)) + PaddedTileBytes(t.block_n, PadHeadDim(dv)) + (tokens ? 8 * t.block_n : 0) +
              BiasTileBytes(t.block_m, t.block_n, bias_bytes)) +
         4 * t.block_m;
}

}  // namespace te_jax::cuda::sm80
