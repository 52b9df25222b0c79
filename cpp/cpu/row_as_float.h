// A row of q, k, v or dO as the float32 the kernels compute in. The conversion is exact in every ISA; float16 takes
// the F16C instruction where the CPU has it, as its bit-by-bit conversion cost more than the tile products it feeds
// (a float16 forward ran 2.4x slower than float32: each K/V tile is converted once per query tile), and bfloat16's
// shift runs in the widest vectors the CPU has (in the library's baseline build it cost one-query decode 15-20%).
#pragma once

#include <array>
#include <cstdint>

#include "cpp/cpu/element_types.h"

namespace te_jax::cpu {

// out[i] = in[i] as float32, i < n.
void Float16sToFloats(const Float16* in, int64_t n, float* out);
void BFloat16sToFloats(const BFloat16* in, int64_t n, float* out);

template <typename T>
void RowAsFloat(const T* row, int64_t dim, float* out) {
  for (int64_t d = 0; d < dim; ++d) out[d] = ToFloat(row[d]);
}

inline void RowAsFloat(const Float16* row, int64_t dim, float* out) { Float16sToFloats(row, dim, out); }
inline void RowAsFloat(const BFloat16* row, int64_t dim, float* out) { BFloat16sToFloats(row, dim, out); }

// An FP8 KV cache's rows: each byte's float32 value looked up in a table of the format's 256 (a decode tile converts
// every element of its K/V rows once; ToFloat's branches per element cost more than the lookup).
template <typename T>
void Fp8sToFloats(const T* in, int64_t n, float* out) {
  static const auto table = [] {
    std::array<float, 256> values;
    for (int bits = 0; bits < 256; ++bits) values[bits] = ToFloat(T{static_cast<uint8_t>(bits)});
    return values;
  }();
  for (int64_t i = 0; i < n; ++i) out[i] = table[in[i].bits];
}
inline void RowAsFloat(const Float8E4M3* row, int64_t dim, float* out) { Fp8sToFloats(row, dim, out); }
inline void RowAsFloat(const Float8E5M2* row, int64_t dim, float* out) { Fp8sToFloats(row, dim, out); }

}  // namespace te_jax::cpu
