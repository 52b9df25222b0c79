#include "ffi/cuda_handlers.h"

#include <cuda.h>

#include <cstdint>

#include "cpp/cuda/attention_cuda.h"
#include "ffi/attention_signature.h"
#include "ffi/ffi_params.h"
#include "ffi/ffi_status.h"

namespace te_jax::ffi_handlers {
namespace ffi = xla::ffi;
namespace {

ffi::Error ForwardCuda(CUstream stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
    ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens, ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer q_segment_ids,
    ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer q_positions, ffi::AnyBuffer kv_positions, ffi::AnyBuffer page_table,
    ffi::AnyBuffer bias, ffi::AnyBuffer dropout, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
    ffi::Result<ffi::AnyBuffer> workspace, int64_t mask_type, int64_t window_left, int64_t window_right, float scale,
    float softcap, bool has_alibi, bool deterministic, int64_t engine, bool has_segment_ids, bool has_positions,
    bool has_bias, int64_t dropout_threshold, int64_t page_size) {
  AttentionParams params;
  const AttentionAttrs attrs{mask_type, window_left, window_right, scale, softcap, has_alibi, deterministic,
                             engine, has_segment_ids, has_positions, has_bias, dropout_threshold, page_size};
  const TokenArgs tokens{q_segment_ids, kv_segment_ids, q_positions, kv_positions};
  Status status = ParamsFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, tokens, page_table, bias, dropout,
                                attrs, &params);
  if (!status.ok()) return ToFfiError(status);
  return ToFfiError(cuda::AttentionForward(params,
                                           ForwardBuffersFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, tokens,
                                                                 page_table, bias, dropout, *out, *lse, *workspace),
                                           stream));
}

ffi::Error BackwardCuda(CUstream stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer out,
    ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse, ffi::AnyBuffer q_seqlens, ffi::AnyBuffer kv_seqlens,
    ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
    ffi::AnyBuffer q_positions, ffi::AnyBuffer kv_positions, ffi::AnyBuffer page_table, ffi::AnyBuffer bias,
    ffi::AnyBuffer dropout, ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
    ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> workspace,
    int64_t mask_type, int64_t window_left, int64_t window_right, float scale, float softcap, bool has_alibi,
    bool deterministic, int64_t engine, bool has_segment_ids, bool has_positions, bool has_bias,
    int64_t dropout_threshold, int64_t page_size) {
  AttentionParams params;
  const AttentionAttrs attrs{mask_type, window_left, window_right, scale, softcap, has_alibi, deterministic,
                             engine, has_segment_ids, has_positions, has_bias, dropout_threshold, page_size};
  const TokenArgs tokens{q_segment_ids, kv_segment_ids, q_positions, kv_positions};
  Status status = ParamsFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, tokens, page_table, bias, dropout,
                                attrs, &params);
  if (status.ok()) status = ExpectDbiasLikeBias(bias, *dbias);
  if (!status.ok()) return ToFfiError(status);
  return ToFfiError(cuda::AttentionBackward(
      params,
      BackwardBuffersFromFfi(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi_slopes, tokens, page_table,
                             bias, dropout, *dq, *dk, *dv, *dbias, *workspace),
      stream));
}

}  // namespace
}  // namespace te_jax::ffi_handlers

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxAttentionForwardCuda, te_jax::ffi_handlers::ForwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>() TE_JAX_FFI_FORWARD_SIGNATURE,
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxAttentionBackwardCuda, te_jax::ffi_handlers::BackwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>() TE_JAX_FFI_BACKWARD_SIGNATURE,
                              {xla::ffi::Traits::kCmdBufferCompatible});
