// The additive logit bias: an operand [B or 1, H or 1, Sq or 1, Skv or 1] whose size-1 dims broadcast.
// AttentionParams::bias_broadcast holds one bit per dim (set: that dim is 1), so both entry paths describe the operand
// with one byte and the backends index it through BiasLayout's strides (0 along a broadcast dim).
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"

namespace te_jax {

inline constexpr uint8_t kBroadcastBatch = 1 << 0;
inline constexpr uint8_t kBroadcastHeads = 1 << 1;
inline constexpr uint8_t kBroadcastQuery = 1 << 2;
inline constexpr uint8_t kBroadcastKey = 1 << 3;
inline constexpr uint8_t kBroadcastAll = kBroadcastBatch | kBroadcastHeads | kBroadcastQuery | kBroadcastKey;

// The bias operand's shape and its element strides as seen from the full [B, H, Sq, Skv].
struct BiasLayout {
  int64_t dims[4];
  int64_t batch_stride, head_stride, query_stride, key_stride;

  int64_t elements() const { return dims[0] * dims[1] * dims[2] * dims[3]; }
  int64_t Offset(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return b * batch_stride + h * head_stride + i * query_stride + j * key_stride;
  }
};

inline BiasLayout MakeBiasLayout(const AttentionParams& p) {
  const uint8_t bits = p.bias_broadcast;
  BiasLayout l;
  l.dims[0] = bits & kBroadcastBatch ? 1 : p.batch;
  l.dims[1] = bits & kBroadcastHeads ? 1 : p.num_heads;
  l.dims[2] = bits & kBroadcastQuery ? 1 : p.seqlen_q;
  l.dims[3] = bits & kBroadcastKey ? 1 : p.seqlen_kv;
  const int64_t row = l.dims[3], plane = l.dims[2] * row, head = l.dims[1] * plane;
  l.key_stride = bits & kBroadcastKey ? 0 : 1;
  l.query_stride = bits & kBroadcastQuery ? 0 : row;
  l.head_stride = bits & kBroadcastHeads ? 0 : plane;
  l.batch_stride = bits & kBroadcastBatch ? 0 : head;
  return l;
}

// Whether dbias sums over some dim: one the bias broadcasts over whose full extent is more than 1, so that several
// logits share a bias element. Otherwise each element of dbias is the gradient of exactly one logit.
inline bool BiasGradientSums(const AttentionParams& p) {
  const uint8_t bits = p.bias_broadcast;
  return ((bits & kBroadcastBatch) && p.batch > 1) || ((bits & kBroadcastHeads) && p.num_heads > 1) ||
         ((bits & kBroadcastQuery) && p.seqlen_q > 1) || ((bits & kBroadcastKey) && p.seqlen_kv > 1);
}

}  // namespace te_jax
