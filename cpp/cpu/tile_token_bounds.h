// Bounds on the segment ids and positions of a tile of keys or of query rows (cpp/core/token_mask.h), so a (query tile,
// key tile) pair can be classified without touching its elements: no pair visible (skip the tile, never load it),
// every pair visible (the unmasked path) or some (the per-element mask). Packed rows hold sorted ids, so a tile's
// [min, max] id range is tight and only tiles at document edges straddle; unsorted ids or positions only make the
// bounds conservative (more tiles masked element by element), never wrong.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cpp/core/token_mask.h"

namespace te_jax::cpu {

inline constexpr int32_t kInt32Min = std::numeric_limits<int32_t>::min();
inline constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

// The keys [first, first + n) of one batch entry, id-0 keys left out (nobody sees them).
struct KeyTokenBounds {
  int32_t id_min = kInt32Max, id_max = kInt32Min;
  int32_t pos_min = kInt32Max, pos_max = kInt32Min;
  bool any = false;       // some key can be seen by someone
  bool complete = true;   // every key of the tile counts (none has id 0)

  void Compute(const TokenMask& m, int64_t first, int64_t n) {
    *this = KeyTokenBounds{};
    for (int64_t j = first; j < first + n; ++j) {
      if (m.has_ids()) {
        const int32_t id = m.kv_ids[j];
        if (id == 0) {
          complete = false;
          continue;
        }
        id_min = std::min(id_min, id);
        id_max = std::max(id_max, id);
      }
      if (m.has_positions()) {
        pos_min = std::min(pos_min, m.kv_pos[j]);
        pos_max = std::max(pos_max, m.kv_pos[j]);
      }
      any = true;
    }
  }
};

// Query rows of one tile, id-0 rows left out (they see nothing): their ids and the kv-position bounds of each row.
struct RowTokenBounds {
  int32_t id_min = kInt32Max, id_max = kInt32Min;
  int32_t lo_min = kInt32Max, lo_max = kInt32Min;  // over the rows' lower kv-position bounds
  int32_t hi_min = kInt32Max, hi_max = kInt32Min;  // over their upper bounds
  bool any = false;
  bool complete = true;

  void Add(int32_t id, PositionBounds b, bool live) {
    if (!live) {
      complete = false;
      return;
    }
    id_min = std::min(id_min, id);
    id_max = std::max(id_max, id);
    lo_min = std::min(lo_min, b.lo);
    lo_max = std::max(lo_max, b.lo);
    hi_min = std::min(hi_min, b.hi);
    hi_max = std::max(hi_max, b.hi);
    any = true;
  }
};

// Whether some row may see some key: the id ranges meet and some key position lies in some row's bounds' hull.
// ids / positions: whether the call has them.
inline bool MayMeet(bool ids, bool positions, const RowTokenBounds& rows, const KeyTokenBounds& keys) {
  if (!rows.any || !keys.any) return false;
  if (ids && (keys.id_max < rows.id_min || rows.id_max < keys.id_min)) return false;
  if (positions && (keys.pos_min > rows.hi_max || keys.pos_max < rows.lo_min)) return false;
  return true;
}

// Whether every row sees every key as far as ids and positions go: one id on both sides, and every key position
// inside every row's bounds.
inline bool AllMeet(bool ids, bool positions, const RowTokenBounds& rows, const KeyTokenBounds& keys) {
  if (!rows.any || !keys.any || !rows.complete || !keys.complete) return false;
  if (ids && !(rows.id_min == rows.id_max && keys.id_min == keys.id_max && rows.id_min == keys.id_min)) {
    return false;
  }
  if (positions && !(keys.pos_min >= rows.lo_max && keys.pos_max <= rows.hi_min)) return false;
  return true;
}

}  // namespace te_jax::cpu
