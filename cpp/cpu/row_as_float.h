// A row of q, k, v or dO as the float32 the kernels compute in. The conversion is exact in every ISA; float16 takes
// the F16C instruction where the CPU has it, as its bit-by-bit conversion cost more than the tile products it feeds
// (a float16 forward ran 2.4x slower than float32: each K/V tile is converted once per query tile), and bfloat16's
// shift runs in the widest vectors the CPU has (in the library's baseline build it cost one-query decode 15-20%).
#pragma once

#include <cstdint>
#include <type_traits>

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

// An FP8 KV cache's elements dequantized: out[i] = in[i] as float32 * descale, the product XLA's dequantization makes
// (te_jax.dequantize_fp8), i < n. Each row of a K/V tile is converted once, as it is copied for the tile's products.
void Fp8sToFloats(const Float8E4M3* in, int64_t n, float descale, float* out);
void Fp8sToFloats(const Float8E5M2* in, int64_t n, float descale, float* out);

template <typename T>
inline constexpr bool kIsFp8 = std::is_same_v<T, Float8E4M3> || std::is_same_v<T, Float8E5M2>;

}  // namespace te_jax::cpu
