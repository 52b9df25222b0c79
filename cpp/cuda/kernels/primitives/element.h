// The 16-bit element types the kernels read and write, as tags: storage is uint16_t, arithmetic is float32, and the
// conversions are single PTX instructions, so the kernels need none of the CUDA half/bfloat16 headers. A logit bias
// may also be float32 (Float32, a bias element type only).
#pragma once

#include "cpp/core/host_device.h"

namespace te_jax::cuda {

struct BFloat16 {
  static constexpr int kBytes = 2;
  static constexpr bool kIsBf16 = true;
  static constexpr uint16_t kExponentBits = 0x7F80;  // all set: inf or NaN
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

// A compile-time bool as a type, for generic lambdas instantiated both ways (NVRTC has no <type_traits>).
template <bool kB>
struct BoolConstant {
  static constexpr bool kValue = kB;
};

template <typename Element>
__device__ __forceinline__ bool IsNonFinite(uint16_t x) {
  return (x & Element::kExponentBits) == Element::kExponentBits;
}

// 0x7FFF7FFF: a quiet NaN in both bfloat16 and float16, for outputs of calls with invalid run-time lengths.
inline constexpr uint32_t kPackedNaN = 0x7FFF7FFFu;

}  // namespace te_jax::cuda
