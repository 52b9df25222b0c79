// Eight float32 lanes as a GCC vector type. The kernels are written once against it: inside the AVX2 clone of a
// multiversioned routine (isa_dispatch.h) a value is one ymm register, inside the baseline clone two xmm registers.
#pragma once

#include <cstdint>

// GCC warns, in every file returning these types by value, that the baseline ABI returns 32-byte vectors differently
// from AVX. Nothing here crosses a library boundary (the helpers inline into each clone), so for the kernel files that
// include this header the warning is noise and is turned off. Parameters go by reference, which has one ABI.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace te_jax::cpu {

inline constexpr int64_t kLanes = 8;
// Lane counts (a tile's rows, a product's columns) come in whole F32x8 vectors.
inline constexpr int64_t RoundUpToLanes(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

typedef float F32x8 __attribute__((vector_size(32)));
typedef int32_t I32x8 __attribute__((vector_size(32)));
typedef float F32x4 __attribute__((vector_size(16)));
typedef int32_t I32x4 __attribute__((vector_size(16)));
// Same vector, for loads and stores at any float-aligned address.
typedef float F32x8Unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t I32x8Unaligned __attribute__((vector_size(32), aligned(4), may_alias));

inline F32x8 Load(const float* p) { return *reinterpret_cast<const F32x8Unaligned*>(p); }
inline I32x8 Load(const int32_t* p) { return *reinterpret_cast<const I32x8Unaligned*>(p); }
inline void Store(float* p, const F32x8& v) { *reinterpret_cast<F32x8Unaligned*>(p) = v; }
inline void StoreI(int32_t* p, const I32x8& v) { *reinterpret_cast<I32x8Unaligned*>(p) = v; }
// Written as a shuffle: GCC 12 expands the obvious {x, x, ...} into eight inserts inside target("avx2") functions.
inline F32x8 Splat(float x) {
  const F32x4 v = {x};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}
inline I32x8 Splat(int32_t x) {
  const I32x4 v = {x};
  return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}
}  // namespace te_jax::cpu
