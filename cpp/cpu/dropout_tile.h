// Attention dropout on a key-major tile (tile[key][row], like the score tiles): each probability is kept by the rule
// of cpp/philox.h and scaled by 1 / (1 - rate), or zeroed. The forward applies it to P before P.V; the backward to dP
// (dS = P * (keep * dP / (1 - rate) - delta)) and to P before dV = P^T.dO.
#pragma once

#include <cstdint>

#include "cpp/attention_params.h"
#include "cpp/philox.h"

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

// tile[c * row_stride + r] of rows first_row + r < first_row + rows and keys key0 + c of (b, h), in place.
inline void ApplyDropout(const DropoutOperand& d, int64_t b, int64_t h, int64_t first_row, int64_t rows, int64_t key0,
                         int64_t keys, int64_t row_stride, float* tile) {
  for (int64_t r = 0; r < rows; ++r) {
    PhiloxWords words{};
    for (int64_t c = 0; c < keys; ++c) {
      const uint32_t j = d.mask.offset[3] + static_cast<uint32_t>(key0 + c);
      if (c == 0 || (j & 7) == 0) words = d.mask.Group(b, h, first_row + r, j);  // one Philox call per 8 keys
      float& x = tile[c * row_stride + r];
      x = d.mask.Keeps(DropoutMask::Half(words, j & 7)) ? x * d.keep_scale : 0.0f;
    }
  }
}

}  // namespace te_jax::cpu
