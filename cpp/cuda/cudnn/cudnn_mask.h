// te_jax's masks and windows as the cuDNN frontend's SDPA mask attributes.
//
// The frontend's semantics (cudnn_frontend/utils/attn_score_modifiers.h, sliding_window_mask, and
// node/diagonal_band_mask.h; docs/operations/Attention.md), for query row i and key column j, with
// p = i for TOP_LEFT alignment and p = i + s_kv - s_q for BOTTOM_RIGHT (s_q, s_kv: the seq_len_q / seq_len_kv tensors'
// per-batch values when a padding mask binds them, else the graph's dims):
//   right_bound R (>= 0): j is kept iff p + R >= j              ("masks columns beyond row_idx + right_bound")
//   left_bound  L (> 0):  j is kept iff j + L > p, i.e. j >= p - L + 1   ("masks columns at or before row - L")
//   padding mask:         rows i >= s_q[b] and keys j >= s_kv[b] are masked.
// te_jax's (cpp/core/visible_keys.h): with p_i = i (+ skv_b - sq_b for the bottom-right masks), key j is visible iff
// j < skv_b, j <= p_i for the causal masks, and p_i - window_left <= j <= p_i + window_right. Both use the per-batch
// lengths for the bottom-right shift when there is a padding mask and the full lengths otherwise, so the mapping is
// exact: R = 0 for the causal masks (a right window cannot widen a causal row, and min(0, right) = 0), R = right for
// a window on a non-causal mask, L = left + 1, alignment BOTTOM_RIGHT exactly for te_jax's bottom-right masks.
#pragma once

#include <cstdint>
#include <optional>

#include "cpp/core/attention_params.h"

namespace te_jax::cuda::cudnn {

struct CudnnMask {
  bool padding = false;       // bind q_seqlens / kv_seqlens as cuDNN's seq_len_q / seq_len_kv
  bool bottom_right = false;  // diagonal alignment (matters only with a bound)
  std::optional<int64_t> left_bound;
  std::optional<int64_t> right_bound;
};

// Bounds that cannot mask anything for these lengths are left out, so a window wider than the sequences costs
// nothing and does not meet the frontend's restrictions on bounds.
CudnnMask CudnnMaskFor(const AttentionParams& params);

}  // namespace te_jax::cuda::cudnn
