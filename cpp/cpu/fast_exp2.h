// A vectorised 2^x for the softmax: libm's exp does not vectorise, and every score of the S x S matrix passes
// through one exponential. Scores are kept in log2 units (the log2(e) factor is folded into Q) so exp2 is all we need.
#pragma once

#include "cpp/cpu/simd_vector.h"

namespace te_jax::cpu {

// Relative error below 1.2e-7 (about one float ulp). Inputs at or below -127, -inf included, give exactly 0, which is
// what masked scores must contribute; 2^-126..2^-127 flushes to 0, far below anything a softmax row can notice. NaN
// gives NaN (both clamps let it through, and NaN times the scale bits stays NaN), so a NaN score poisons its row as
// IEEE arithmetic would; the softmax never passes +inf (scores minus their row max are <= 0).
template <typename V>
inline V Exp2(const V& exponent) {
  using Vec = Vector<V>;
  V x = exponent < -127.0f ? Vec::Splat(-127.0f) : exponent;
  x = x > 127.0f ? Vec::Splat(127.0f) : x;
  // Adding and removing 1.5 * 2^23 rounds to the nearest integer in float arithmetic (no int conversion needed).
  const V n = (x + 0x1.8p23f) - 0x1.8p23f;
  const V f = x - n;  // in [-0.5, 0.5]
  // Near-minimax fit of 2^f on [-0.5, 0.5].
  V p = Vec::Splat(1.5337577497e-4f);
  p = p * f + 1.3399859890e-3f;
  p = p * f + 9.6185198054e-3f;
  p = p * f + 5.5503290147e-2f;
  p = p * f + 2.4022646248e-1f;
  p = p * f + 6.9314718246e-1f;
  p = p * f + 1.0f;
  // n = -127 gives the bits of +0; a same-size vector cast reinterprets the bits.
  const typename Vec::Int biased_exponent = (__builtin_convertvector(n, typename Vec::Int) + 127) << 23;
  return p * (V)biased_exponent;
}

}  // namespace te_jax::cpu
