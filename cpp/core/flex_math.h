// The scalar math that te_jax/flex's generated score_mod / mask_mod code calls, with XLA's float32 and integer
// semantics, for the host compiler and NVRTC alike (NVRTC has no standard headers: the device side uses CUDA's
// builtins). Each function says where it matches XLA exactly and where it defers to the platform's libm. Values of
// JAX dtype bfloat16 and float16 are carried as float holding the rounded value (every such value is a float), so an
// operation on them computes in float and rounds once, as XLA does.
#pragma once

#include "cpp/core/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cmath>
#include <cstdint>
#include <cstring>
#endif

namespace te_jax::flex {

TE_JAX_HOST_DEVICE uint32_t FloatBits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

TE_JAX_HOST_DEVICE float FloatFromBits(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// Integer facts without <limits> / <type_traits>: the same-width unsigned and signed types, and the unsigned type
// arithmetic wraps in (32 bits at least, so uint16 * uint16 never promotes to an overflowing int).
template <typename T>
struct IntTraits;
#define TE_JAX_FLEX_INT_TRAITS(T, U, S, W, BITS, SIGNED) \
  template <>                                            \
  struct IntTraits<T> {                                  \
    using Unsigned = U;                                  \
    using Signed = S;                                    \
    using Wide = W;                                      \
    static constexpr int kBits = BITS;                   \
    static constexpr bool kSigned = SIGNED;              \
  };
TE_JAX_FLEX_INT_TRAITS(int8_t, uint8_t, int8_t, uint32_t, 8, true)
TE_JAX_FLEX_INT_TRAITS(int16_t, uint16_t, int16_t, uint32_t, 16, true)
TE_JAX_FLEX_INT_TRAITS(int32_t, uint32_t, int32_t, uint32_t, 32, true)
TE_JAX_FLEX_INT_TRAITS(int64_t, uint64_t, int64_t, uint64_t, 64, true)
TE_JAX_FLEX_INT_TRAITS(uint8_t, uint8_t, int8_t, uint32_t, 8, false)
TE_JAX_FLEX_INT_TRAITS(uint16_t, uint16_t, int16_t, uint32_t, 16, false)
TE_JAX_FLEX_INT_TRAITS(uint32_t, uint32_t, int32_t, uint32_t, 32, false)
TE_JAX_FLEX_INT_TRAITS(uint64_t, uint64_t, int64_t, uint64_t, 64, false)
#undef TE_JAX_FLEX_INT_TRAITS

template <typename T>
TE_JAX_HOST_DEVICE T IntMin() {
  return IntTraits<T>::kSigned ? T(typename IntTraits<T>::Unsigned(1) << (IntTraits<T>::kBits - 1)) : T(0);
}
template <typename T>
TE_JAX_HOST_DEVICE T IntMax() {
  return T(~IntMin<T>());
}

// Two's-complement wrap-around, as XLA's integer add / sub / mul / neg (C++'s signed overflow is undefined).
template <typename T>
TE_JAX_HOST_DEVICE T WrapAdd(T a, T b) {
  using W = typename IntTraits<T>::Wide;
  return T(W(a) + W(b));
}
template <typename T>
TE_JAX_HOST_DEVICE T WrapSub(T a, T b) {
  using W = typename IntTraits<T>::Wide;
  return T(W(a) - W(b));
}
template <typename T>
TE_JAX_HOST_DEVICE T WrapMul(T a, T b) {
  using W = typename IntTraits<T>::Wide;
  return T(W(a) * W(b));
}
template <typename T>
TE_JAX_HOST_DEVICE T WrapNeg(T a) {
  using W = typename IntTraits<T>::Wide;
  return T(W(0) - W(a));
}
template <typename T>
TE_JAX_HOST_DEVICE T IntAbs(T a) {
  return a < T(0) ? WrapNeg(a) : a;
}
template <typename T>
TE_JAX_HOST_DEVICE T IntSign(T a) {
  return T((a > T(0)) - (a < T(0)));
}

// lax.div / lax.rem on integers: quotient rounded toward zero; x / 0 = -1 (all bits set), x % 0 = x; MIN / -1 = MIN,
// MIN % -1 = 0 (XLA's definitions, seen on XLA:CPU, jax 0.10.2).
template <typename T>
TE_JAX_HOST_DEVICE T IntDiv(T a, T b) {
  if (b == T(0)) return T(~typename IntTraits<T>::Unsigned(0));
  if (IntTraits<T>::kSigned && a == IntMin<T>() && b == T(-1)) return a;
  return T(a / b);
}
template <typename T>
TE_JAX_HOST_DEVICE T IntRem(T a, T b) {
  if (b == T(0)) return a;
  if (IntTraits<T>::kSigned && a == IntMin<T>() && b == T(-1)) return T(0);
  return T(a % b);
}

// Shifts by the amount read as unsigned: from the width up (negative amounts included) shift_left and
// shift_right_logical give 0 and shift_right_arithmetic the sign (0 or -1), as XLA does.
template <typename T>
TE_JAX_HOST_DEVICE T ShiftLeft(T a, T s) {
  using U = typename IntTraits<T>::Unsigned;
  if (U(s) >= U(IntTraits<T>::kBits)) return T(0);
  return T(typename IntTraits<T>::Wide(a) << U(s));
}
template <typename T>
TE_JAX_HOST_DEVICE T ShiftRightArithmetic(T a, T s) {
  using U = typename IntTraits<T>::Unsigned;
  using S = typename IntTraits<T>::Signed;
  const S signed_a = S(a);
  if (U(s) >= U(IntTraits<T>::kBits)) return T(signed_a < S(0) ? S(-1) : S(0));
  return T(S(signed_a >> U(s)));
}
template <typename T>
TE_JAX_HOST_DEVICE T ShiftRightLogical(T a, T s) {
  using U = typename IntTraits<T>::Unsigned;
  if (U(s) >= U(IntTraits<T>::kBits)) return T(0);
  return T(U(U(a) >> U(s)));
}

template <typename T>
TE_JAX_HOST_DEVICE T Max(T a, T b) {
  return a < b ? b : a;
}
template <typename T>
TE_JAX_HOST_DEVICE T Min(T a, T b) {
  return b < a ? b : a;
}
// lax.max / lax.min on floats: NaN if either is NaN, and -0 < +0 (XLA:CPU gives max(-0, +0) = +0, min = -0).
TE_JAX_HOST_DEVICE float Max(float a, float b) {
  if (a != a || b != b) return a + b;
  if (a == b) return FloatFromBits(FloatBits(a) & FloatBits(b));
  return a < b ? b : a;
}
TE_JAX_HOST_DEVICE float Min(float a, float b) {
  if (a != a || b != b) return a + b;
  if (a == b) return FloatFromBits(FloatBits(a) | FloatBits(b));
  return b < a ? b : a;
}

// lax.sign: -1, +1, and the argument itself for +-0 and NaN.
TE_JAX_HOST_DEVICE float Sign(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x); }

// float -> integer as XLA converts: truncation toward zero, saturating at the type's range, NaN -> 0.
template <typename T>
TE_JAX_HOST_DEVICE T FloatToInt(float x) {
  if (x != x) return T(0);
  if (x <= float(IntMin<T>())) return IntMin<T>();
  if (x >= float(IntMax<T>())) return IntMax<T>();
  return T(x);
}

// float32 -> bfloat16 / float16 rounding (to nearest, ties to even; NaN stays NaN, overflow gives infinity,
// subnormals kept), returned as the float holding the rounded value.
TE_JAX_HOST_DEVICE float RoundToBFloat16(float x) {
  if (x != x) return x;
  uint32_t bits = FloatBits(x);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return FloatFromBits(bits & 0xffff0000u);
}
TE_JAX_HOST_DEVICE float RoundToFloat16(float x) {
  const uint32_t sign = FloatBits(x) & 0x80000000u;
  const float a = FloatFromBits(FloatBits(x) ^ sign);
  if (a != a) return x;
  if (a >= 65520.0f) return FloatFromBits(sign | 0x7f800000u);  // halfway above float16's largest, 65504
  if (a < 6.103515625e-05f) {
    // float16's subnormals are the multiples of 2^-24: adding 0.5 (whose ulp is 2^-24) rounds to one of them.
    return FloatFromBits(sign | FloatBits((a + 0.5f) - 0.5f));
  }
  uint32_t bits = FloatBits(a);
  bits += 0xfffu + ((bits >> 13) & 1u);
  return FloatFromBits(sign | (bits & ~0x1fffu));
}

// A captured bfloat16 / float16 element (its bits as stored) as the float holding its value, exactly.
TE_JAX_HOST_DEVICE float BFloat16Value(uint16_t bits) { return FloatFromBits(uint32_t(bits) << 16); }
TE_JAX_HOST_DEVICE float Float16Value(uint16_t bits) {
  const uint32_t sign = uint32_t(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1fu) return FloatFromBits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0u) return FloatFromBits(sign | FloatBits(float(mantissa) * 5.9604644775390625e-08f));  // 2^-24
  return FloatFromBits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// The type of positions in captured arrays (their shapes, strides and the indices into them): 64 bits on the host;
// 32 in the CUDA kernels, whose captures hold fewer than 2^31 elements (cpp/core/validate.cc), so a read costs 32-bit
// arithmetic there. An index of a wider type (int64, uint32 with jax_enable_x64) is clamped in its own type first.
#if defined(__CUDA_ARCH__)
typedef int32_t FlexIndex;
#else
typedef int64_t FlexIndex;
#endif

// An index into a captured array's dimension, clamped to [0, last] as lax.dynamic_slice and gather (mode clip) do; i
// is a FlexIndex or an int64_t.
template <typename T>
TE_JAX_HOST_DEVICE FlexIndex ClampIndex(T i, FlexIndex last) {
  return i < T(0) ? FlexIndex(0) : (i > T(last) ? last : FlexIndex(i));
}

// A capture gradient's term: `value` added to element `offset` of capture `capture`'s gradient. The CPU gives each
// worker its own arrays; the GPU's threads share one, so they add atomically (the kernels pass DCaptures a run that adds
// up a thread's consecutive terms of one element first: kernels/common/kernel_mods.h GradientRun).
template <typename Index>
TE_JAX_HOST_DEVICE void AddGradient(float* const* grads, int capture, Index offset, float value) {
#if defined(__CUDA_ARCH__)
  atomicAdd(grads[capture] + offset, value);
#else
  grads[capture][offset] += value;
#endif
}

// The platform's libm (glibc on the host, CUDA's device math without fast-math on the GPU): XLA:CPU uses its own
// approximations for some (tanh, erf: a few ulp from glibc), so these match JAX within ulps, not bitwise.
TE_JAX_HOST_DEVICE float Exp(float x) { return expf(x); }
TE_JAX_HOST_DEVICE float Exp2(float x) { return exp2f(x); }
TE_JAX_HOST_DEVICE float Expm1(float x) { return expm1f(x); }
TE_JAX_HOST_DEVICE float Log(float x) { return logf(x); }
TE_JAX_HOST_DEVICE float Log1p(float x) { return log1pf(x); }
TE_JAX_HOST_DEVICE float Tanh(float x) { return tanhf(x); }
TE_JAX_HOST_DEVICE float Logistic(float x) { return 1.0f / (1.0f + expf(-x)); }
TE_JAX_HOST_DEVICE float Erf(float x) { return erff(x); }
TE_JAX_HOST_DEVICE float Sin(float x) { return sinf(x); }
TE_JAX_HOST_DEVICE float Cos(float x) { return cosf(x); }
TE_JAX_HOST_DEVICE float Tan(float x) { return tanf(x); }
TE_JAX_HOST_DEVICE float Atan2(float y, float x) { return atan2f(y, x); }
TE_JAX_HOST_DEVICE float Pow(float x, float y) { return powf(x, y); }
// IEEE-exact on both sides (sqrtf is correctly rounded on the GPU without fast-math; rsqrtf is not, hence 1 / sqrt).
TE_JAX_HOST_DEVICE float Sqrt(float x) { return sqrtf(x); }
TE_JAX_HOST_DEVICE float Rsqrt(float x) { return 1.0f / sqrtf(x); }
TE_JAX_HOST_DEVICE float Abs(float x) { return fabsf(x); }
TE_JAX_HOST_DEVICE float Floor(float x) { return floorf(x); }
TE_JAX_HOST_DEVICE float Ceil(float x) { return ceilf(x); }
TE_JAX_HOST_DEVICE float RoundHalfAway(float x) { return roundf(x); }
TE_JAX_HOST_DEVICE float RoundHalfEven(float x) { return rintf(x); }
TE_JAX_HOST_DEVICE float FloatRem(float x, float y) { return fmodf(x, y); }
TE_JAX_HOST_DEVICE bool IsFinite(float x) { return x - x == 0.0f; }

}  // namespace te_jax::flex
