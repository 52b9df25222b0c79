// One batch entry's masks: the index ranges (causal, window, lengths) and the segment ids and positions.
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"
#include "cpp/core/token_mask.h"
#include "cpp/core/visible_keys.h"

namespace te_jax::cpu {

// The index-based part of the mask. With positions the causal diagonal and the window are TokenMask's, by position,
// so the index range is the whole (unpadded: positions never come with padding masks) key axis.
inline RowMask BatchMask(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens,
                         int64_t b) {
  // Positions go with the masks without lengths (validate.cc): their causal mask and window are the tokens'.
  if (p.has_positions) return MakeRowMask(MaskType::kNoMask, p.seqlen_q, p.seqlen_kv, -1, -1);
  const bool lengths = IsPadding(p.mask_type);
  return MakeRowMask(p.mask_type, q_seqlens != nullptr ? q_seqlens[b] : p.seqlen_q,
                     lengths ? kv_seqlens[b] : p.seqlen_kv, p.window_left, p.window_right);
}

// The segment ids and positions of one call; BatchTokens gives batch entry b's TokenMask (inactive without them).
struct TokenOperands {
  const int32_t* q_ids;
  const int32_t* kv_ids;
  const int32_t* q_pos;
  const int32_t* kv_pos;
};

inline TokenOperands TokenOperandsOf(const AttentionOperands& o) {
  return {o.q_segment_ids, o.kv_segment_ids, o.q_positions, o.kv_positions};
}

inline TokenMask BatchTokens(const AttentionParams& p, const TokenOperands& t, int64_t b) {
  return MakeTokenMask(p.has_segment_ids, p.has_positions, t.q_ids, t.kv_ids, t.q_pos, t.kv_pos, p.seqlen_q,
                       p.seqlen_kv, IsCausal(p.mask_type), p.window_left, p.window_right, b);
}

}  // namespace te_jax::cpu
