// Whether a float32 tile holds only finite values: the kernels' products add 0 x x for the pairs a row does not see,
// which a NaN or inf x turns into NaN, so a tile with masked pairs and a non-finite operand takes a careful path that
// skips those pairs (attention_forward.cc's P V, attention_backward.cc's five products).
#pragma once

#include <cmath>
#include <cstdint>

#include "cpp/cpu/tile_gemm.h"

namespace te_jax::cpu {

inline bool AllFinite(const MatrixB& tile, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      if (!std::isfinite(tile.data[i * tile.row_stride + j])) return false;
    }
  }
  return true;
}

}  // namespace te_jax::cpu
