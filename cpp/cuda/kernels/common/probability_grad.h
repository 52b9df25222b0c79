// The backward's per-element algebra, shared by both kernel families: from a raw dot product x and dp = dout . v to the
// probability p and the score gradient ds, with the variant's logit and its derivative.
#pragma once

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
  // p = exp(logit - lse) where visible, else 0; ds = p * (dp - delta') * dlogit/ddot. delta' = delta - dlse. With
  // dropout, `keep` is the element's factor (1 / (1 - rate) or 0; dropout.h): x_to_p becomes p * keep (what dV takes)
  // and ds = p * (keep * dp - delta') * dlogit/ddot; without it, keep is the constant 1 and folds away.
  static __device__ __forceinline__ void Apply(const Variant& variant, float& x_to_p, float& dp_to_ds, int64_t pos,
                                               int key, bool visible, float lse, float delta, float keep = 1.0f) {
    const float x = x_to_p;
    float p;
    if constexpr (!Variant::kHasSoftcap && !Variant::kHasAlibi) {
      // The plain scaled dot product: scale * log2 e folds into the one FMA (both factors are loop invariant).
      p = visible ? Exp2(fmaf(x, variant.scale * kLog2e, -lse * kLog2e)) : 0.0f;
    } else {
      p = visible ? Exp2(fmaf(variant.Logit(x, pos, key), kLog2e, -lse * kLog2e)) : 0.0f;
    }
    x_to_p = p * keep;
    dp_to_ds = p * (keep * dp_to_ds - delta) * variant.DLogitDDot(x);
  }
};

}  // namespace te_jax::cuda
