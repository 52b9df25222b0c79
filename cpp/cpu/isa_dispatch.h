// Runs a hot routine in the best instruction set the CPU has, without building for one: the library is compiled
// with no -march so that it loads on any x86-64. RunWithBestIsa<&Body>(args...) compiles Body twice, once inside an
// AVX2 + FMA wrapper and once inside a baseline x86-64 wrapper; `flatten` inlines Body's whole call tree into each
// wrapper, so every helper it uses is compiled for that wrapper's ISA. RunWithWidestVectors adds an AVX-512 version
// of a routine written for 16-lane vectors. The choice is made once per process, capped by the environment variable
// TE_JAX_CPU_ISA (te_jax/cpu_isa.py checks its value).
#pragma once

#include <cstdlib>
#include <cstring>

namespace te_jax::cpu {

enum class Isa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* IsaName(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "baseline";
}

#if defined(__x86_64__) && defined(__GNUC__)

template <auto kBody, typename... Args>
__attribute__((target("avx2,fma"), flatten)) void RunWithAvx2(Args... args) {
  kBody(args...);
}

template <auto kBody, typename... Args>
__attribute__((target("avx512f,avx2,fma"), flatten)) void RunWithAvx512(Args... args) {
  kBody(args...);
}

template <auto kBody, typename... Args>
__attribute__((flatten)) void RunWithBaseline(Args... args) {
  kBody(args...);
}

// The best of the three the CPU has, at most TE_JAX_CPU_ISA's (unset or unknown: no cap).
inline Isa CpuIsa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    Isa has = Isa::kBaseline;
    // Every AVX2 CPU also has F16C; the AVX2 level promises it to row_as_float.cc's float16 conversions.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      has = __builtin_cpu_supports("avx512f") ? Isa::kAvx512 : Isa::kAvx2;
    }
    const char* cap = std::getenv("TE_JAX_CPU_ISA");
    if (cap != nullptr && std::strcmp(cap, IsaName(Isa::kAvx2)) == 0 && has > Isa::kAvx2) has = Isa::kAvx2;
    if (cap != nullptr && std::strcmp(cap, IsaName(Isa::kBaseline)) == 0) has = Isa::kBaseline;
    return has;
  }();
  return isa;
}

template <auto kBody, typename... Args>
void RunWithBestIsa(Args... args) {
  if (CpuIsa() >= Isa::kAvx2) {
    RunWithAvx2<kBody>(args...);
  } else {
    RunWithBaseline<kBody>(args...);
  }
}

// A routine written twice, for 8-lane vectors (kNarrowBody, through RunWithBestIsa) and for AVX-512's 16 lanes
// (kWideBody).
template <auto kNarrowBody, auto kWideBody, typename... Args>
void RunWithWidestVectors(Args... args) {
  if (CpuIsa() == Isa::kAvx512) {
    RunWithAvx512<kWideBody>(args...);
  } else {
    RunWithBestIsa<kNarrowBody>(args...);
  }
}

#else

inline Isa CpuIsa() { return Isa::kBaseline; }

template <auto kBody, typename... Args>
void RunWithBestIsa(Args... args) {
  kBody(args...);
}

template <auto kNarrowBody, auto kWideBody, typename... Args>
void RunWithWidestVectors(Args... args) {
  kNarrowBody(args...);
}

#endif

}  // namespace te_jax::cpu
