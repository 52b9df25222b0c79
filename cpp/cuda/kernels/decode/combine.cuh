// The split-KV combine: merges the splits' partial results of each query row (attention_decode.cuh) by their
// log-sum-exp, out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max lse), lse = max lse + log sum_s w_s (the
// merge of te_jax.merge_states). One warp per row (batch, position, head).
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/online_softmax.h"
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/kernels/primitives/dependent_launch.h"
#include "cpp/cuda/kernels/primitives/element.h"

namespace te_jax::cuda::decode {

template <typename Element, int kDv>
struct CombineKernel {
  static constexpr int kThreads = kCombineThreads;

  static __device__ __forceinline__ void Run(const DecodeArgs& a) {
    WaitForPreviousGrid();  // the decode kernel's partials (a dependent launch on sm_90+)
    const ShapeArgs& s = a.args.shape;
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);  // (b, pos, head)
    const int64_t rows = static_cast<int64_t>(s.batch) * s.seqlen_q * s.num_heads;
    if (row >= rows) return;
    const int head = static_cast<int>(row % s.num_heads);
    const int pos = static_cast<int>(row / s.num_heads % s.seqlen_q);
    const int b = static_cast<int>(row / s.num_heads / s.seqlen_q);
    const BatchLengths len = ReadLengths(s, a.args.q_seqlens, a.args.kv_seqlens, b);
    const KeyRange keys = MakeMask(s, len).Keys(pos);
    const int64_t lse_row = (static_cast<int64_t>(b) * s.num_heads + head) * s.seqlen_q + pos;
    const int64_t lse_split_stride = rows;  // [splits][B][H][Sq]
    const int64_t out_split_stride = rows * kDv;

    // Lane l holds the lse of splits l, l + 32, ...: two round trips to memory in all (the lse, then the parts), the
    // max and the sum across lanes by shuffles. fmaxf skips a NaN lse; its weight below is NaN, and so are out and lse.
    const float* part_lse = a.partial_lse + lse_row;
    float m = -__int_as_float(0x7f800000);
    for (int sp = lane; sp < a.splits; sp += 32) m = fmaxf(m, part_lse[sp * lse_split_stride]);
    m = WarpMax(m);
    // A row that sees keys but whose every part is empty had only -inf logits: 0 * inf, as one split would give.
    const bool sees_keys = keys.begin < keys.end;
    const float base = m == -__int_as_float(0x7f800000) ? 0.0f : m;
    auto weight = [&](int sp) { return Exp2((part_lse[sp * lse_split_stride] - base) * kLog2e); };
    float l = 0.0f;
    for (int sp = lane; sp < a.splits; sp += 32) l += weight(sp);
    l = WarpSum(l);
    // A NaN lse is a split's NaN logit or its entry's poison (pages outside the pool, attention_decode.cuh): with a
    // NaN logit the row is NaN by the formula anyway, and a poisoned row is NaN even where it sees no key.
    const bool poisoned = len.invalid || isnan(l);
    float inv = sees_keys ? 1.0f / l : 0.0f;
    float lse = sees_keys ? m + logf(l) : -__int_as_float(0x7f800000);
    if (a.args.sinks != nullptr) MergeSink(a.args.sinks[static_cast<int64_t>(b) * s.num_heads + head], lse, inv);

    // Lanes take 4 columns each (head dims are multiples of 8); the parts' loads of 4 splits are issued together.
    uint16_t* out = static_cast<uint16_t*>(a.args.out) + row * kDv;
    const float* part = a.partial_out + row * kDv;
    for (int col = 4 * lane; col < kDv; col += 128) {
      float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
      for (int sp = 0; sp < a.splits; ++sp) {
        const float w = weight(sp);
        const float4 y = *reinterpret_cast<const float4*>(part + sp * out_split_stride + col);
        x[0] += w * y.x;
        x[1] += w * y.y;
        x[2] += w * y.z;
        x[3] += w * y.w;
      }
      const uint2 packed = poisoned ? make_uint2(kPackedNaN, kPackedNaN)
                                       : make_uint2(Element::Pack(x[0] * inv, x[1] * inv),
                                                    Element::Pack(x[2] * inv, x[3] * inv));
      *reinterpret_cast<uint2*>(out + col) = packed;
    }
    if (lane == 0) a.args.lse[lse_row] = poisoned ? __int_as_float(0x7fffffff) : lse;
  }
};

}  // namespace te_jax::cuda::decode
