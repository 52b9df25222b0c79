#include "cpp/cpu/softmax_backward.h"

#include "cpp/cpu/fast_exp2.h"
#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_vector.h"

namespace te_jax::cpu {
namespace {

// Lane-wise at either width (one lane, one row), so the same bits.
template <typename V>
inline void RecomputeProbabilitiesBody(const float* scores, const float* lse2, int64_t row_stride, int64_t keys,
                                       int64_t lanes, float* probs) {
  for (int64_t c = 0; c < keys; ++c) {
    ForEachLaneVector<V>(lanes, [&](auto lane_vector, int64_t r) {
      using Vec = Vector<decltype(lane_vector)>;
      Vec::Store(probs + c * row_stride + r, Exp2(Vec::Load(scores + c * row_stride + r) - Vec::Load(lse2 + r)));
    });
  }
}

template <typename V>
inline void SoftmaxGradientBody(const float* probs, const float* delta, float factor, int64_t row_stride, int64_t keys,
                                int64_t lanes, float* dprobs) {
  for (int64_t c = 0; c < keys; ++c) {
    ForEachLaneVector<V>(lanes, [&](auto lane_vector, int64_t r) {
      using Vec = Vector<decltype(lane_vector)>;
      const int64_t at = c * row_stride + r;
      Vec::Store(dprobs + at, factor * Vec::Load(probs + at) * (Vec::Load(dprobs + at) - Vec::Load(delta + r)));
    });
  }
}

}  // namespace

void RecomputeProbabilities(const float* scores, const float* lse2, int64_t row_stride, int64_t keys, int64_t lanes,
                            float* probs) {
  RunWithWidestVectors<&RecomputeProbabilitiesBody<F32x8>, &RecomputeProbabilitiesBody<F32x16>>(
      scores, lse2, row_stride, keys, lanes, probs);
}

void SoftmaxGradient(const float* probs, const float* delta, float factor, int64_t row_stride, int64_t keys,
                     int64_t lanes, float* dprobs) {
  RunWithWidestVectors<&SoftmaxGradientBody<F32x8>, &SoftmaxGradientBody<F32x16>>(probs, delta, factor, row_stride,
                                                                                  keys, lanes, dprobs);
}

}  // namespace te_jax::cpu
