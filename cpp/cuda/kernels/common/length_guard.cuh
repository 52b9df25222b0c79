// te_jax's contract for run-time lengths around an engine that trusts them (cuDNN reads seq_len_q / seq_len_kv as
// they come and leaves the rows they cut to its own conventions). Before the engine, GuardLengthsKernel clamps the lengths
// into [0, S], so nothing is read out of bounds. After it, EnforceLengthContractKernel writes what te_jax promises on every
// row and key the lengths decide about: a query row with no visible key (past q_len, or cut off by kv_len, the
// bottom-right diagonal or a window) gets out = 0, lse = -inf, dq = 0; a key at or past kv_len gets dk = dv = 0; every
// output of a batch entry whose lengths were out of range is NaN (as the sm80 kernels do in-kernel,
// kernels/common/block_range.h). Rows and keys the lengths do not touch are left as the engine wrote them.
#pragma once

#include "cpp/core/visible_keys.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

// One thread per batch entry (any grid that covers the batch).
struct GuardLengthsKernel {
  static __device__ __forceinline__ void Run(const LengthGuardArgs& a);
};

__device__ __forceinline__ void GuardLengthsKernel::Run(const LengthGuardArgs& a) {
  const ShapeArgs& s = a.shape;
  for (int b = blockIdx.x * blockDim.x + threadIdx.x; b < s.batch; b += gridDim.x * blockDim.x) {
    const int q = a.q_seqlens[b];
    const int kv = a.kv_seqlens[b];
    a.guarded[b] = q < 0 ? 0 : (q > s.seqlen_q ? s.seqlen_q : q);
    a.guarded[s.batch + b] = kv < 0 ? 0 : (kv > s.seqlen_kv ? s.seqlen_kv : kv);
    a.guarded[2 * s.batch + b] = q < 0 || q > s.seqlen_q || kv < 0 || kv > s.seqlen_kv;
  }
}

// Sets the `count` 16-bit elements at `row` to `bits`, the block's threads together (count is even).
__device__ __forceinline__ void FillRow(uint16_t* row, int count, uint32_t bits) {
  for (int i = threadIdx.x; i < count / 2; i += blockDim.x) reinterpret_cast<uint32_t*>(row)[i] = bits;
}

// Grid (x: blocks of kLengthGuardRowsPerBlock rows or keys, y: batch); the decisions are uniform per row, and a block
// whose rows and keys all see their keys writes nothing.
struct EnforceLengthContractKernel {
  static __device__ __forceinline__ void Run(const LengthGuardArgs& a);
};

__device__ __forceinline__ void EnforceLengthContractKernel::Run(const LengthGuardArgs& a) {
  const ShapeArgs& s = a.shape;
  const int b = blockIdx.y;
  const bool invalid = a.guarded[2 * s.batch + b] != 0;
  const int q_len = a.guarded[b], kv_len = a.guarded[s.batch + b];
  const RowMask mask = MakeRowMask(static_cast<MaskType>(s.mask_type), q_len, kv_len, s.window_left, s.window_right);
  constexpr uint32_t kNaN2 = 0x7FFF7FFFu;  // two NaNs in bfloat16 and in float16
  const int row_elems_q = s.num_heads * a.head_dim, row_elems_o = s.num_heads * a.head_dim_v;
  const int row_elems_k = s.num_kv_heads * a.head_dim, row_elems_v = s.num_kv_heads * a.head_dim_v;
  const int first = blockIdx.x * kLengthGuardRowsPerBlock;
  for (int i = first; i < first + kLengthGuardRowsPerBlock && i < s.seqlen_q; ++i) {
    const KeyRange keys = mask.Keys(i);
    if (!invalid && keys.begin < keys.end) continue;
    const int64_t row = static_cast<int64_t>(b) * s.seqlen_q + i;
    if (a.out != nullptr) FillRow(a.out + row * row_elems_o, row_elems_o, invalid ? kNaN2 : 0u);
    if (a.dq != nullptr) FillRow(a.dq + row * row_elems_q, row_elems_q, invalid ? kNaN2 : 0u);
    if (a.lse != nullptr) {
      for (int h = threadIdx.x; h < s.num_heads; h += blockDim.x) {
        a.lse[(static_cast<int64_t>(b) * s.num_heads + h) * s.seqlen_q + i] =
            invalid ? __int_as_float(0x7fffffff) : -__int_as_float(0x7f800000);
      }
    }
  }
  if (a.dk == nullptr) return;
  for (int j = first; j < first + kLengthGuardRowsPerBlock && j < s.seqlen_kv; ++j) {
    if (!invalid && j < kv_len) continue;
    const int64_t row = static_cast<int64_t>(b) * s.seqlen_kv + j;
    FillRow(a.dk + row * row_elems_k, row_elems_k, invalid ? kNaN2 : 0u);
    FillRow(a.dv + row * row_elems_v, row_elems_v, invalid ? kNaN2 : 0u);
  }
}

}  // namespace te_jax::cuda
