// The storage types of q, k, v, out and the gradients, and their conversions to and from the float32 the kernels
// compute in: exact, element by element (row_as_float.h converts whole float16 rows with F16C where it can).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpp/core/dtype.h"
#include "cpp/core/kv_format.h"

namespace te_jax::cpu {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};
// An FP8 KV cache's elements (cpp/core/kv_format.h): read, never written.
struct Float8E4M3 {
  uint8_t bits;
};
struct Float8E5M2 {
  uint8_t bits;
};

inline float FloatFromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline uint32_t BitsFromFloat(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(BFloat16 x) { return FloatFromBits(static_cast<uint32_t>(x.bits) << 16); }
// No float arithmetic on a subnormal float: XLA's CPU threads run with denormals-are-zero, under which the half's bits
// placed in a subnormal float would read as 0, flushing every float16 subnormal (a normal float32) to zero.
inline float ToFloat(Float16 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t magnitude = x.bits & 0x7fffu;
  float f;
  if (magnitude >= 0x7c00u) {  // inf and NaN
    f = FloatFromBits((magnitude << 13) | 0x7f800000u);
  } else if (magnitude >= 0x0400u) {  // normal: the exponent rebiased from 15 to 127
    f = FloatFromBits((magnitude << 13) + ((127u - 15u) << 23));
  } else {  // subnormal or zero: mantissa * 2^-24, an exact product of normal floats
    f = static_cast<float>(magnitude) * 0x1p-24f;
  }
  return FloatFromBits(BitsFromFloat(f) | sign);
}

// e4m3fn: bias 7, no inf, S.1111.111 NaN; a subnormal is mantissa * 2^-9, a normal float32 (see Float16's note).
inline float ToFloat(Float8E4M3 x) {
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x80u) << 24;
  const uint32_t magnitude = x.bits & 0x7fu;
  float f;
  if (magnitude == 0x7fu) {
    f = FloatFromBits(0x7fc00000u);
  } else if (magnitude >= 0x08u) {  // normal: the exponent rebiased from 7 to 127
    f = FloatFromBits((magnitude << 20) + ((127u - 7u) << 23));
  } else {
    f = static_cast<float>(magnitude) * 0x1p-9f;
  }
  return FloatFromBits(BitsFromFloat(f) | sign);
}
// e5m2 is float16 with its low mantissa byte dropped.
inline float ToFloat(Float8E5M2 x) { return ToFloat(Float16{static_cast<uint16_t>(x.bits << 8)}); }

template <typename T>
T FromFloat(float f);

template <>
inline float FromFloat<float>(float f) {
  return f;
}

template <>
inline BFloat16 FromFloat<BFloat16>(float f) {
  const uint32_t u = BitsFromFloat(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  return BFloat16{static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};  // round to nearest even
}

// Round to nearest even, subnormals and overflow to inf included (the float arithmetic does the rounding: adding a
// power of two aligned to the half's ulp lets the float adder round away the extra mantissa bits).
template <>
inline Float16 FromFloat<Float16>(float f) {
  const uint32_t w = BitsFromFloat(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xff000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  float base = ((f < 0 ? -f : f) * 0x1p112f) * 0x1p-110f;
  base = FloatFromBits((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = BitsFromFloat(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
  return Float16{static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign))};
}

// Calls f(element_type_tag) with the storage type of a runtime dtype, so dispatch is written once.
template <typename F>
void DispatchDType(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32: f(float{}); break;
    case DType::kBFloat16: f(BFloat16{}); break;
    case DType::kFloat16: f(Float16{}); break;
  }
}

// Calls f(element_type_tag) with the storage type of k and v: the dtype's (`as_q`) or an FP8 KV cache's.
template <typename T, typename F>
void DispatchKvFormat(KvFormat format, T as_q, F&& f) {
  switch (format) {
    case KvFormat::kAsQ: f(as_q); break;
    case KvFormat::kE4M3: f(Float8E4M3{}); break;
    case KvFormat::kE5M2: f(Float8E5M2{}); break;
  }
}

}  // namespace te_jax::cpu
