// The backward's row-wise kernels, which both kernel families launch around their dk/dv kernels: the preprocess
// (delta_i - dlse_i per query row, and zeroing the float accumulators), the conversion of the float dq accumulator to
// dq, and the conversion of the float dbias accumulator to dbias. One warp per row; plain loads, any arch.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/bias_element.h"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/dq_accum.h"
#include "cpp/cuda/kernels/common/tile_size.h"
#include "cpp/cuda/kernels/primitives/element.h"

namespace te_jax::cuda {

// Rows of the backward's row-wise kernels: one warp per (b, i, h) row of q, out and dq, rows in memory order.
struct RowOfWarp {
  int64_t row;  // (b * Sq + i) * H + h
  int b, i, h;
  bool valid;
  int lane;

  static __device__ __forceinline__ RowOfWarp Get(const ShapeArgs& s) {
    RowOfWarp r;
    r.lane = threadIdx.x & 31;
    r.row = static_cast<int64_t>(blockIdx.x) * (kRowKernelThreads / 32) + (threadIdx.x >> 5);
    r.valid = r.row < static_cast<int64_t>(s.batch) * s.seqlen_q * s.num_heads;
    r.h = static_cast<int>(r.row % s.num_heads);
    const int64_t bi = r.row / s.num_heads;
    r.i = static_cast<int>(bi % s.seqlen_q);
    r.b = static_cast<int>(bi / s.seqlen_q);
    return r;
  }
};

// rowsum(out * dout) over one row of kDv elements, summed over the warp (every lane gets the sum).
template <typename Element, int kDv>
__device__ __forceinline__ float WarpRowDot(const uint16_t* out_row, const uint16_t* dout_row, int lane) {
  const uint32_t* o = reinterpret_cast<const uint32_t*>(out_row);
  const uint32_t* d = reinterpret_cast<const uint32_t*>(dout_row);
  float acc = 0.0f;
  for (int c = lane; c < kDv / 2; c += 32) {
    const uint32_t a = o[c], bb = d[c];
    acc += Element::ToFloat(static_cast<uint16_t>(a & 0xffff)) * Element::ToFloat(static_cast<uint16_t>(bb & 0xffff));
    acc += Element::ToFloat(static_cast<uint16_t>(a >> 16)) * Element::ToFloat(static_cast<uint16_t>(bb >> 16));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// kBias: the module takes a bias, whose float dbias accumulator (when the call has one) this kernel zeroes too.
template <typename Element, int kD, int kDv, bool kBias = false>
struct BackwardPreprocessKernel {
  static constexpr int kThreads = kRowKernelThreads;
  // Writes scratch[(b * H + h) * Sq + i] = rowsum(dout * out) - dlse and, when the call accumulates dq in float,
  // zeroes that row of the accumulator.
  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    const ShapeArgs& s = args.shape;
    const RowOfWarp w = RowOfWarp::Get(s);
    if (!w.valid) return;
    const float acc = WarpRowDot<Element, kDv>(static_cast<const uint16_t*>(args.out) + w.row * kDv,
                                               static_cast<const uint16_t*>(args.dout) + w.row * kDv, w.lane);
    if (args.dq_accum != nullptr) {
      using Accum = DqAccum<kD, kDv>;
#pragma unroll
      for (int slice = 0; slice < Accum::kLayout.slices; ++slice) {
        float4* row = reinterpret_cast<float4*>(args.dq_accum + Accum::Offset(s, w.b, w.h, slice, w.i));
        for (int c = w.lane; c < Accum::kLayout.cols / 4; c += 32) row[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    }
    if constexpr (kBias) {
      if (args.dbias_accum != nullptr) ZeroBiasGradRow(args, w);
    }
    if (w.lane == 0) {
      const int64_t at = (static_cast<int64_t>(w.b) * s.num_heads + w.h) * s.seqlen_q + w.i;
      args.delta_scratch[at] = acc - args.dlse[at];
    }
  }

  // The dbias accumulator row of (b, h, i), zeroed by the one warp whose coordinates along the bias's broadcast dims
  // are 0.
  static __device__ __forceinline__ void ZeroBiasGradRow(const BackwardArgs& args, const RowOfWarp& w) {
    const BiasArgs& bias = args.bias;
    if ((bias.batch_stride == 0 && w.b != 0) || (bias.head_stride == 0 && w.h != 0) ||
        (bias.query_stride == 0 && w.i != 0)) {
      return;
    }
    float* row = args.dbias_accum + w.b * bias.batch_stride + w.h * bias.head_stride +
                 static_cast<int64_t>(w.i) * bias.query_stride;
    const int keys = bias.key_stride == 0 ? 1 : args.shape.seqlen_kv;
    for (int j = w.lane; j < keys; j += 32) row[j] = 0.0f;
  }
};

// The fast backward's last step: the float dq accumulator to dq's element type (NaN for a batch with invalid lengths).
template <typename Element, int kD, int kDv>
struct BackwardDqConvertKernel {
  static constexpr int kThreads = kRowKernelThreads;
  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    using Accum = DqAccum<kD, kDv>;
    const ShapeArgs& s = args.shape;
    const RowOfWarp w = RowOfWarp::Get(s);
    if (!w.valid) return;
    const bool invalid = ReadLengths(s, args.q_seqlens, args.kv_seqlens, w.b).invalid;
    uint2* dq = reinterpret_cast<uint2*>(static_cast<uint16_t*>(args.dq) + w.row * kD);
    for (int c = w.lane; c < kD / 4; c += 32) {
      const int col = 4 * c, slice = col / Accum::kLayout.cols;  // 4 columns never straddle a slice (cols % 16 == 0)
      const float4 x = *reinterpret_cast<const float4*>(args.dq_accum + Accum::Offset(s, w.b, w.h, slice, w.i) +
                                                        Accum::Column(w.i, col - slice * Accum::kLayout.cols));
      dq[c] = invalid ? make_uint2(kPackedNaN, kPackedNaN) : make_uint2(Element::Pack(x.x, x.y), Element::Pack(x.z, x.w));
    }
  }
};

// The last step where dbias sums over some dim: its float accumulator to the bias's element type.
template <typename Bias>
struct BiasGradConvertKernel {
  static constexpr int kThreads = kRowKernelThreads;
  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    using Element = BiasElementOf<Bias>;
    auto* dbias = static_cast<typename Element::Storage*>(args.dbias);
    const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < args.bias.elements; i += step) {
      Element::StoreGlobal(dbias + i, args.dbias_accum[i]);
    }
  }
};

}  // namespace te_jax::cuda
