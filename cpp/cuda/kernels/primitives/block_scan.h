// A CTA-wide exclusive scan of one value per thread (warp shuffles, then the warps' totals scanned by one warp), for
// the few small table kernels that order their rows on the device. Each warp does a fixed few steps whatever the CTA's
// size: those kernels run few CTAs, whose time is the instructions they issue.
#pragma once

#include "cpp/core/host_device.h"

namespace te_jax::cuda {

__device__ __forceinline__ int ShuffleUp(int v, int delta) { return __shfl_up_sync(0xffffffffu, v, delta); }
__device__ __forceinline__ int2 ShuffleUp(int2 v, int delta) {
  return make_int2(__shfl_up_sync(0xffffffffu, v.x, delta), __shfl_up_sync(0xffffffffu, v.y, delta));
}

// Each lane gets op over the values of lanes 0..lane.
template <typename T, typename Op>
__device__ __forceinline__ T WarpInclusiveScan(T value, Op op, int lane) {
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const T other = ShuffleUp(value, off);
    if (lane >= off) value = op(other, value);
  }
  return value;
}

// Every thread of the kThreads gets op over the values of the threads before it (`identity` for thread 0), and
// `total` op over all of them. `warp_totals` is kThreads / 32 values of shared memory; the scan begins and ends with a
// __syncthreads, so it may be reused at once.
template <int kThreads, typename T, typename Op>
__device__ __forceinline__ T BlockExclusiveScan(T value, T identity, Op op, T* warp_totals, T& total) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T inclusive = WarpInclusiveScan(value, op, lane);
  __syncthreads();  // earlier readers of warp_totals are done
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {  // each warp's slot becomes op over the warps up to it
    const T t = WarpInclusiveScan(lane < kWarps ? warp_totals[lane] : identity, op, lane);
    if (lane < kWarps) warp_totals[lane] = t;
  }
  __syncthreads();
  const T before = warp > 0 ? warp_totals[warp - 1] : identity;
  total = warp_totals[kWarps - 1];
  T exclusive = ShuffleUp(inclusive, 1);
  if (lane == 0) exclusive = identity;
  __syncthreads();
  return op(before, exclusive);
}

}  // namespace te_jax::cuda
