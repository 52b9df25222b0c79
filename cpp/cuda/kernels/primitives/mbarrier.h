// mbarriers (sm90): the shared-memory barriers that a TMA copy completes on (counting bytes) and that consumer warps
// arrive on to hand a pipeline stage back. A barrier moves through phases; a waiter names the parity of the phase whose
// completion it waits for, so a ring of stages needs no reset: stage s of pass i waits for parity (i / stages) & 1.
// Addresses are 32-bit shared-window offsets (primitives/shared_memory.h).
#pragma once

#include "cpp/cuda/kernels/primitives/shared_memory.h"

namespace te_jax::cuda {

__device__ __forceinline__ void MbarrierInit(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the initialisations visible to the async proxy (the TMA unit) before any copy names the barriers.
__device__ __forceinline__ void FenceMbarrierInit() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// One arrival that also tells the barrier to wait for `bytes` more bytes of copies before the phase completes.
__device__ __forceinline__ void MbarrierArriveExpectBytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void MbarrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Stress builds (TE_JAX_PIPELINE_STRESS=1 in the environment; kernel_config.h) sleep a pseudo-random while, up to
// about 2 us, before each wait on a barrier and each hand-over of a stage (pipeline.h), so that a missing wait shows up
// as wrong results in the tests instead of hiding behind the usual timing. Other builds compile it to nothing.
__device__ __forceinline__ void StressDelay() {
#if defined(TE_JAX_PIPELINE_STRESS)
  uint32_t x = static_cast<uint32_t>(clock64()) * 2654435761u ^ (threadIdx.x * 40503u + blockIdx.x * 2246822519u);
  x ^= x >> 13;
  __nanosleep(x % 2048u);
#endif
}

// Spins until the phase with this parity has completed. A barrier that has not completed any phase yet counts the
// phase before it (parity 1) as complete, which is how a producer's first pass over empty stages goes through.
__device__ __forceinline__ void MbarrierWait(uint32_t bar, uint32_t parity) {
  StressDelay();
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

}  // namespace te_jax::cuda
