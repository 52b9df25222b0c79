// TMA (sm90): bulk tensor copies from global to shared memory, described by a tensor map the host encodes
// (cuTensorMapEncodeTiled; cpp/cuda/tensor_maps.h) and passes as a __grid_constant__ kernel parameter. A copy writes a
// whole box, filling what lies outside the tensor with zeros, and counts its bytes on an mbarrier (mbarrier.h). Plain
// bulk copies of contiguous bytes (the token tables) count theirs the same way.
#pragma once

#include "cpp/cuda/kernels/primitives/shared_memory.h"

namespace te_jax::cuda {

// Loads the box at coordinates (c0, c1, c2, c3), innermost first, of a 4-D tensor map into shared memory at `dst`.
__device__ __forceinline__ void TmaLoad4d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];"
      ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Brings the box at coordinates (c0, c1, c2, c3) of a 4-D tensor map into L2, with nothing to wait for: a later copy of
// it to shared memory then reads L2 instead of device memory.
__device__ __forceinline__ void TmaPrefetch4d(const void* map, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];" ::"l"(map), "r"(c0), "r"(c1),
               "r"(c2), "r"(c3)
               : "memory");
}

// Loads the box at coordinates (c0, c1, c2), innermost first, of a 3-D tensor map (the bias's, sm90/bias_tile.h).
__device__ __forceinline__ void TmaLoad3d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(dst), "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Copies `bytes` of contiguous global memory to shared memory (both addresses 16-byte aligned, bytes a multiple of 16),
// counting them on the mbarrier `bar` like a tensor copy.
__device__ __forceinline__ void BulkLoad(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Brings a tensor map (kernel parameter space) into the TMA unit's cache before its first copy.
__device__ __forceinline__ void PrefetchTensorMap(const void* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
}

}  // namespace te_jax::cuda
