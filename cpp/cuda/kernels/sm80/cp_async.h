// cp.async (sm80): global -> shared copies that bypass registers, grouped and waited on for software pipelining.
// A source size of 0 writes zeros, which is how out-of-range rows and head-dim padding are filled.
#pragma once

#include "cpp/cuda/kernels/sm80/mma.h"

namespace te_jax::cuda::sm80 {

__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0));
}

// The same copy, with the L2 told to fetch the 256-byte block around the source: a key's row of k or v is 256 bytes
// at d = 128, so one DRAM request brings what the row's other chunks (and the neighbouring rows) would ask for.
__device__ __forceinline__ void CpAsync16FetchL2Block(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem),
               "r"(valid ? 16 : 0));
}

// Asks the L2 to fetch the 128-byte line holding gmem from DRAM, without waiting for it (memory-bound kernels run
// their reads ahead of the shared-memory ring this way).
__device__ __forceinline__ void PrefetchL2(const void* gmem) { asm volatile("prefetch.global.L2 [%0];" ::"l"(gmem)); }

__device__ __forceinline__ void CpAsync4(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;"); }

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

}  // namespace te_jax::cuda::sm80
