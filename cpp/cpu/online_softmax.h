// FlashAttention's online softmax over the key tiles of one query tile, in log2 units so that each probability costs
// one exp2. The score tile is key-major (scores[key][row]): query rows are the vector lanes, so the row max and the
// row sum run down the keys lane-wise and never need a horizontal reduction.
#pragma once

#include <cstdint>

namespace te_jax::cpu {

// Replaces scores (log2 units, -inf where masked) by 2^(score - new row max), updates the running max and sum of the
// first `lanes` rows and writes the factor each row's output accumulator must be scaled by before the tile's P V is
// added. lanes is a multiple of kLanes.
void OnlineSoftmaxUpdate(float* scores, int64_t row_stride, int64_t keys, int64_t lanes, float* max, float* sum,
                         float* rescale);

template <int64_t kRows>
struct OnlineSoftmax {
  alignas(32) float max[kRows];  // running row max, log2 units; -inf until the row has seen a key
  alignas(32) float sum[kRows];  // running sum of 2^(score - max)

  void Reset() {
    for (int64_t r = 0; r < kRows; ++r) {
      max[r] = -__builtin_inff();
      sum[r] = 0.0f;
    }
  }

  void Update(float* scores, int64_t row_stride, int64_t keys, int64_t lanes, float* rescale) {
    OnlineSoftmaxUpdate(scores, row_stride, keys, lanes, max, sum, rescale);
  }
};

}  // namespace te_jax::cpu
