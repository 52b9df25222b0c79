// A score tile's logits. Scores are kept in log2 units (the softmax runs on exp2): for the plain scaled dot,
// scale * log2(e) is folded into the packed Q^T; the other variants (soft-cap, ALiBi) apply Logit to the raw dots.
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"
#include "cpp/core/token_mask.h"
#include "cpp/core/visible_keys.h"
#include "cpp/cpu/query_rows.h"
#include "cpp/cpu/tile_shape.h"

namespace te_jax::cpu {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// The plain scaled dot is linear in q, so its scale (and log2 e) can ride on the packed Q^T and the tiles need no
// per-element logit pass; the other variants apply Logit to the raw dot products.
template <typename Variant>
inline constexpr bool kIsLinear = !Variant::kHasSoftcap && !Variant::kHasAlibi;

template <typename Variant>
Variant MakeVariant(const AttentionParams& p, const float* alibi_slopes, int64_t b, int64_t h) {
  return Variant{p.scale, p.softcap, Variant::kHasAlibi ? alibi_slopes[b * p.num_heads + h] : 0.0f};
}

// What the logits of a score tile's lanes need besides the dot, for the variants that are not linear in it: the ALiBi
// slope of the row's head (a packed tile's rows have several) and the position ALiBi measures the keys from, the
// query's diagonal position or, with positions, its token position. Lanes past the rows get 0 and 0; their scores
// are never read.
struct RowLogitInputs {
  float slope[kTileQ];
  int64_t position[kTileQ];

  void Compute(const AttentionParams& p, const float* alibi_slopes, const RowMask& mask, const TokenMask& tokens,
               const QueryRows<kTileQ>& tile) {
    for (int64_t r = 0; r < kTileQ; ++r) {
      const bool row = r < tile.rows;
      slope[r] = row && p.has_alibi ? alibi_slopes[tile.batch * p.num_heads + tile.head[r]] : 0.0f;
      const int64_t i = row ? tile.position[r] : 0;
      position[r] = !row ? 0 : tokens.has_positions() ? tokens.q_pos[i] : i + mask.diag_offset;
    }
  }
};

// scores[key][row] = Logit(dot) in log2 units, for the variants that are not linear in the dot. ALiBi reads key c's
// position first_key + c, or its token position when the call has them.
template <typename Variant>
void ApplyLogits(Variant variant, const RowLogitInputs& rows, const float* dots, float* scores, int64_t keys,
                 int64_t lanes, int64_t first_key, const TokenMask& tokens) {
  for (int64_t c = 0; c < keys; ++c) {
    const int64_t key_position = tokens.has_positions() ? tokens.kv_pos[first_key + c] : first_key + c;
    for (int64_t r = 0; r < lanes; ++r) {
      variant.slope = rows.slope[r];
      scores[c * kTileQ + r] = kLog2e * variant.Logit(dots[c * kTileQ + r], rows.position[r], key_position);
    }
  }
}

}  // namespace te_jax::cpu
