// The elementwise steps of the attention backward on a key-major tile (tile[key][row], rows are the vector lanes):
// recomputing P from the saved log-sum-exp, and turning dP into dS. lanes is a multiple of kLanes.
#pragma once

#include <cstdint>

namespace te_jax::cpu {

// probs = 2^(scores - lse2[row]), scores and lse2 in log2 units; -inf scores (masked) give exactly 0.
void RecomputeProbabilities(const float* scores, const float* lse2, int64_t row_stride, int64_t keys, int64_t lanes,
                            float* probs);

// In place: dprobs becomes factor * probs * (dprobs - delta[row]), the softmax backward times a constant d logit/d dot.
void SoftmaxGradient(const float* probs, const float* delta, float factor, int64_t row_stride, int64_t keys,
                     int64_t lanes, float* dprobs);

}  // namespace te_jax::cpu
