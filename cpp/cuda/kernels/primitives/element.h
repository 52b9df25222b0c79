// The element types the kernels read and write, as tags: 16-bit storage (uint16_t) for q, k, v and out, float32
// arithmetic, and conversions that are single PTX instructions, so the kernels need none of the CUDA half/bfloat16
// headers. A logit bias may also be float32 (Float32, a bias element type only); an FP8 KV cache's k and v are one byte
// (E4M3, E5M2: the decode kernels read them as f16 pairs, primitives/fp8_tile.h).
#pragma once

#include "cpp/core/host_device.h"

namespace te_jax::cuda {

struct BFloat16 {
  static constexpr int kBytes = 2;
  static constexpr bool kIsBf16 = true;
  static constexpr uint16_t kExponentBits = 0x7F80;  // all set: inf or NaN (every type's kExponentBits)
  // Two floats -> one register holding {lo, hi} (lo in the low half), rounded to nearest even.
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float ToFloat(uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); }
};

struct Float16 {
  static constexpr int kBytes = 2;
  static constexpr bool kIsBf16 = false;
  static constexpr uint16_t kExponentBits = 0x7C00;
  static __device__ __forceinline__ uint32_t Pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static __device__ __forceinline__ float ToFloat(uint16_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
};

struct Float32 {
  static constexpr int kBytes = 4;
};

// The FP8 formats (cpp/core/kv_format.h: an FP8 KV cache's k and v, FP8 attention's q, k and v). Every e4m3 and e5m2
// value is exact in f16, and one cvt turns two of them into an f16x2 register (sm_89 on), so the decode products read
// FP8 tiles as f16 operands with no loss.
// ToHalf2(x, lo, hi): the four bytes of x (the first in the low byte) -> {byte 0, byte 1} in lo, {byte 2, byte 3} in
// hi, each f16x2 with the lower-addressed value in its low half.
// Pack4(a, b, c, d): four floats -> one register of four values, a in the low byte, rounded to nearest even and
// saturated to the finite range (NaN stays NaN); ToFloat: one value (the low byte) as a float, exactly.
#define TE_JAX_FP8_TO_HALF2(T) \
  "{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2." T "x2 %0, l;\ncvt.rn.f16x2." T "x2 %1, h;\n}"
#define TE_JAX_FP8_PACK4(T)                                                                                  \
  "{\n.reg .b16 l, h;\ncvt.rn.satfinite." T "x2.f32 l, %2, %1;\ncvt.rn.satfinite." T "x2.f32 h, %4, %3;\n" \
  "mov.b32 %0, {l, h};\n}"

template <bool kE4M3>
struct Fp8Format {
  static constexpr int kBytes = 1;
  static constexpr bool kIsE4M3 = kE4M3;
  // All set: NaN (e4m3fn has no inf: S.1111.111 is its NaN), or e5m2's inf and NaN.
  static constexpr uint16_t kExponentBits = kE4M3 ? 0x7F : 0x7C;
  static __device__ __forceinline__ void ToHalf2(uint32_t x, uint32_t& lo, uint32_t& hi) {
    if constexpr (kE4M3) {
      asm(TE_JAX_FP8_TO_HALF2("e4m3") : "=r"(lo), "=r"(hi) : "r"(x));
    } else {
      asm(TE_JAX_FP8_TO_HALF2("e5m2") : "=r"(lo), "=r"(hi) : "r"(x));
    }
  }
  static __device__ __forceinline__ uint32_t Pack4(float a, float b, float c, float d) {
    uint32_t r;
    if constexpr (kE4M3) {
      asm(TE_JAX_FP8_PACK4("e4m3") : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
    } else {
      asm(TE_JAX_FP8_PACK4("e5m2") : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
    }
    return r;
  }
  static __device__ __forceinline__ float ToFloat(uint32_t x) {
    uint32_t lo, hi;
    ToHalf2(x, lo, hi);
    return Float16::ToFloat(static_cast<uint16_t>(lo));
  }
};
using E4M3 = Fp8Format<true>;
using E5M2 = Fp8Format<false>;

#undef TE_JAX_FP8_PACK4
#undef TE_JAX_FP8_TO_HALF2

// A compile-time bool as a type, for generic lambdas instantiated both ways (NVRTC has no <type_traits>).
template <bool kB>
struct BoolConstant {
  static constexpr bool kValue = kB;
};

// Whether one element (16 or 8 bits, in the low bits of x) is inf or NaN.
template <typename Element>
__device__ __forceinline__ bool IsNonFinite(uint32_t x) {
  return (x & Element::kExponentBits) == Element::kExponentBits;
}

// A 32-bit word of two 16-bit or four 8-bit elements: whether any of them is inf or NaN, and the word with those set
// to 0 (the non-finite scans of kernels/common/nonfinite_tile.h).
template <typename Element>
__device__ __forceinline__ bool WordHasNonFinite(uint32_t w) {
  bool any = false;
#pragma unroll
  for (int i = 0; i < 4 / Element::kBytes; ++i) any |= IsNonFinite<Element>(w >> (8 * Element::kBytes * i));
  return any;
}

template <typename Element>
__device__ __forceinline__ uint32_t WordWithoutNonFinite(uint32_t w) {
  constexpr uint32_t kMask = Element::kBytes == 1 ? 0xFFu : 0xFFFFu;
#pragma unroll
  for (int i = 0; i < 4 / Element::kBytes; ++i) {
    const int shift = 8 * Element::kBytes * i;
    if (IsNonFinite<Element>(w >> shift)) w &= ~(kMask << shift);
  }
  return w;
}

// 0x7FFF7FFF: a quiet NaN in both bfloat16 and float16, for outputs of calls with invalid run-time lengths.
inline constexpr uint32_t kPackedNaN = 0x7FFF7FFFu;

}  // namespace te_jax::cuda
