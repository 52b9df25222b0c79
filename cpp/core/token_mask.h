// Packed sequences: per-token segment ids and positions, and which (query, key) pairs they leave visible.
// A query i sees key j when
//   * with segment ids: q_ids[i] != 0 and kv_ids[j] == q_ids[i] (id 0 is padding: it sees nothing and nobody sees it);
//   * with positions: lo_i <= kv_pos[j] <= hi_i, where [lo_i, hi_i] is the query's window around its position
//     (causal: hi_i <= q_pos[i]; window (l, r): q_pos[i] - l <= kv_pos[j] <= q_pos[i] + r).
// Without positions the causal mask and window stay index-based (visible_keys.h's contiguous range); with positions
// that range is the whole key axis and these bounds replace it. Either way the two tests are ANDed per element, so
// visibility is no longer one contiguous range per row: backends skip tiles by bounds on ids and positions instead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

namespace te_jax {

// The inclusive kv-position bounds of one query row; empty when lo > hi.
struct PositionBounds {
  int32_t lo;
  int32_t hi;
};

struct TokenMask {
  const int32_t* q_ids = nullptr;   // this batch entry's [Sq]; null: no segment ids
  const int32_t* kv_ids = nullptr;  // [Skv]
  const int32_t* q_pos = nullptr;   // [Sq]; null: no positions
  const int32_t* kv_pos = nullptr;  // [Skv]
  bool causal = false;              // read only with positions
  int64_t window_left = -1;
  int64_t window_right = -1;

  bool active() const { return q_ids != nullptr || q_pos != nullptr; }
  bool has_ids() const { return q_ids != nullptr; }
  bool has_positions() const { return q_pos != nullptr; }

  // Whether query row i can see any key at all (id 0 rows cannot).
  bool RowLive(int64_t i) const { return q_ids == nullptr || q_ids[i] != 0; }

  // Clamped to int32, so a window of 2^31 - 1 around any position stays a plain comparison.
  PositionBounds Bounds(int64_t i) const {
    constexpr int64_t kMin = std::numeric_limits<int32_t>::min(), kMax = std::numeric_limits<int32_t>::max();
    if (q_pos == nullptr) return {static_cast<int32_t>(kMin), static_cast<int32_t>(kMax)};
    const int64_t p = q_pos[i];
    int64_t lo = window_left >= 0 ? p - window_left : kMin;
    int64_t hi = window_right >= 0 ? p + window_right : kMax;
    if (causal) hi = std::min(hi, p);
    return {static_cast<int32_t>(std::clamp(lo, kMin, kMax)), static_cast<int32_t>(std::clamp(hi, kMin, kMax))};
  }

  // The per-element test (the index-based range of visible_keys.h is tested apart).
  bool Sees(int64_t i, int64_t j) const {
    if (q_ids != nullptr && (q_ids[i] == 0 || kv_ids[j] != q_ids[i])) return false;
    if (q_pos != nullptr) {
      const PositionBounds b = Bounds(i);
      if (kv_pos[j] < b.lo || kv_pos[j] > b.hi) return false;
    }
    return true;
  }
};

// Batch entry b's token mask. With positions, the causal flag and the window move here from the index-based RowMask
// (MakeRowMask is then called without them: see IndexMaskType).
inline TokenMask MakeTokenMask(bool has_segment_ids, bool has_positions, const int32_t* q_ids, const int32_t* kv_ids,
                               const int32_t* q_pos, const int32_t* kv_pos, int64_t seqlen_q, int64_t seqlen_kv,
                               bool causal, int64_t window_left, int64_t window_right, int64_t b) {
  TokenMask m;
  if (has_segment_ids) {
    m.q_ids = q_ids + b * seqlen_q;
    m.kv_ids = kv_ids + b * seqlen_kv;
  }
  if (has_positions) {
    m.q_pos = q_pos + b * seqlen_q;
    m.kv_pos = kv_pos + b * seqlen_kv;
    m.causal = causal;
    m.window_left = window_left;
    m.window_right = window_right;
  }
  return m;
}

}  // namespace te_jax
