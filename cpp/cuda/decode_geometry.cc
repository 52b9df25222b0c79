#include "cpp/cuda/decode_geometry.h"

#include <algorithm>

#include "cpp/core/limits.h"
#include "cpp/cuda/kernels/decode/tile_size.h"

namespace te_jax::cuda {
namespace {

// A bound on SMs x decode CTAs per SM of any GPU (H200: 132 x 3), and on a call's CTAs over all its splits (two such
// waves), which sizes the workspace from the params alone.
constexpr int64_t kMaxSlots = 1024;
constexpr int64_t kMaxSplitCtas = 2 * kMaxSlots;
// What a CTA costs beyond its key tiles (filling the ring, the partial's write and the combine), in tiles' time.
constexpr int64_t kSplitOverheadTiles = 2;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The most splits a call of `ctas_per_split` CTAs over `tiles` key tiles may take on any GPU.
int64_t MaxSplits(int64_t ctas_per_split, int64_t tiles) {
  return std::clamp<int64_t>(kMaxSplitCtas / std::max<int64_t>(ctas_per_split, 1), 1, tiles);
}

// The splits that finish soonest when `wave` CTAs run at once: the waves a split count takes times the tiles each CTA
// walks (plus its overhead), the fewest splits among equals. Filling one wave is not enough: 512 CTAs on 396 slots
// (an FP8 cache's b 64 x 4k on an H100) run as 1.3 waves, two at full time; three splits run four waves of a third.
int64_t SplitsFillingWaves(int64_t ctas_per_split, int64_t tiles, int64_t wave) {
  int64_t best = 1, best_time = INT64_MAX;
  for (int64_t s = 1; s <= MaxSplits(ctas_per_split, tiles); ++s) {
    const int64_t time = CeilDiv(ctas_per_split * s, wave) * (CeilDiv(tiles, s) + kSplitOverheadTiles);
    if (time < best_time) best = s, best_time = time;
  }
  return best;
}

}  // namespace

// Packed sequences (segment ids, positions), dropout and a bias run on the families that have them; the decode kernels
// have none of them. FP8 attention (FP8 q) runs on the sm90 forward's FP8 kernel at any number of query positions.
bool UsesDecodeKernels(const AttentionParams& p) {
  return p.seqlen_q >= 1 && p.seqlen_q <= kMaxDecodeSeqlenQ && !p.has_segment_ids && !p.has_positions &&
         p.dropout_threshold == 0 && !p.has_bias && !p.flex.active() && !IsFp8(p.q_format);
}

int DecodeKernelFor(const AttentionParams& p) {
  return p.num_heads / p.num_kv_heads * p.seqlen_q <= decode::RowsOfTile(decode::RowTilesOfKernel(0)) ? 0 : 1;
}

DecodeGeometry DecodeGeometryFor(const AttentionParams& p, DecodeSlots slots) {
  DecodeGeometry g;
  const int64_t group = p.num_heads / p.num_kv_heads;
  g.kernel = DecodeKernelFor(p);
  const int64_t rows = decode::RowsOfTile(decode::RowTilesOfKernel(g.kernel));
  g.heads_per_block = static_cast<int>(std::min(group, rows));
  g.positions_per_block = static_cast<int>(std::min(p.seqlen_q, rows / g.heads_per_block));
  g.head_blocks = static_cast<int>(CeilDiv(group, g.heads_per_block));
  g.row_blocks = g.head_blocks * static_cast<int>(CeilDiv(p.seqlen_q, g.positions_per_block));
  g.ctas_per_split = p.batch * p.num_kv_heads * g.row_blocks;
  int64_t wave = slots.deep;
  const bool shallower =
      decode::kShallowStages < decode::DeepStages(static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v),
                                                  KvElementSize(p.dtype, p.kv_format));
  if (g.kernel == 0 && shallower && g.ctas_per_split <= slots.shallow) {
    g.kernel = decode::kShallowKernel;
    wave = slots.shallow;
  }
  const int64_t tiles = std::max<int64_t>(1, CeilDiv(p.seqlen_kv, decode::kBlockN));
  const int64_t splits =
      g.ctas_per_split == 0 ? 1 : SplitsFillingWaves(g.ctas_per_split, tiles, std::clamp<int64_t>(wave, 1, kMaxSlots));
  g.tiles_per_split = static_cast<int>(CeilDiv(tiles, splits));
  g.splits = static_cast<int>(CeilDiv(tiles, g.tiles_per_split));  // no split without tiles
  return g;
}

int64_t DecodeWorkspaceBytes(const AttentionParams& p) {
  if (!UsesDecodeKernels(p)) return 0;
  const DecodeGeometry g = DecodeGeometryFor(p, {kMaxSlots, kMaxSlots});
  const int64_t splits = MaxSplits(g.ctas_per_split, std::max<int64_t>(1, CeilDiv(p.seqlen_kv, decode::kBlockN)));
  if (splits == 1) return 0;
  return splits * p.batch * p.seqlen_q * p.num_heads * (p.head_dim_v + 1) * static_cast<int64_t>(sizeof(float));
}

DecodeGeometry DecodeGeometryOnGpu(const AttentionParams& p, const int* smem_bytes, int count, int multiprocessors,
                                   int smem_per_multiprocessor, const int* registers,
                                   int registers_per_multiprocessor) {
  const auto slots = [&](int kernel) -> int64_t {
    if (kernel >= count) return 0;
    // Each CTA also takes 1 KB of shared memory the driver reserves; a warp's registers are allocated in 256s.
    int per_sm = smem_per_multiprocessor / (smem_bytes[kernel] + 1024);
    if (registers != nullptr && registers[kernel] > 0) {
      const int warp_registers = (registers[kernel] * 32 + 255) / 256 * 256;
      per_sm = std::min(per_sm, registers_per_multiprocessor / (warp_registers * (decode::kThreads / 32)));
    }
    per_sm = std::max(1, per_sm);
    return std::min<int64_t>(kMaxSlots, static_cast<int64_t>(multiprocessors) * per_sm);
  };
  return DecodeGeometryFor(p, {slots(DecodeKernelFor(p)), slots(decode::kShallowKernel)});
}

}  // namespace te_jax::cuda
