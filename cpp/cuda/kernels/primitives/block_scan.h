// A CTA-wide exclusive scan of one value per thread (warp shuffles, then the warps' totals through shared memory), for
// the few small table kernels that order their rows on the device.
#pragma once

#include "cpp/core/host_device.h"

namespace te_jax::cuda {

// Every thread of the kThreads gets op over the values of the threads before it (`identity` for thread 0), and
// `total` op over all of them. `warp_totals` is kThreads / 32 ints of shared memory; the scan begins and ends with a
// __syncthreads, so it may be reused at once.
template <int kThreads, typename Op>
__device__ __forceinline__ int BlockExclusiveScan(int value, int identity, Op op, int* warp_totals, int& total) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inclusive = value;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, off);
    if (lane >= off) inclusive = op(other, inclusive);
  }
  __syncthreads();  // earlier readers of warp_totals are done
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int before = identity;  // the warps before this one
  total = identity;
  for (int w = 0; w < kWarps; ++w) {
    if (w == warp) before = total;
    total = op(total, warp_totals[w]);
  }
  int exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
  if (lane == 0) exclusive = identity;
  __syncthreads();
  return op(before, exclusive);
}

}  // namespace te_jax::cuda
