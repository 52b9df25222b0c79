#include "cpp/cpu/row_as_float.h"

#include <array>
#include <type_traits>

#include "cpp/cpu/isa_dispatch.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace te_jax::cpu {
namespace {

void Float16sToFloatsScalar(const Float16* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(in[i]);
}

#if defined(__x86_64__) && defined(__GNUC__)
// Every AVX2 level CpuIsa reports has F16C (isa_dispatch.h). vcvtph2ps is exact, as ToFloat is; it differs only in
// quieting a signalling NaN.
__attribute__((target("avx2,f16c"))) void Float16sToFloatsF16c(const Float16* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  }
  Float16sToFloatsScalar(in + i, n - i, out + i);
}
#endif

// A shift of each half's bits, which the compiler vectorises in the ISA it is built for (isa_dispatch.h).
void BFloat16sToFloatsBody(const BFloat16* in, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToFloat(in[i]);
}

// The format's 256 values, for the scalar path and the tails.
template <typename T>
const float* Fp8Values() {
  static const auto table = [] {
    std::array<float, 256> values;
    for (int bits = 0; bits < 256; ++bits) values[bits] = ToFloat(T{static_cast<uint8_t>(bits)});
    return values;
  }();
  return table.data();
}

template <typename T>
void Fp8sToFloatsScalar(const T* in, int64_t n, float descale, float* out) {
  const float* values = Fp8Values<T>();
  for (int64_t i = 0; i < n; ++i) out[i] = values[in[i].bits] * descale;
}

#if defined(__x86_64__) && defined(__GNUC__)
// Sixteen FP8 bytes as float16 bit patterns for vcvtph2ps. e5m2 is float16's top byte. e4m3, sign-extended to 16 bits
// and shifted left by 7, has its sign in bit 15, a copy of it in bit 14 (cleared) and its exponent and mantissa where
// float16's read 2^-8 of its value (biases 7 and 15; subnormals onto subnormals alike); its NaN (S.1111.111) is a
// float16 normal there, so `nan` marks those lanes.
template <typename T>
__attribute__((target("avx2"))) inline __m256i Fp8AsHalves(const T* in, __m256i* nan) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  if constexpr (std::is_same_v<T, Float8E5M2>) {
    *nan = _mm256_setzero_si256();
    return _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
  } else {
    const __m256i halves = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                            _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    const __m256i all_ones = _mm256_set1_epi16(0x3F80);  // exponent and mantissa bits all set
    *nan = _mm256_cmpeq_epi16(_mm256_and_si256(halves, all_ones), all_ones);
    return halves;
  }
}

// The factor of a converted half: e4m3's reading times 2^8, then the descale, the two products XLA's dequantization
// makes; one product where 2^8 * descale is exact and no intermediate can overflow (the same rounding), else two.
template <typename T>
struct HalfScale {
  float reading, descale;

  static HalfScale Of(float descale) {
    if constexpr (std::is_same_v<T, Float8E5M2>) return {1.0f, descale};
    const float magnitude = descale < 0 ? -descale : descale;
    if (magnitude >= 0x1p-100f && magnitude <= 0x1p100f) return {1.0f, 256.0f * descale};
    return {256.0f, descale};
  }
};

// Eight lanes (AVX2 + F16C): the 16 converted halves in two steps.
template <typename T>
__attribute__((target("avx2,f16c"))) void Fp8sToFloatsAvx2(const T* in, int64_t n, float descale, float* out) {
  const HalfScale<T> factor = HalfScale<T>::Of(descale);
  const __m256 reading = _mm256_set1_ps(factor.reading), scale = _mm256_set1_ps(factor.descale);
  const bool two_products = factor.reading != 1.0f;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i nan;
    const __m256i halves = Fp8AsHalves(in + i, &nan);
    const bool any_nan = !_mm256_testz_si256(nan, nan);
    for (int part = 0; part < 2; ++part) {
      const __m128i h = part ? _mm256_extracti128_si256(halves, 1) : _mm256_castsi256_si128(halves);
      __m256 value = _mm256_cvtph_ps(h);
      if (two_products) value = _mm256_mul_ps(value, reading);
      value = _mm256_mul_ps(value, scale);
      if (any_nan) {  // rare: only e4m3's NaN bytes
        const __m128i lanes = part ? _mm256_extracti128_si256(nan, 1) : _mm256_castsi256_si128(nan);
        value = _mm256_blendv_ps(value, _mm256_set1_ps(__builtin_nanf("")),
                                 _mm256_castsi256_ps(_mm256_cvtepi16_epi32(lanes)));
      }
      _mm256_storeu_ps(out + i + 8 * part, value);
    }
  }
  Fp8sToFloatsScalar(in + i, n - i, descale, out + i);
}

// Sixteen lanes (AVX-512F): one vcvtph2ps of the 16 halves.
template <typename T>
__attribute__((target("avx512f,avx2,f16c"))) void Fp8sToFloatsAvx512(const T* in, int64_t n, float descale,
                                                                      float* out) {
  const HalfScale<T> factor = HalfScale<T>::Of(descale);
  const __m512 reading = _mm512_set1_ps(factor.reading), scale = _mm512_set1_ps(factor.descale);
  const bool two_products = factor.reading != 1.0f;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i nan;
    __m512 value = _mm512_cvtph_ps(Fp8AsHalves(in + i, &nan));
    if (two_products) value = _mm512_mul_ps(value, reading);
    value = _mm512_mul_ps(value, scale);
    if (!_mm256_testz_si256(nan, nan)) {  // rare: only e4m3's NaN bytes
      const __mmask16 lanes = _mm512_test_epi32_mask(_mm512_cvtepi16_epi32(nan), _mm512_cvtepi16_epi32(nan));
      value = _mm512_mask_mov_ps(value, lanes, _mm512_set1_ps(__builtin_nanf("")));
    }
    _mm512_storeu_ps(out + i, value);
  }
  Fp8sToFloatsScalar(in + i, n - i, descale, out + i);
}
#endif

template <typename T>
void Fp8sToFloatsBest(const T* in, int64_t n, float descale, float* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (CpuIsa() == Isa::kAvx512) return Fp8sToFloatsAvx512(in, n, descale, out);
  if (CpuIsa() == Isa::kAvx2) return Fp8sToFloatsAvx2(in, n, descale, out);
#endif
  Fp8sToFloatsScalar(in, n, descale, out);
}

}  // namespace

void Fp8sToFloats(const Float8E4M3* in, int64_t n, float descale, float* out) { Fp8sToFloatsBest(in, n, descale, out); }
void Fp8sToFloats(const Float8E5M2* in, int64_t n, float descale, float* out) { Fp8sToFloatsBest(in, n, descale, out); }

void BFloat16sToFloats(const BFloat16* in, int64_t n, float* out) {
  RunWithWidestVectors<&BFloat16sToFloatsBody, &BFloat16sToFloatsBody>(in, n, out);
}

void Float16sToFloats(const Float16* in, int64_t n, float* out) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (CpuIsa() >= Isa::kAvx2) return Float16sToFloatsF16c(in, n, out);
#endif
  Float16sToFloatsScalar(in, n, out);
}

}  // namespace te_jax::cpu
