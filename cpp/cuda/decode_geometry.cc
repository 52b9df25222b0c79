#include "cpp/cuda/decode_geometry.h"

#include <algorithm>

#include "cpp/core/limits.h"
#include "cpp/cuda/kernels/decode/tile_size.h"

namespace te_jax::cuda {
namespace {

// A bound on SMs x decode CTAs per SM of any GPU (H200: 132 x 2), for the workspace.
constexpr int64_t kMaxSlots = 1024;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

// Packed sequences (segment ids, positions), dropout and a bias run on the families that have them; the decode kernels
// have none of them.
bool UsesDecodeKernels(const AttentionParams& p) {
  return p.seqlen_q >= 1 && p.seqlen_q <= kMaxDecodeSeqlenQ && !p.has_segment_ids && !p.has_positions &&
         p.dropout_threshold == 0 && !p.has_bias && !p.flex.active();
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
      g.ctas_per_split == 0 ? 1 : std::clamp<int64_t>(std::min(wave, kMaxSlots) / g.ctas_per_split, 1, tiles);
  g.tiles_per_split = static_cast<int>(CeilDiv(tiles, splits));
  g.splits = static_cast<int>(CeilDiv(tiles, g.tiles_per_split));  // no split without tiles
  return g;
}

int64_t DecodeWorkspaceBytes(const AttentionParams& p) {
  if (!UsesDecodeKernels(p)) return 0;
  // Both rings' splits are at most kMaxSlots / ctas_per_split.
  const DecodeGeometry g = DecodeGeometryFor(p, {kMaxSlots, kMaxSlots});
  if (g.splits == 1) return 0;
  return g.splits * p.batch * p.seqlen_q * p.num_heads * (p.head_dim_v + 1) * static_cast<int64_t>(sizeof(float));
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
