#include "cpp/cpu/softmax_backward.h"

#include "cpp/cpu/fast_exp2.h"
#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_f32x8.h"

namespace te_jax::cpu {
namespace {

inline void RecomputeProbabilitiesBody(const float* scores, const float* lse2, int64_t row_stride, int64_t keys,
                                       int64_t lanes, float* probs) {
  for (int64_t c = 0; c < keys; ++c) {
    for (int64_t r = 0; r < lanes; r += kLanes) {
      Store(probs + c * row_stride + r, Exp2(Load(scores + c * row_stride + r) - Load(lse2 + r)));
    }
  }
}

inline void SoftmaxGradientBody(const float* probs, const float* delta, float factor, int64_t row_stride,
                                int64_t keys, int64_t lanes, float* dprobs) {
  for (int64_t c = 0; c < keys; ++c) {
    for (int64_t r = 0; r < lanes; r += kLanes) {
      const int64_t at = c * row_stride + r;
      Store(dprobs + at, factor * Load(probs + at) * (Load(dprobs + at) - Load(delta + r)));
    }
  }
}

}  // namespace

void RecomputeProbabilities(const float* scores, const float* lse2, int64_t row_stride, int64_t keys, int64_t lanes,
                            float* probs) {
  RunWithBestIsa<&RecomputeProbabilitiesBody>(scores, lse2, row_stride, keys, lanes, probs);
}

void SoftmaxGradient(const float* probs, const float* delta, float factor, int64_t row_stride, int64_t keys,
                     int64_t lanes, float* dprobs) {
  RunWithBestIsa<&SoftmaxGradientBody>(probs, delta, factor, row_stride, keys, lanes, dprobs);
}

}  // namespace te_jax::cpu
