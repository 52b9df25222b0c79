#include "cpp/cpu/online_softmax.h"

#include "cpp/cpu/fast_exp2.h"
#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_vector.h"

namespace te_jax::cpu {
namespace {

// Each lane is one row and goes through the same operations in the same order at either width: the same bits.
template <typename V>
inline void OnlineSoftmaxUpdateBody(float* scores, int64_t row_stride, int64_t keys, int64_t lanes, float* max,
                                    float* sum, float* rescale) {
  ForEachLaneVector<V>(lanes, [&](auto lane_vector, int64_t r) {
    using W = decltype(lane_vector);
    using Vec = Vector<W>;
    const W old_max = Vec::Load(max + r);
    W new_max = old_max;
    for (int64_t c = 0; c < keys; ++c) new_max = Max(new_max, Vec::Load(scores + c * row_stride + r));
    // A row that has seen no visible key yet subtracts 0 instead of -inf, so its probabilities are 2^-inf = 0, not NaN.
    const W shift = new_max == -__builtin_inff() ? W{} : new_max;
    W tile_sum{};
    for (int64_t c = 0; c < keys; ++c) {
      const W p = Exp2(Vec::Load(scores + c * row_stride + r) - shift);
      Vec::Store(scores + c * row_stride + r, p);
      tile_sum += p;
    }
    const W alpha = Exp2(old_max - shift);
    Vec::Store(rescale + r, alpha);
    Vec::Store(sum + r, Vec::Load(sum + r) * alpha + tile_sum);
    Vec::Store(max + r, new_max);
  });
}

}  // namespace

void OnlineSoftmaxUpdate(float* scores, int64_t row_stride, int64_t keys, int64_t lanes, float* max, float* sum,
                         float* rescale) {
  RunWithWidestVectors<&OnlineSoftmaxUpdateBody<F32x8>, &OnlineSoftmaxUpdateBody<F32x16>>(scores, row_stride, keys,
                                                                                          lanes, max, sum, rescale);
}

}  // namespace te_jax::cpu
