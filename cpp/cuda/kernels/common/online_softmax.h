// Online softmax over key tiles for the two rows (g and g + 8) a thread holds in the m16n8 accumulator layout. Row
// maxima are shared by the four threads of a quad; row sums stay per-thread partials until Finish, as in
// FlashAttention-2. The scores arrive unscaled: a score x stands for the logit x * log2_scale in log2 units (log2_scale > 0,
// e.g. softmax scale * log2 e), so the row max is taken on the raw scores and each probability is one FFMA and one ex2,
// exp2(x * log2_scale - max). The running max is kept in log2 units. Rows that have seen no visible key (x = -inf) keep
// max = -inf; they contribute p = 0 and end with l = 0, which Finish turns into out = 0, lse = -inf.
#pragma once

#include "cpp/core/host_device.h"
#include "cpp/core/sink.h"

namespace te_jax::cuda {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float QuadMax(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, lanes));
  return x;
}

__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int lanes = 16; lanes > 0; lanes /= 2) x += __shfl_xor_sync(0xffffffffu, x, lanes);
  return x;
}

// 2^x with flush-to-zero (one MUFU.EX2); 2^-inf = +0. Arguments here are <= 0, so the flush only touches p < 2^-126.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kTiles>  // n8 tiles of logits held per thread
struct OnlineSoftmax {
  float max[2] = {-__int_as_float(0x7f800000), -__int_as_float(0x7f800000)};
  float sum[2] = {0.0f, 0.0f};

  __device__ __forceinline__ void Reset() {
    max[0] = max[1] = -__int_as_float(0x7f800000);
    sum[0] = sum[1] = 0.0f;
  }

  __device__ __forceinline__ bool AnyNaN() const { return sum[0] != sum[0] || sum[1] != sum[1]; }

  // Turns raw scores s (-inf where masked) into unnormalised probabilities in place and returns the factor each row's
  // running output must be rescaled by. log2_scale must be > 0 (the max of x * log2_scale is then max(x) * log2_scale).
  __device__ __forceinline__ void Update(float (&s)[kTiles][4], float log2_scale, float (&rescale)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float m = -__int_as_float(0x7f800000);
#pragma unroll
      for (int j = 0; j < kTiles; ++j) m = fmaxf(m, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      m = fmaxf(max[r], QuadMax(m) * log2_scale);
      const bool none = m == -__int_as_float(0x7f800000);
      const float base = none ? 0.0f : m;
      rescale[r] = none ? 1.0f : Exp2(max[r] - base);
      float partial = 0.0f;
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        s[j][2 * r] = Exp2(fmaf(s[j][2 * r], log2_scale, -base));
        s[j][2 * r + 1] = Exp2(fmaf(s[j][2 * r + 1], log2_scale, -base));
        partial += s[j][2 * r] + s[j][2 * r + 1];
      }
      sum[r] = sum[r] * rescale[r] + partial;
      max[r] = m;
    }
  }

  // After the last tile: 1 / rowsum and the natural-log lse. A row that sees no key gets 0 and -inf; a row that sees
  // keys follows IEEE arithmetic, so a NaN that reached its sum (through exp2 of a NaN logit; the max ignores NaN as
  // fmaxf does) gives NaN, and a sum of 0 (all its logits -inf, from inf inputs) gives lse = -inf and out = 0 * inf.
  __device__ __forceinline__ void Finish(const bool (&sees_keys)[2], float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = QuadSum(sum[r]);
      inv_sum[r] = sees_keys[r] ? 1.0f / l : 0.0f;
      lse[r] = sees_keys[r] ? max[r] * kLn2 + logf(l) : -__int_as_float(0x7f800000);
    }
  }

  // Finish where an additive bias can leave a row that sees keys no probability: every visible logit -inf (a -inf
  // bias used as a mask) makes its sum 0 (a NaN logit makes it NaN), and the row gets out = 0 and lse = -inf like a
  // row that sees no key; sees_keys says so afterwards.
  __device__ __forceinline__ void FinishWithBias(bool (&sees_keys)[2], float (&inv_sum)[2], float (&lse)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) sees_keys[r] = sees_keys[r] && QuadSum(sum[r]) != 0.0f;
    Finish(sees_keys, inv_sum, lse);
  }
};

// Attention sinks (cpp/core/sink.h): a call with sinks ([B, H], null without) merges its head's sink into the two finished
// rows of a thread, `head_at` = b * num_heads + head. A run-time test: the sink costs no kernel variant.
__device__ __forceinline__ void MergeRowSinks(const float* sinks, int64_t head_at, float (&inv_sum)[2],
                                              float (&lse)[2]) {
  if (sinks == nullptr) return;
  const float sink = sinks[head_at];
#pragma unroll
  for (int r = 0; r < 2; ++r) MergeSink(sink, lse[r], inv_sum[r]);
}

}  // namespace te_jax::cuda
