// The backward's per-element algebra, shared by both kernel families: from a raw dot product x and dp = dout . v to the
// probability p and the score gradient ds, with the variant's logit and its derivative.
#pragma once

#include "cpp/cuda/kernels/common/kernel_mods.h"
#include "cpp/cuda/kernels/common/online_softmax.h"

namespace te_jax::cuda {

// Selects, at compile time, the per-element mask of a tile that straddles a key-range edge (Masked<true>) or its
// absence in a tile every row fully sees (Masked<false>).
template <bool kMasked>
struct Masked {
  static constexpr bool value = kMasked;
};

// The per-element logit/probability/dS algebra shared by the dk/dv and dq kernels.
template <typename Variant>
struct ProbabilityGrad {
  // p = exp(logit - lse) where visible, else 0; ds = p * (dp - delta') * dlogit/ddot. delta' = delta - dlse. With an
  // additive bias the logit is Logit(x) + bias. With dropout, `keep` is the element's factor (1 / (1 - rate) or 0;
  // dropout.h): x_to_p becomes p * keep (what dV takes) and the logit's gradient p * (keep * dp - delta'); without it
  // keep is the constant 1 and folds away. With mods (`at` the element's indices; the caller's `visible` has the
  // mask_mod's answer) the softmax sees Score(logit), and the gradient goes back through DScore (and to the
  // score_mod's captures). Returns the logit's gradient (and so the bias's).
  static __device__ __forceinline__ float Apply(const Variant& variant, float& x_to_p, float& dp_to_ds,
                                                typename Variant::Position pos, typename Variant::Position key,
                                                bool visible, float lse, float delta, float bias = 0.0f,
                                                float keep = 1.0f, const ModIndex& at = ModIndex{}) {
    const float x = x_to_p;
    float p;
    if constexpr (Variant::kHasMods) {
      // A row every key of which the mods hid or sent to -inf has lse = -inf: its p is 0.
      if (lse == -__int_as_float(0x7f800000)) lse = __int_as_float(0x7f800000);
      const float logit = Logit(variant, x, pos, key, bias);
      p = visible ? Exp2(fmaf(variant.mods.Score(logit, at), kLog2e, -lse * kLog2e)) : 0.0f;
      x_to_p = p * keep;
      const float dlogit = variant.mods.ScoreGrad(p * (keep * dp_to_ds - delta), logit, at);
      dp_to_ds = dlogit * variant.DLogitDDot(x);
      return dlogit;
    } else if constexpr (!Variant::kHasSoftcap && !Variant::kHasAlibi && !Variant::kHasBias) {
      // The plain scaled dot product: scale * log2 e folds into the one FMA (both factors are loop invariant).
      p = visible ? Exp2(fmaf(x, variant.scale * kLog2e, -lse * kLog2e)) : 0.0f;
    } else {
      if constexpr (Variant::kHasBias) {
        // A row whose every visible logit is -inf (a -inf bias) has lse = -inf: its p is 0, not exp(-inf + inf) = NaN.
        if (lse == -__int_as_float(0x7f800000)) lse = __int_as_float(0x7f800000);
      }
      p = visible ? Exp2(fmaf(Logit(variant, x, pos, key, bias), kLog2e, -lse * kLog2e)) : 0.0f;
    }
    x_to_p = p * keep;
    const float dlogit = p * (keep * dp_to_ds - delta);
    dp_to_ds = dlogit * variant.DLogitDDot(x);
    return dlogit;
  }

  static __device__ __forceinline__ float Logit(const Variant& variant, float x, typename Variant::Position pos,
                                                typename Variant::Position key, float bias) {
    if constexpr (Variant::kHasBias) return variant.Logit(x, pos, key) + bias;
    return variant.Logit(x, pos, key);
  }
};

}  // namespace te_jax::cuda
