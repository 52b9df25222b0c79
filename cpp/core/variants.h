// Attention variants as small structs the kernels are instantiated with (FlashInfer's design): the kernel computes the
// dot product x = q.k and asks the variant for the logit and, in the backward pass, for d logit / d x. A new variant is
// a new struct (or a new flag here), not a new kernel. The order follows the semantics: s = scale * x, then the
// soft-cap s = cap * tanh(s / cap), then the ALiBi bias slope * (j - p) with p the query's diagonal position.
// kTokensOn (CUDA kernels) adds the packed-sequence mask: segment ids and positions through the token tables
// (cpp/cuda/kernel_args.h), and p and j become the query's and the key's positions. kDropoutOn (CUDA kernels)
// applies attention dropout to the probabilities (cpp/cuda/kernels/common/dropout.h).
// BiasElement (CUDA kernels) is the additive logit bias's element type (te_jax::cuda::BFloat16, Float16,
// Float32), or NoBias. The kernels add the bias after Logit, s = Logit(x) + bias, from a tile they stage per key tile
// (cpp/cuda/kernels/sm80/bias_tile.h); its gradient is dS before DLogitDDot.
// Mods (sm90 CUDA kernels) is a score_mod and mask_mod written in Python (cpp/cuda/kernels/common/kernel_mods.h), or
// NoMods: s = Score(s) after the bias, and a key hidden where Mask is false, both per element with its indices.
#pragma once

#include "cpp/core/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cmath>
#include <cstdint>
#endif

namespace te_jax {

// The BiasElement of a variant without a bias.
struct NoBias {
  static constexpr int kBytes = 0;
};

// tanh(s / cap), the soft-cap's. The GPU takes 1 - 2 / (2^(2 log2(e) s / cap) + 1) on the special-function unit
// (ex2.approx and an approximate reciprocal, the cap's reciprocal hoisted out of the loops; absolute error ~3e-7):
// tanhf and an IEEE division are ~40 instructions a logit with slow paths, which made the soft-capped sm90 forward
// 3.4x slower than plain attention on an H200. Infinities give +-1, NaN stays NaN. The CPU keeps tanhf.
TE_JAX_HOST_DEVICE float SoftcapTanh(float s, float cap) {
#if defined(__CUDA_ARCH__)
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(s * __fdividef(2.8853900817779268f, cap)));
  return 1.0f - __fdividef(2.0f, e + 1.0f);
#else
  return tanhf(s / cap);
#endif
}

// The Mods of a variant without score_mod and mask_mod.
struct NoMods {
  static constexpr bool kScore = false;
  static constexpr bool kMask = false;
};

// The integer type of the positions a kernel hands Logit. Row and column indices (with a diagonal offset) are int:
// their distance fits in 32 bits and converts in one instruction. Packed sequences' positions are any int32 each, so
// their distance takes 64 bits, and its conversion (I2F.S64; one per logit of the sm90 forward when every kernel took
// int64 positions) is the slow one.
template <bool kTokensOn>
struct PositionType {
  using Type = int;
};
template <>
struct PositionType<true> {
  using Type = int64_t;
};

template <bool kSoftcapOn, bool kAlibiOn, bool kTokensOn = false, bool kDropoutOn = false,
          typename BiasElement = NoBias, typename ModsT = NoMods>
struct LogitsVariant {
  static constexpr bool kHasSoftcap = kSoftcapOn;
  static constexpr bool kHasAlibi = kAlibiOn;
  static constexpr bool kHasTokens = kTokensOn;
  static constexpr bool kHasDropout = kDropoutOn;
  static constexpr bool kHasBias = BiasElement::kBytes > 0;
  static constexpr bool kHasScoreMod = ModsT::kScore;
  static constexpr bool kHasMaskMod = ModsT::kMask;
  static constexpr bool kHasMods = kHasScoreMod || kHasMaskMod;
  using Bias = BiasElement;
  using Mods = ModsT;
  using Position = typename PositionType<kTokensOn>::Type;  // what the CUDA kernels hand Logit
  float scale;
  float cap;    // read only with kHasSoftcap
  float slope;  // read only with kHasAlibi; per (batch, head)
  Mods mods;    // bound to the call's captures by the kernel (KernelMods::Of)

  template <typename Position>
  TE_JAX_HOST_DEVICE float Logit(float x, Position p, Position j) const {
    float s = scale * x;
    if constexpr (kHasSoftcap) s = cap * SoftcapTanh(s, cap);
    if constexpr (kHasAlibi) s += slope * static_cast<float>(j - p);
    return s;
  }

  TE_JAX_HOST_DEVICE float DLogitDDot(float x) const {
    if constexpr (kHasSoftcap) {
      const float t = SoftcapTanh(scale * x, cap);
      return scale * (1.0f - t * t);
    } else {
      return scale;
    }
  }
};

// ALiBi's term over the scale, slope / scale * (j - p), for kernels that keep q.k unscaled and take the scale in their
// exp2 (no soft-cap, no bias, index positions): one thread's keys sit at compile-time offsets from its first column, so
// a row converts its distance from that column once per tile and each element costs one FFMA and the add.
struct AlibiOverScale {
  float step;  // slope / scale
  float base;  // step * (first column - p)

  TE_JAX_HOST_DEVICE static AlibiOverScale At(float step, int first_column_minus_p) {
    return {step, step * static_cast<float>(first_column_minus_p)};
  }
  TE_JAX_HOST_DEVICE float Term(int offset) const { return base + step * static_cast<float>(offset); }
};

using ScaledDot = LogitsVariant<false, false>;
using Softcap = LogitsVariant<true, false>;
using Alibi = LogitsVariant<false, true>;
using SoftcapAlibi = LogitsVariant<true, true>;

// Calls f(variant_type_tag) with the variant matching the runtime flags, so dispatch is written once.
template <typename F>
decltype(auto) DispatchVariant(bool softcap, bool alibi, F&& f) {
  if (softcap) {
    return alibi ? f(SoftcapAlibi{}) : f(Softcap{});
  }
  return alibi ? f(Alibi{}) : f(ScaledDot{});
}

}  // namespace te_jax
