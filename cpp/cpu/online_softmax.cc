#include "cpp/cpu/online_softmax.h"

#include "cpp/cpu/fast_exp2.h"
#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_f32x8.h"

namespace te_jax::cpu {
namespace {

inline void OnlineSoftmaxUpdateBody(float* scores, int64_t row_stride, int64_t keys, int64_t lanes, float* max,
                                    float* sum, float* rescale) {
  for (int64_t r = 0; r < lanes; r += kLanes) {
    const F32x8 old_max = Load(max + r);
    F32x8 new_max = old_max;
    for (int64_t c = 0; c < keys; ++c) new_max = Max(new_max, Load(scores + c * row_stride + r));
    // A row that has seen no visible key yet subtracts 0 instead of -inf, so its probabilities are 2^-inf = 0, not NaN.
    const F32x8 shift = new_max == -__builtin_inff() ? F32x8{} : new_max;
    F32x8 tile_sum{};
    for (int64_t c = 0; c < keys; ++c) {
      const F32x8 p = Exp2(Load(scores + c * row_stride + r) - shift);
      Store(scores + c * row_stride + r, p);
      tile_sum += p;
    }
    const F32x8 alpha = Exp2(old_max - shift);
    Store(rescale + r, alpha);
    Store(sum + r, Load(sum + r) * alpha + tile_sum);
    Store(max + r, new_max);
  }
}

}  // namespace

void OnlineSoftmaxUpdate(float* scores, int64_t row_stride, int64_t keys, int64_t lanes, float* max, float* sum,
                         float* rescale) {
  RunWithBestIsa<&OnlineSoftmaxUpdateBody>(scores, row_stride, keys, lanes, max, sum, rescale);
}

}  // namespace te_jax::cpu
