// Runs a hot routine in the best instruction set the CPU has, without building for one: the library is compiled
// with no -march so that it loads on any x86-64. RunWithBestIsa<&Body>(args...) compiles Body twice, once inside an
// AVX2 + FMA wrapper and once inside a baseline x86-64 wrapper; `flatten` inlines Body's whole call tree into each
// wrapper, so every helper it uses is compiled for that wrapper's ISA. The choice is made once per process.
#pragma once

namespace te_jax::cpu {

#if defined(__x86_64__) && defined(__GNUC__)

template <auto kBody, typename... Args>
__attribute__((target("avx2,fma"), flatten)) void RunWithAvx2(Args... args) {
  kBody(args...);
}

template <auto kBody, typename... Args>
__attribute__((flatten)) void RunWithBaseline(Args... args) {
  kBody(args...);
}

inline bool CpuHasAvx2Fma() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
}

template <auto kBody, typename... Args>
void RunWithBestIsa(Args... args) {
  if (CpuHasAvx2Fma()) {
    RunWithAvx2<kBody>(args...);
  } else {
    RunWithBaseline<kBody>(args...);
  }
}

#else

template <auto kBody, typename... Args>
void RunWithBestIsa(Args... args) {
  kBody(args...);
}

#endif

}  // namespace te_jax::cpu
