// Attention dropout on a key-major tile (tile[key][row], like the score tiles): each probability is kept by the rule
// of cpp/core/philox.h and scaled by 1 / (1 - rate), or zeroed. The forward applies it to P before P.V; the backward to dP
// (dS = P * (keep * dP / (1 - rate) - delta)) and to P before dV = P^T.dO.
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"
#include "cpp/core/philox.h"

namespace te_jax::cpu {

struct DropoutOperand {
  DropoutMask mask;
  float keep_scale;  // 1 / the keep probability (DropoutKeepScale)

  bool active() const { return mask.threshold > 0; }
};

inline DropoutOperand MakeDropoutOperand(const AttentionParams& p, const uint32_t* dropout) {
  if (p.dropout_threshold == 0) return {};
  return {{{dropout[0], dropout[1]}, {dropout[2], dropout[3], dropout[4], dropout[5]}, p.dropout_threshold},
          static_cast<float>(DropoutKeepScale(p.dropout_threshold))};
}

// tile[c * row_stride + r] of rows first_row + r < first_row + rows and keys key0 + c of (b, h), in place. Rows i and
// i + 8 of a 16-row block share their calls (cpp/core/philox.h), so a row whose partner is in the tile is done with it; a
// 16-key block's four calls are drawn once per row (pair).
inline void ApplyDropout(const DropoutOperand& d, int64_t b, int64_t h, int64_t first_row, int64_t rows, int64_t key0,
                         int64_t keys, int64_t row_stride, float* tile) {
  const auto apply = [&](int64_t r, uint32_t global_i, uint32_t global_j, const PhiloxWords& call, int64_t c) {
    float& x = tile[c * row_stride + r];
    const uint32_t number = DropoutMask::Number(call, DropoutMask::NumberIndex(global_i, global_j));
    x = d.mask.Keeps(number) ? x * d.keep_scale : 0.0f;
  };
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t i = d.mask.offset[2] + static_cast<uint32_t>(first_row + r);
    if ((i & 8) != 0 && r >= 8) continue;  // done with row r - 8
    const bool pair = (i & 8) == 0 && r + 8 < rows;
    PhiloxWords calls[4]{};
    for (int64_t c = 0; c < keys; ++c) {
      const uint32_t j = d.mask.offset[3] + static_cast<uint32_t>(key0 + c);
      if (c == 0 || (j & 15) == 0) {
        for (uint32_t t = 0; t < 4; ++t) calls[t] = d.mask.Call(b, h, i, (j & ~15u) + 2 * t);
      }
      const PhiloxWords& call = calls[(j >> 1) & 3];
      apply(r, i, j, call, c);
      if (pair) apply(r + 8, i + 8, j, call, c);
    }
  }
}

}  // namespace te_jax::cpu
