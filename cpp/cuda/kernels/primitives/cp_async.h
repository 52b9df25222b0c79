// cp.async (sm80): global -> shared copies that bypass registers, grouped and waited on for software pipelining.
// A source size of 0 writes zeros, which is how out-of-range rows and head-dim padding are filled.
#pragma once

#include "cpp/cuda/kernels/primitives/mma.h"

namespace te_jax::cuda {

__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0));
}

// Copies the first `bytes` (0 to 16) of a 16-byte chunk and zero-fills the rest (both addresses 16-byte aligned).
__device__ __forceinline__ void CpAsync16Partial(uint32_t smem_addr, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr), "l"(gmem), "r"(bytes));
}

__device__ __forceinline__ void CpAsync8(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 8 : 0));
}

__device__ __forceinline__ void CpAsync4(uint32_t smem_addr, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr), "l"(gmem), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;"); }

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending));
}

}  // namespace te_jax::cuda
