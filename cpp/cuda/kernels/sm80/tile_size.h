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
// With an additive bias (issue 12) every kernel iterates tiles of kBiasBlockN rows instead (the forward and dq kernels
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
//   d + dv <= 256: one slice. Larger: two slices (s and dp are recomputed per slice, dk/dv registers halve).
// With accumulate_dq (the default, non-deterministic backward) the same CTA also adds each step's ds k to a float dq
// accumulator (one bulk reduction per step on sm90), so the dq kernel and its recomputation of s and dp go. For
// 128 < d + dv <= 256 it takes 128 keys (8 warps, ~155 KB, one CTA per SM): half the dq traffic per mma of 64 keys.
// H200, d = 128, b * s = 16k, backward TFLOP/s, 8 warps / 4 warps: s = 8k 236 / 240, causal 221 / 212; s = 2k 220 / 226,
// causal 178 / 185 (docs/BENCHMARKS.md, run 6): 8 warps for the steadier worst case. d = 64: 4 warps (203 / 212).
TE_JAX_HOST_DEVICE constexpr TileSize BackwardDkDvTileSize(int d, int dv, bool accumulate_dq, bool bias = false) {
  const int sum = PadHeadDim(d) + PadHeadDim(dv);
  const int block_n = bias ? kBiasBlockN : 64;
  if (accumulate_dq && sum > 128 && sum <= 256) return {8, 128, block_n, 1};
  return {4, 64, block_n, sum <= 256 ? 1 : 2};
}

// Whether the default backward (deterministic=False) accumulates dq in the dk/dv kernel. Not for d + dv > 256: there
// the dk/dv kernel works in two column slices that each recompute s and dp, and the fused kernel measured slower than
// the three-kernel one (H200, d = 256, s >= 2k: fwd+bwd 0.34-0.36x cuDNN against 0.35-0.39x; docs/BENCHMARKS.md run 7).
TE_JAX_HOST_DEVICE constexpr bool BackwardAccumulatesDq(int d, int dv) { return PadHeadDim(d) + PadHeadDim(dv) <= 256; }

// The fast backward's float dq accumulator (the call's workspace): [B][H][slices][Sq rounded up to row_block][cols],
// cols = one dk/dv slice's dq columns. The rows x cols block one dk/dv step adds to is contiguous, so the sm90 kernel
// adds it with a single bulk reduction, and the rounding gives the last query tile's rows somewhere to go: row_block is
// a multiple of every step (sm80's 64 query rows, 32 with a bias; sm90's 64 or 128, sm90/tile_size.h).
// Within a row, column c is stored at c ^ 4 * (row & swizzle). Rows are a multiple of 128 bytes apart, so without it
// the 8 rows a warp's fragment store touches in the shared-memory copy of a block share their banks (8-way
// conflicts); 16-byte chunks stay contiguous.
inline constexpr int kDqAccumRowBlock = 128;  // row_block of every layout: a multiple of both families' steps

struct DqAccumLayout {
  int slices;
  int cols;       // floats per row
  int row_block;  // Sq is rounded up to a multiple of it
  int swizzle;    // a power of two minus one: the row bits XORed into the 16-byte chunk index
};

TE_JAX_HOST_DEVICE constexpr DqAccumLayout BackwardDqAccumLayout(int d, int dv) {
  const TileSize t = BackwardDkDvTileSize(d, dv, true);
  const int cols = (PadHeadDim(d) / 16 + t.slices - 1) / t.slices * 16;
  const int chunks = cols / 4;  // a multiple of 4
  return {t.slices, cols, kDqAccumRowBlock, chunks % 8 == 0 ? 7 : 3};
}

// Backward dq: a CTA owns 16 * warps queries and visits their key tiles; accumulator dq is d / 4 floats.
TE_JAX_HOST_DEVICE constexpr TileSize BackwardDqTileSize(int d, int dv, bool bias = false) {
  (void)d;
  (void)dv;
  return {4, 64, bias ? kBiasBlockN : 64, 1};
}

}  // namespace te_jax::cuda::sm80

namespace te_jax::cuda::sm80 {

// Shared-memory bytes of each kernel for a tile size (padded rows as in smem_tile.h). The kernels static_assert that
// their layout matches, so the launcher, which includes only this header, asks for exactly what they use.
TE_JAX_HOST_DEVICE constexpr int TileBytes(int rows, int padded_cols) { return rows * (padded_cols + 8) * 2; }

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
  return TileBytes(t.block_m, PadHeadDim(d)) + 2 * (TileBytes(t.block_n, PadHeadDim(d)) + TileBytes(t.block_n, PadHeadDim(dv))) +
         8 * t.block_m +  // + each row's visible key range (int2)
         (tokens ? 16 * t.block_m + 2 * 8 * t.block_n + 4 * t.block_m : 0) +  // + rows, keys per stage, rows' "seen" flags
         2 * BiasTileBytes(t.block_m, t.block_n, bias_bytes);
}

TE_JAX_HOST_DEVICE constexpr int BackwardDkDvSmemBytes(int d, int dv, bool accumulate_dq, bool tokens = false,
                                                       int bias_bytes = 0) {
  const TileSize t = BackwardDkDvTileSize(d, dv, accumulate_dq, bias_bytes > 0);
  return TileBytes(t.block_m, PadHeadDim(d)) + TileBytes(t.block_m, PadHeadDim(dv)) +
         2 * (TileBytes(t.block_n, PadHeadDim(d)) + TileBytes(t.block_n, PadHeadDim(dv)) + 2 * 4 * t.block_n +
              (tokens ? 16 * t.block_n : 0) +  // + each stage's query rows
              BiasTileBytes(t.block_n, t.block_m, bias_bytes)) +
         (accumulate_dq ? TileBytes(t.block_m, t.block_n) : 0) +  // + ds^T [keys][queries]
         (bias_bytes > 0 ? BiasGradTileBytes(t.block_n, t.block_m) : 0);
}

TE_JAX_HOST_DEVICE constexpr int BackwardDqSmemBytes(int d, int dv, bool tokens = false, int bias_bytes = 0) {
  const TileSize t = BackwardDqTileSize(d, dv, bias_bytes > 0);
  return TileBytes(t.block_m, PadHeadDim(d)) + TileBytes(t.block_m, PadHeadDim(dv)) +
         2 * (TileBytes(t.block_n, PadHeadDim(d)) + TileBytes(t.block_n, PadHeadDim(dv)) + (tokens ? 8 * t.block_n : 0) +
              BiasTileBytes(t.block_m, t.block_n, bias_bytes)) +
         4 * t.block_m;
}

// Threads per block of the backward's row-wise kernels (preprocess, dq conversion; one warp per query row).
inline constexpr int kRowKernelThreads = 256;

}  // namespace te_jax::cuda::sm80
