// The two vector widths of the CPU kernels behind one interface, so that a routine is written once as a template on its
// vector type: F32x8 (one ymm register in the AVX2 build of a routine, two xmm in the baseline build) and F32x16 (one
// zmm register, in the AVX-512 build; isa_dispatch.h's RunWithWidestVectors picks the build).
#pragma once

#include <cstdint>

#include "cpp/cpu/simd_f32x8.h"

namespace te_jax::cpu {

typedef float F32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));
typedef float F32x16Unaligned __attribute__((vector_size(64), aligned(4), may_alias));

template <typename V>
struct Vector;

template <>
struct Vector<F32x8> {
  using Int = I32x8;
  static constexpr int kWidth = 8;
  static F32x8 Load(const float* p) { return cpu::Load(p); }
  static void Store(float* p, const F32x8& v) { cpu::Store(p, v); }
  static F32x8 Splat(float x) { return cpu::Splat(x); }
};

template <>
struct Vector<F32x16> {
  using Int = I32x16;
  static constexpr int kWidth = 16;
  static F32x16 Load(const float* p) { return *reinterpret_cast<const F32x16Unaligned*>(p); }
  static void Store(float* p, const F32x16& v) { *reinterpret_cast<F32x16Unaligned*>(p) = v; }
  // From a 16-lane vector: a narrower source (as F32x8's Splat has) goes through the stack here, and the 64-byte load
  // of a 16-byte store stalls every broadcast (the tile products ran 10x slower).
  static F32x16 Splat(float x) {
    const F32x16 v = {x};
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  }
};

// Lane-wise max that ignores a NaN in `b` (as fmaxf does), so a row's running max stays a number and the NaN reaches
// the row through its exponential instead (Exp2 propagates it): the kernels follow IEEE arithmetic over the
// visible keys.
template <typename V>
inline V Max(const V& a, const V& b) {
  return b > a ? b : a;
}

// body(V{}, r) for each full vector of V in [0, lanes), then body(F32x8{}, r) for the last kLanes lanes when V is
// wider (lanes is a multiple of kLanes). The first argument only carries the vector type.
template <typename V, typename Body>
inline void ForEachLaneVector(int64_t lanes, Body&& body) {
  int64_t r = 0;
  for (; r + Vector<V>::kWidth <= lanes; r += Vector<V>::kWidth) body(V{}, r);
  if (r < lanes) body(F32x8{}, r);
}

}  // namespace te_jax::cpu
