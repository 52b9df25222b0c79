// Hopper's bulk asynchronous reduction (sm90+): one thread hands a contiguous shared-memory block to the copy engine,
// which adds it element-wise to global memory. Used for the backward's float dq accumulator, where per-thread atomics
// from registers cost ~20% of the fused dk/dv + dq kernel on an H200. Kernels call these only when kHasBulkReduce;
// they compile to nothing for older targets, so one kernel body serves both.
#pragma once

#include "cpp/cuda/kernels/primitives/shared_memory.h"

namespace te_jax::cuda {

#if __CUDA_ARCH__ >= 900
inline constexpr bool kHasBulkReduce = true;
#else
inline constexpr bool kHasBulkReduce = false;
#endif

// global[0, bytes) += shared[0, bytes) as float32; bytes a multiple of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void BulkReduceAddF32(float* global, uint32_t smem_addr, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               "cp.async.bulk.commit_group;" ::"l"(global), "r"(smem_addr), "r"(bytes) : "memory");
#endif
}

// Waits until every reduction this thread issued has read its shared-memory source (the block may be overwritten).
__device__ __forceinline__ void BulkWaitSharedRead() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}

// Waits until every reduction this thread issued has completed in global memory.
__device__ __forceinline__ void BulkWaitComplete() {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

}  // namespace te_jax::cuda
