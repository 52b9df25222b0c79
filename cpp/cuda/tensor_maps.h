// TMA tensor maps of the attention operands for the sm90 family: q, k, v and out are [B][S][H][D] with D contiguous,
// described as 4-D tensors (D, H, S, B innermost first) whose box is 64 columns x `rows` rows of one (batch, head),
// with the 128-byte swizzle the wgmma descriptors expect (kernels/primitives/swizzled_tile.h). An additive bias is described
// as a 3-D tensor of its own dims (kernels/sm90/bias_tile.h).
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"
#include "cpp/core/dtype.h"
#include "cpp/core/status.h"
#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

Status EncodeHeadsTensorMap(const DriverApi* driver, DType dtype, const void* base, int64_t batch, int64_t seqlen,
                            int64_t heads, int64_t head_dim, int rows, TensorMap* map);

// FP8 attention's v operand (cpp/core/attention_params.h): each K/V head's V^T [Dv, Skv] of one-byte keys, seen as
// byte pairs [B, Hkv, Dv, Skv / 2] (Skv a multiple of 16), in boxes of 64 pairs (128 keys) x all Dv rows with the
// 128-byte swizzle: the FP8 forward's V stage (kernels/sm90/attention_fwd.cuh).
Status EncodeTransposedValuesTensorMap(const DriverApi* driver, const void* base, int64_t batch, int64_t seqlen_kv,
                                       int64_t kv_heads, int64_t head_dim_v, TensorMap* map);

// The bias of a call (p.has_bias, its rows whole 16-byte chunks: BiasFitsTma) as [B' H'][Sq'][Skv'], boxes of 128 bytes
// of keys x `rows` query rows (1 for a query-broadcast bias).
Status EncodeBiasTensorMap(const DriverApi* driver, const AttentionParams& p, const void* base, int rows,
                           TensorMap* map);

}  // namespace te_jax::cuda
