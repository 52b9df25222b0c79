// The default backward's float dq accumulator (the call's workspace), shared by both kernel families: the preprocess
// (backward_row_kernels.cuh) zeroes it, a dk/dv kernel (sm80's, or sm90's for head dims up to 128) adds each step's
// ds k to it, and the conversion kernel turns it into dq. Its layout (common/tile_size.h: BackwardDqAccumLayout) has
// row blocks that are a multiple of both families' query steps.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/tile_size.h"

namespace te_jax::cuda {

// The accumulator of (kD, kDv) calls.
template <int kD, int kDv>
struct DqAccum {
  static constexpr DqAccumLayout kLayout = BackwardDqAccumLayout(kD, kDv);
  static constexpr int kSwizzle = kLayout.swizzle;

  // Where column col of row i is stored within its row (the layout's swizzle).
  static __device__ __forceinline__ int Column(int i, int col) { return col ^ ((i & kSwizzle) * 4); }

  static __device__ __forceinline__ int64_t Rows(const ShapeArgs& s) {
    return (static_cast<int64_t>(s.seqlen_q) + kLayout.row_block - 1) / kLayout.row_block * kLayout.row_block;
  }
  // Offset (in floats) of query row i, column 0 of `slice`, head h of batch b.
  static __device__ __forceinline__ int64_t Offset(const ShapeArgs& s, int b, int h, int slice, int i) {
    return ((static_cast<int64_t>(b) * s.num_heads + h) * kLayout.slices + slice) * Rows(s) * kLayout.cols +
           static_cast<int64_t>(i) * kLayout.cols;
  }
};

}  // namespace te_jax::cuda
