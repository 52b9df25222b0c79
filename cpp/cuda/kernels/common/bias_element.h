// The additive logit bias's element types in the CUDA kernels: 16-bit types (BFloat16, Float16) stored as
// uint16_t, Float32 as float, with the loads and stores the bias tiles of both families (sm80/bias_tile.h,
// sm90/bias_tile.h) and the dbias writes need.
// The tiles are read through 32-bit shared-window addresses by volatile asm: staged per stage and indexed at run time,
// a generic pointer loses its state space, and the 64-bit generic loads cost the sm80 d = 128 forward its registers.
// Only these asm statements touch the tiles, so they need no memory clobber (which would make the compiler reload every
// shared-memory value of the fragment loop after each dS store); being volatile, they stay behind the barrier waits
// (volatile asm with a memory clobber) that say a tile has landed.
#pragma once

#include "cpp/cuda/kernels/primitives/element.h"

namespace te_jax::cuda {

template <typename Bias>
struct BiasElementOf {
  using Storage = uint16_t;
  static __device__ __forceinline__ float LoadShared(uint32_t addr) {
    uint32_t x;
    asm volatile("ld.shared.u16 %0, [%1];" : "=r"(x) : "r"(addr));
    return Bias::ToFloat(static_cast<uint16_t>(x));
  }
  // Elements c and c + 1 of a row (c even: one 32-bit word).
  static __device__ __forceinline__ float2 LoadSharedPair(uint32_t addr) {
    uint32_t x;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(x) : "r"(addr));
    return make_float2(Bias::ToFloat(static_cast<uint16_t>(x & 0xffffu)),
                       Bias::ToFloat(static_cast<uint16_t>(x >> 16)));
  }
  static __device__ __forceinline__ uint16_t LoadGlobal(const uint16_t* p) { return __ldg(p); }
  static __device__ __forceinline__ uint32_t Splat(uint16_t x) { return static_cast<uint32_t>(x) * 0x10001u; }
  static __device__ __forceinline__ void StoreGlobal(uint16_t* p, float x) {
    __stcg(p, static_cast<uint16_t>(Bias::Pack(x, 0.0f)));
  }
};

template <>
struct BiasElementOf<Float32> {
  using Storage = float;
  static __device__ __forceinline__ float LoadShared(uint32_t addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr));
    return x;
  }
  static __device__ __forceinline__ float2 LoadSharedPair(uint32_t addr) {
    float2 x;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(x.x), "=f"(x.y) : "r"(addr));
    return x;
  }
  static __device__ __forceinline__ float LoadGlobal(const float* p) { return __ldg(p); }
  static __device__ __forceinline__ uint32_t Splat(float x) { return __float_as_uint(x); }
  static __device__ __forceinline__ void StoreGlobal(float* p, float x) { __stcg(p, x); }
};

}  // namespace te_jax::cuda
