// The tuning table of the decode kernels (kernels/decode/): few query rows against a long key sequence, bound by the
// memory bandwidth of reading K and V once. A CTA packs the query heads of one K/V head (and a few query positions)
// into the rows of one tile, so every K/V byte it reads serves the whole group, and the keys of a (batch, K/V head)
// are split across CTAs (split-KV) when batch x K/V heads alone cannot fill the GPU; a combine kernel merges the
// splits' partial results by their log-sum-exp.
#pragma once

#include "cpp/core/host_device.h"
#include "cpp/cuda/kernels/primitives/padded_tile_size.h"

#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif

namespace te_jax::cuda::decode {

inline constexpr int kWarps = 4;
inline constexpr int kThreads = 32 * kWarps;
inline constexpr int kBlockN = 64;  // keys per pipeline stage

// The K and V stages' tiles (attention_decode.cuh StageTileOf): for head dims of whole 128-byte rows an unpadded
// tile whose 16-byte chunks are swizzled by row, so a 32-byte global sector fills one 32-byte shared sector; padded
// rows (the sm80 family's tiles) put every other row's sectors across two, and cp.async then reads each such sector
// twice (H200, b 8 x 32k: 1.5x the ideal L2 sectors, the L2 at 91% of its throughput).
TE_JAX_HOST_DEVICE constexpr bool SwizzledStage(int padded_cols) { return padded_cols % 64 == 0; }

// An FP8 KV cache (kv_bytes 1) is staged as raw bytes: a tile of 64 keys x d bytes is a 16-bit tile of d / 2 columns
// (byte pairs), so the 16-bit tiles, their copies and TMA boxes serve it (primitives/fp8_tile.h), and a stage costs half
// the shared memory. Its head dims are padded to 32 so that a row is whole 16-column blocks of byte pairs, what the
// 16-bit tiles and their fragment loads take; the 16-bit K/V's to the mma k extent, 16.
TE_JAX_HOST_DEVICE constexpr int PadKvDim(int d, int kv_bytes) {
  return kv_bytes == 1 ? (d + 31) / 32 * 32 : PadHeadDim(d);
}

// The 16-bit columns of a K or V stage tile.
TE_JAX_HOST_DEVICE constexpr int StageCols(int d, int kv_bytes) { return PadKvDim(d, kv_bytes) * kv_bytes / 2; }

TE_JAX_HOST_DEVICE constexpr int StageTileBytes(int d, int kv_bytes) {
  return SwizzledStage(StageCols(d, kv_bytes)) ? kBlockN * StageCols(d, kv_bytes) * 2
                                               : PaddedTileBytes(kBlockN, StageCols(d, kv_bytes));
}

// A paged call's TMA boxes (sm_90 on): the largest power of two that divides the page size, up to a stage's keys, so
// a box never crosses a page and a stage is whole boxes (page sizes are multiples of 8 from 8 to 256).
TE_JAX_HOST_DEVICE constexpr int PagedBoxRows(int64_t page_size) {
  const int low_bit = static_cast<int>(page_size & -page_size);
  return low_bit < kBlockN ? low_bit : kBlockN;
}

// Stages of the ring. The deep ring: three for stages of up to 128 16-bit columns (16-bit K/V of head dims up to 128:
// ~103 KB at d = 128 with the 16-row tile, two CTAs per SM on an H200), two above (~138 KB at 16-bit d = 256). The
// shallow ring, two stages (~70 KB at d = 128: three CTAs per SM), serves the four-row-tile kernel (below) and a
// one-row-tile call whose CTAs fit in one wave of its slots (decode_geometry.cc): H200, b 8 x 32k, its kernel took
// 245 us against the deep ring's 251 (DRAM 91% against 89% busy), while b 64 x 4k's 512 CTAs took 1.29 waves of it:
// 326 us against 254. An FP8 KV cache's stages are at most 128 columns (d = 256), so every FP8 head dim takes the deep
// ring: its half-size stages fit twice the CTAs an SM (d = 128: ~55 KB deep, four an SM on an H200, ~38 KB shallow),
// which keeps the 16-bit kernel's bytes in flight per SM with twice its warps to issue the conversions.
TE_JAX_HOST_DEVICE constexpr int DeepStages(int d, int dv, int kv_bytes) {
  return StageCols(d, kv_bytes) <= 128 && StageCols(dv, kv_bytes) <= 128 ? 3 : 2;
}
inline constexpr int kShallowStages = 2;

// A paged call's rows of each tile's keys (cpp/core/kv_rows.h; a contiguous call's follow from the key) are looked up once,
// by one thread per key, into a ring of tables in shared memory an iteration before the tile's copies are issued, so
// no copy waits on a page-table read (that wait made paged calls 1.7x slower than contiguous ones on an H200; with the
// tables they are within 2%, H200). (Asking the L2 for tiles beyond the ring with prefetch.global.L2
// measured 10-25% slower there, and fetching 256-byte L2 blocks per copy ~8% slower.)
TE_JAX_HOST_DEVICE constexpr int KeyRowSlots(int stages) { return stages + 1; }

// A CTA's warps split its tile as row_tiles 16-row tiles x (kWarps / row_tiles) key slices of each stage: one row tile
// (16 rows: a single position of up to 16 heads, the common decode step) gives each warp 16 of the 64 keys; four row
// tiles (64 rows, e.g. 4 heads x 16 positions) give each warp 16 rows and all 64 keys.
TE_JAX_HOST_DEVICE constexpr int RowsOfTile(int row_tiles) { return 16 * row_tiles; }

// The epilogue's float rows of each warp's partial output (padded_dv: PadKvDim), padded by 4 floats so a fragment
// store's 8 rows spread over the banks.
TE_JAX_HOST_DEVICE constexpr int EpiloguePitch(int padded_dv) { return padded_dv + 4; }

// The epilogue's bytes: each warp's 16 rows of partial output, max and sum, then per tile row the key slices'
// weights, 1 / sum and lse.
TE_JAX_HOST_DEVICE constexpr int EpilogueBytes(int padded_dv, int row_tiles) {
  return kWarps * 16 * (EpiloguePitch(padded_dv) + 2) * 4 + RowsOfTile(row_tiles) * (kWarps / row_tiles + 2) * 4;
}

// Where the rows' key ranges start: past the rings and the q tile, which the epilogue reuses (it reads the ranges),
// or past the epilogue where that is larger (FP8's half-size stages with dv above d).
TE_JAX_HOST_DEVICE constexpr int RowsOffset(int d, int dv, int row_tiles, int stages, int kv_bytes) {
  const int pipeline = stages * (StageTileBytes(d, kv_bytes) + StageTileBytes(dv, kv_bytes)) +
                       PaddedTileBytes(RowsOfTile(row_tiles), PadKvDim(d, kv_bytes));
  const int epilogue = EpilogueBytes(PadKvDim(dv, kv_bytes), row_tiles);
  return pipeline > epilogue ? pipeline : epilogue;
}

// The shared memory: the k and v rings and the q tile (or the epilogue), each row's key range, position and ALiBi
// slope, the key-row tables, with an FP8 KV cache a (k, v) descale pair per key of each table and the q tile's max,
// and a barrier per stage, from a base the kernel aligns to 1024 bytes (TMA's swizzle atoms: 1024 more bytes).
TE_JAX_HOST_DEVICE constexpr int SmemBytes(int d, int dv, int row_tiles, int stages, int kv_bytes) {
  const int rows = RowsOfTile(row_tiles);
  return 1024 + RowsOffset(d, dv, row_tiles, stages, kv_bytes) + rows * (8 + 4 + 4) +
         KeyRowSlots(stages) * kBlockN * 4 + (kv_bytes == 1 ? KeyRowSlots(stages) * kBlockN * 8 + 8 : 0) + stages * 8;
}

// The combine kernel: a warp per query row, four rows a CTA (a decode step has few rows: small CTAs spread them over
// more SMs).
inline constexpr int kCombineThreads = 128;

// The decode module's entry points (kernel_config.cc): 0 one row tile, deep ring; 1 four row tiles, shallow ring; 2
// the combine; 3 one row tile, shallow ring. The four-row-tile kernel does four times the one-row-tile kernel's
// products per byte, with four warps a CTA; its deep ring (~118 KB at d = 128) ran one CTA an SM, whose warps waited
// on their own products; on the shallow ring (~84 KB) two CTAs share an SM (H100, b 8 x 16 queries x 8k: paged 64
// 126 -> 120-122 us, paged 16 145 -> 122-128).
inline constexpr int kCombineKernel = 2;
inline constexpr int kShallowKernel = 3;
TE_JAX_HOST_DEVICE constexpr int RowTilesOfKernel(int index) { return index == 1 ? 4 : 1; }
TE_JAX_HOST_DEVICE constexpr int StagesOfKernel(int d, int dv, int kv_bytes, int index) {
  return index == kShallowKernel || index == 1 ? kShallowStages : DeepStages(d, dv, kv_bytes);
}
TE_JAX_HOST_DEVICE constexpr int KernelSmemBytes(int d, int dv, int kv_bytes, int index) {
  return index == kCombineKernel
             ? 0
             : SmemBytes(d, dv, RowTilesOfKernel(index), StagesOfKernel(d, dv, kv_bytes, index), kv_bytes);
}

}  // namespace te_jax::cuda::decode
