// A tile's query rows packed transposed, [dim, lanes]: the B operand of the key-major score products (S^T = K Q^T,
// and in the backward dP^T = V dO^T), whose lanes are the tile's rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpp/core/attention_params.h"
#include "cpp/core/limits.h"
#include "cpp/cpu/query_rows.h"
#include "cpp/cpu/row_as_float.h"
#include "cpp/cpu/tile_shape.h"

namespace te_jax::cpu {

// out[d][r] = factor * (tile row r of `tensor`, [B, Sq, H, dim])[d], zero in the lanes past the tile's rows: the B
// operand of the key-major score products.
template <typename T>
void PackTransposed(const T* tensor, const QueryRows<kTileQ>& tile, const AttentionParams& p, int64_t dim,
                    int64_t lanes, float factor, float* out) {
  float converted[kMaxHeadDim];
  for (int64_t r = 0; r < lanes; ++r) {
    const float* row = converted;  // float32 rows are read where they lie
    if (r >= tile.rows) {
      std::fill(converted, converted + dim, 0.0f);
    } else if constexpr (std::is_same_v<T, float>) {
      row = tensor + tile.TensorRow(r, p.seqlen_q, p.num_heads) * dim;
    } else {
      RowAsFloat(tensor + tile.TensorRow(r, p.seqlen_q, p.num_heads) * dim, dim, converted);
    }
    for (int64_t d = 0; d < dim; ++d) out[d * kTileQ + r] = factor * row[d];
  }
}

}  // namespace te_jax::cpu
