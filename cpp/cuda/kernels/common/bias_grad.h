// Where the dk/dv kernels of both families put the gradient of the additive bias: dbias itself where no dim of the
// bias is broadcast (each element written once, by the CTA that owns its key), else a float accumulator of the bias's
// shape (float atomics) that the last kernel converts (backward_row_kernels.cuh).
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/bias_element.h"

namespace te_jax::cuda {

// Where the dk/dv kernel's dS goes for dbias (BackwardArgs): the bias's strides from one (batch, head), and either the
// float accumulator (some dim of dbias is summed) or dbias itself (each element one (b, h, i, j), written once).
template <typename Bias>
struct BiasGradTarget {
  using Element = BiasElementOf<Bias>;
  void* dbias;
  float* accum;
  int64_t offset;
  int32_t query_stride;
  int32_t key_stride;

  static __device__ __forceinline__ BiasGradTarget Of(const BackwardArgs& a, int b, int h) {
    return {a.dbias, a.dbias_accum, b * a.bias.batch_stride + h * a.bias.head_stride, a.bias.query_stride,
            a.bias.key_stride};
  }

  __device__ __forceinline__ int64_t At(int i, int j) const {
    return offset + static_cast<int64_t>(i) * query_stride + static_cast<int64_t>(j) * key_stride;
  }

  // Adds x to element `at` (a batch with invalid lengths adds NaN, as its other gradients are NaN).
  __device__ __forceinline__ void Add(int64_t at, float x, bool invalid) const {
    if (invalid) x = __int_as_float(0x7fffffff);
    if (accum != nullptr) {
      asm volatile("red.global.add.f32 [%0], %1;" ::"l"(accum + at), "f"(x) : "memory");
    } else {
      Element::StoreGlobal(static_cast<typename Element::Storage*>(dbias) + at, x);
    }
  }
};

// Writing dbias directly, the dk/dv CTA also writes the zeros of the pairs its steps never visit: for its keys, the
// query rows of each head outside the rows [visited_begin, visited_end) its steps visit. Each element of dbias is then
// written once, by the CTA that owns its key.
template <typename Bias, int kKeys, int kThreads>
__device__ __forceinline__ void ZeroUnvisitedBiasGrad(const BiasGradTarget<Bias>& target, int visited_begin,
                                                      int visited_end, int n0, int seqlen_q, int seqlen_kv,
                                                      bool invalid, int tid) {
  constexpr int kRowStep = kThreads / kKeys;
  const int key = tid % kKeys;
  if (n0 + key >= seqlen_kv) return;
  auto zero_rows = [&](int begin, int end) {
    for (int i = begin + tid / kKeys; i < end; i += kRowStep) target.Add(target.At(i, n0 + key), 0.0f, invalid);
  };
  zero_rows(0, min(visited_begin, seqlen_q));
  zero_rows(visited_end, seqlen_q);
}

}  // namespace te_jax::cuda
