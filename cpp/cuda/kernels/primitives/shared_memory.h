// Shared-memory addresses as the 32-bit offsets into the shared window that PTX's .shared instructions take (ldmatrix,
// cp.async, mbarrier, TMA, wgmma descriptors): converted once from a generic pointer, then advanced in 32-bit arithmetic.
#pragma once

#include "cpp/core/host_device.h"

namespace te_jax::cuda {

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  uint32_t a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// Makes this thread's generic-proxy shared-memory writes visible to the copy engines (the async proxy: TMA, bulk
// copies) before they read or overwrite the same bytes. Nothing before sm_90, which has no such engines.
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

}  // namespace te_jax::cuda
