// Which tiles meet: the keys each Q tile can see and the segment id and position bounds of each KV tile, computed
// once per call, and the test of whether a Q tile and a KV tile meet.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/cpu/batch_masks.h"
#include "cpp/cpu/tile_key_ranges.h"
#include "cpp/cpu/tile_shape.h"
#include "cpp/cpu/tile_token_bounds.h"

namespace te_jax::cpu {

// What every Q tile of every batch can see, [B, Q tiles]: its index range of keys and the bounds of its rows' segment
// ids and positions. The forward's cost estimate and the backward's test of which Q tiles meet a KV tile.
struct QTileReach {
  KeyRange keys;
  RowTokenBounds tokens;
};

inline std::vector<QTileReach> QTileKeys(const AttentionParams& p, const int32_t* q_seqlens,
                                         const int32_t* kv_seqlens, const TokenOperands& token_operands) {
  const int64_t q_tiles = CeilDiv(p.seqlen_q, kTileQ);
  std::vector<QTileReach> reach(p.batch * q_tiles);
  TileKeyRanges<kTileQ> ranges;
  for (int64_t b = 0; b < p.batch; ++b) {
    const RowMask mask = BatchMask(p, q_seqlens, kv_seqlens, b);
    const TokenMask tokens = BatchTokens(p, token_operands, b);
    for (int64_t t = 0; t < q_tiles; ++t) {
      ranges.Compute(mask, tokens, t * kTileQ, std::min(kTileQ, p.seqlen_q - t * kTileQ));
      reach[b * q_tiles + t] = {ranges.any, ranges.token_rows};
    }
  }
  return reach;
}

// The segment id and position bounds of every KV tile (aligned to kTileKV) of every batch, [B, KV tiles]; empty
// without segment ids and positions.
inline std::vector<KeyTokenBounds> KVTileTokens(const AttentionParams& p,
                                                const TokenOperands& token_operands) {
  if (!p.has_segment_ids && !p.has_positions) return {};
  const int64_t kv_tiles = CeilDiv(p.seqlen_kv, kTileKV);
  std::vector<KeyTokenBounds> bounds(p.batch * kv_tiles);
  for (int64_t b = 0; b < p.batch; ++b) {
    const TokenMask tokens = BatchTokens(p, token_operands, b);
    for (int64_t t = 0; t < kv_tiles; ++t) {
      bounds[b * kv_tiles + t].Compute(tokens, t * kTileKV, std::min(kTileKV, p.seqlen_kv - t * kTileKV));
    }
  }
  return bounds;
}

inline bool Meets(const KeyRange& keys, int64_t begin, int64_t end) {
  return keys.begin < keys.end && keys.begin < end && begin < keys.end;
}

// Whether a Q tile may see KV tile `kv_tile` (aligned) of batch entry b: its index range meets the tile and, with
// segment ids or positions, their bounds do.
inline bool Meets(const AttentionParams& p, const QTileReach& q_tile, const KeyTokenBounds* kv_tile_tokens,
                  int64_t b, int64_t kv_tile) {
  const int64_t begin = kv_tile * kTileKV, end = std::min(p.seqlen_kv, begin + kTileKV);
  if (!Meets(q_tile.keys, begin, end)) return false;
  if (kv_tile_tokens == nullptr) return true;
  const KeyTokenBounds& keys = kv_tile_tokens[b * CeilDiv(p.seqlen_kv, kTileKV) + kv_tile];
  return MayMeet(p.has_segment_ids, p.has_positions, q_tile.tokens, keys);
}

}  // namespace te_jax::cpu
