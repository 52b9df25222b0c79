// The visible keys of a tile of query rows, from the per-row ranges of visible_keys.h. Tiles of keys outside the
// union are never touched, tiles inside the common part take the unmasked path, and only the tiles straddling a
// row's range boundary pay for a per-element mask.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpp/cpu/simd_f32x8.h"
#include "cpp/visible_keys.h"

namespace te_jax::cpu {

template <int64_t kRows>
struct TileKeyRanges {
  // Per row, as int32 lanes for the vector mask; lanes past the tile's rows see nothing.
  alignas(32) int32_t begin[kRows];
  alignas(32) int32_t end[kRows];
  KeyRange any;  // keys at least one row sees
  KeyRange all;  // keys every row sees

  // Rows [first_row, first_row + rows) of `mask`.
  void Compute(const RowMask& mask, int64_t first_row, int64_t rows) {
    any = {mask.kv_len, 0};
    all = {0, mask.kv_len};
    for (int64_t r = 0; r < kRows; ++r) {
      KeyRange keys = r < rows ? mask.Keys(first_row + r) : KeyRange{0, 0};
      if (keys.end <= keys.begin) keys = {0, 0};
      begin[r] = static_cast<int32_t>(keys.begin);
      end[r] = static_cast<int32_t>(keys.end);
      if (r >= rows) continue;
      if (keys.begin < keys.end) {
        any.begin = std::min(any.begin, keys.begin);
        any.end = std::max(any.end, keys.end);
      }
      all.begin = std::max(all.begin, keys.begin);
      all.end = std::min(all.end, keys.end);
    }
  }

  bool AllSee(int64_t key_begin, int64_t key_end) const { return key_begin >= all.begin && key_end <= all.end; }

  // Sets the scores of invisible (key, row) pairs of a key-major tile scores[key][row] to -inf.
  void MaskScores(float* scores, int64_t row_stride, int64_t first_key, int64_t keys, int64_t lanes) const {
    const F32x8 minus_inf = Splat(-__builtin_inff());
    for (int64_t c = 0; c < keys; ++c) {
      const I32x8 key = Splat(static_cast<int32_t>(first_key + c));
      float* row = scores + c * row_stride;
      for (int64_t r = 0; r < lanes; r += kLanes) {
        const I32x8 visible = (key >= Load(begin + r)) & (key < Load(end + r));
        Store(row + r, visible ? Load(row + r) : minus_inf);
      }
    }
  }
};

}  // namespace te_jax::cpu
