// The visible keys of a tile of query rows, from the per-row ranges of visible_keys.h and, for packed sequences, the
// segment ids and positions of token_mask.h. Tiles of keys outside the union are never touched, tiles inside the
// common part take the unmasked path, and only the tiles straddling a row's boundary pay for a per-element mask.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpp/core/token_mask.h"
#include "cpp/core/visible_keys.h"
#include "cpp/cpu/simd_f32x8.h"
#include "cpp/cpu/tile_token_bounds.h"

namespace te_jax::cpu {

template <int64_t kRows>
struct TileKeyRanges {
  // Per row, as int32 lanes for the vector mask; lanes past the tile's rows (and id-0 rows) see nothing.
  alignas(32) int32_t begin[kRows];
  alignas(32) int32_t end[kRows];
  // With a token mask: each row's segment id and inclusive kv-position bounds, and whether it has seen a key yet
  // (packed rows can have a non-empty index range and still see nothing, so MaskScores records what it lets through).
  alignas(32) int32_t segment[kRows];
  alignas(32) int32_t pos_lo[kRows];
  alignas(32) int32_t pos_hi[kRows];
  alignas(32) int32_t seen[kRows];
  KeyRange any;  // keys at least one row sees
  KeyRange all;  // keys every row sees
  TokenMask tokens;
  RowTokenBounds token_rows;

  // Rows [first_row, first_row + rows) of `mask` and `token_mask`.
  void Compute(const RowMask& mask, const TokenMask& token_mask, int64_t first_row, int64_t rows) {
    int32_t positions[kRows];
    for (int64_t r = 0; r < rows; ++r) positions[r] = static_cast<int32_t>(first_row + r);
    Compute(mask, token_mask, positions, rows);
  }

  // Rows that are queries positions[0 .. rows - 1] of `mask` and `token_mask` (a packed tile's rows: query_rows.h).
  void Compute(const RowMask& mask, const TokenMask& token_mask, const int32_t* positions, int64_t rows) {
    tokens = token_mask;
    token_rows = RowTokenBounds{};
    any = {mask.kv_len, 0};
    all = {0, mask.kv_len};
    for (int64_t r = 0; r < kRows; ++r) {
      const int64_t i = r < rows ? positions[r] : 0;
      const bool live = r < rows && tokens.RowLive(i);
      KeyRange keys = live ? mask.Keys(i) : KeyRange{0, 0};
      if (keys.end <= keys.begin) keys = {0, 0};
      begin[r] = static_cast<int32_t>(keys.begin);
      end[r] = static_cast<int32_t>(keys.end);
      seen[r] = 0;
      const PositionBounds bounds = r < rows ? tokens.Bounds(i) : PositionBounds{0, -1};
      segment[r] = r < rows && tokens.has_ids() ? tokens.q_ids[i] : 0;
      pos_lo[r] = bounds.lo;
      pos_hi[r] = bounds.hi;
      if (r >= rows) continue;
      token_rows.Add(segment[r], bounds, live && keys.begin < keys.end);
      if (keys.begin < keys.end) {
        any.begin = std::min(any.begin, keys.begin);
        any.end = std::max(any.end, keys.end);
      }
      all.begin = std::max(all.begin, keys.begin);
      all.end = std::min(all.end, keys.end);
    }
  }

  void Compute(const RowMask& mask, int64_t first_row, int64_t rows) { Compute(mask, TokenMask{}, first_row, rows); }

  // Whether some row may see some of the keys `key_tokens` describes (always, without a token mask).
  bool MayMeet(const KeyTokenBounds& key_tokens) const {
    return !tokens.active() || cpu::MayMeet(tokens.has_ids(), tokens.has_positions(), token_rows, key_tokens);
  }

  bool AllSee(int64_t key_begin, int64_t key_end) const { return key_begin >= all.begin && key_end <= all.end; }
  bool AllSee(int64_t key_begin, int64_t key_end, const KeyTokenBounds& key_tokens) const {
    return AllSee(key_begin, key_end) &&
           (!tokens.active() || AllMeet(tokens.has_ids(), tokens.has_positions(), token_rows, key_tokens));
  }

  // Narrows the keys [*key_begin, *key_end) of a masked tile to those some row may see, by the rows' id and position
  // bounds: with positions the index range is the whole key axis, so without this the tile at a document's causal
  // edge would carry its invisible tail through both products (a scan of the keys, a few percent of the products).
  void TrimKeys(int64_t* key_begin, int64_t* key_end) const {
    auto may_see = [&](int64_t key) {
      if (key < any.begin || key >= any.end) return false;
      if (tokens.has_ids() && (tokens.kv_ids[key] < token_rows.id_min || tokens.kv_ids[key] > token_rows.id_max)) {
        return false;
      }
      return !tokens.has_positions() ||
             (tokens.kv_pos[key] >= token_rows.lo_min && tokens.kv_pos[key] <= token_rows.hi_max);
    };
    while (*key_begin < *key_end && !may_see(*key_end - 1)) --*key_end;
    while (*key_begin < *key_end && !may_see(*key_begin)) ++*key_begin;
  }

  // After an unmasked tile: every row of the tile has seen a key.
  void MarkAllSeen(int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) seen[r] = -1;
  }

  // Whether row r has a visible key (after the pass over the key tiles, with a token mask).
  bool RowSeesKeys(int64_t r) const { return tokens.active() ? seen[r] != 0 : begin[r] < end[r]; }

  // The per-element test, for the rare scalar paths.
  bool Sees(int64_t r, int64_t key) const {
    if (key < begin[r] || key >= end[r]) return false;
    if (tokens.has_ids() && tokens.kv_ids[key] != segment[r]) return false;
    if (tokens.has_positions() && (tokens.kv_pos[key] < pos_lo[r] || tokens.kv_pos[key] > pos_hi[r])) return false;
    return true;
  }

  // Sets the scores of invisible (key, row) pairs of a key-major tile scores[key][row] to -inf (a select, never an
  // addition, so a NaN or inf score of an invisible pair cannot leak into the row).
  void MaskScores(float* scores, int64_t row_stride, int64_t first_key, int64_t keys, int64_t lanes) {
    const F32x8 minus_inf = Splat(-__builtin_inff());
    for (int64_t c = 0; c < keys; ++c) {
      const int64_t key = first_key + c;
      const I32x8 key_index = Splat(static_cast<int32_t>(key));
      const I32x8 key_id = Splat(tokens.has_ids() ? tokens.kv_ids[key] : 0);
      const I32x8 key_pos = Splat(tokens.has_positions() ? tokens.kv_pos[key] : 0);
      float* row = scores + c * row_stride;
      for (int64_t r = 0; r < lanes; r += kLanes) {
        I32x8 visible = (key_index >= Load(begin + r)) & (key_index < Load(end + r));
        if (tokens.has_ids()) visible &= key_id == Load(segment + r);
        if (tokens.has_positions()) visible &= (key_pos >= Load(pos_lo + r)) & (key_pos <= Load(pos_hi + r));
        Store(row + r, visible ? Load(row + r) : minus_inf);
        StoreI(seen + r, Load(seen + r) | visible);
      }
    }
  }
};

}  // namespace te_jax::cpu
