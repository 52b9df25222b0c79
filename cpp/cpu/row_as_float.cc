#include "cpp/cpu/row_as_float.h"

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

}  // namespace

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
