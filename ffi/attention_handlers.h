// The bodies of the attention FFI handlers, shared by the CPU and CUDA backends: decode the operands and attributes
// into the core's AttentionParams and buffers (ffi_params.h), then run the backend. A backend supplies its context
// (thread pool or stream) and `kRun`, so the two cannot decode a call differently.
#pragma once

#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "ffi/ffi_params.h"
#include "ffi/ffi_status.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::ffi_handlers {

template <typename Context, Status (*kRun)(const AttentionParams&, const ForwardBuffers&, Context)>
xla::ffi::Error AttentionForward(Context context, xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer k, xla::ffi::AnyBuffer v,
                                 xla::ffi::AnyBuffer q_seqlens, xla::ffi::AnyBuffer kv_seqlens,
                                 xla::ffi::AnyBuffer alibi_slopes, xla::ffi::AnyBuffer sinks,
                                 xla::ffi::AnyBuffer q_segment_ids, xla::ffi::AnyBuffer kv_segment_ids,
                                 xla::ffi::AnyBuffer q_positions, xla::ffi::AnyBuffer kv_positions,
                                 xla::ffi::AnyBuffer page_table, xla::ffi::AnyBuffer kv_descale,
                                 xla::ffi::AnyBuffer bias, xla::ffi::AnyBuffer dropout,
                                 xla::ffi::RemainingArgs captures, xla::ffi::Result<xla::ffi::AnyBuffer> out,
                                 xla::ffi::Result<xla::ffi::AnyBuffer> lse,
                                 xla::ffi::Result<xla::ffi::AnyBuffer> workspace, AttentionAttrs attrs) {
  AttentionParams params;
  const TokenArgs tokens{q_segment_ids, kv_segment_ids, q_positions, kv_positions};
  std::vector<const void*> capture_data;
  Status status = ParamsFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks, tokens, page_table,
                                kv_descale, bias, dropout, attrs, &params);
  if (status.ok()) status = FlexFromFfi(captures, attrs, &params.flex, &capture_data);
  if (!status.ok()) return ToFfiError(status);
  AttentionOperands operands =
      OperandsFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks, tokens, page_table, kv_descale,
                      bias, dropout);
  operands.flex_captures = capture_data.data();
  return ToFfiError(kRun(params, ForwardBuffersFromFfi(operands, *out, *lse, *workspace), context));
}

template <typename Context, Status (*kRun)(const AttentionParams&, const BackwardBuffers&, Context)>
xla::ffi::Error AttentionBackward(Context context, xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer k,
                                  xla::ffi::AnyBuffer v, xla::ffi::AnyBuffer out, xla::ffi::AnyBuffer lse,
                                  xla::ffi::AnyBuffer dout, xla::ffi::AnyBuffer dlse, xla::ffi::AnyBuffer q_seqlens,
                                  xla::ffi::AnyBuffer kv_seqlens, xla::ffi::AnyBuffer alibi_slopes,
                                  xla::ffi::AnyBuffer sinks, xla::ffi::AnyBuffer q_segment_ids,
                                  xla::ffi::AnyBuffer kv_segment_ids, xla::ffi::AnyBuffer q_positions,
                                  xla::ffi::AnyBuffer kv_positions, xla::ffi::AnyBuffer page_table,
                                  xla::ffi::AnyBuffer kv_descale, xla::ffi::AnyBuffer bias,
                                  xla::ffi::AnyBuffer dropout, xla::ffi::RemainingArgs captures, xla::ffi::Result<xla::ffi::AnyBuffer> dq,
                                  xla::ffi::Result<xla::ffi::AnyBuffer> dk,
                                  xla::ffi::Result<xla::ffi::AnyBuffer> dv, xla::ffi::Result<xla::ffi::AnyBuffer> dbias,
                                  xla::ffi::Result<xla::ffi::AnyBuffer> workspace,
                                  xla::ffi::RemainingRets capture_grads, AttentionAttrs attrs) {
  AttentionParams params;
  const TokenArgs tokens{q_segment_ids, kv_segment_ids, q_positions, kv_positions};
  std::vector<const void*> capture_data;
  std::vector<void*> grad_data;
  Status status = ParamsFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks, tokens, page_table,
                                kv_descale, bias, dropout, attrs, &params);
  if (status.ok()) status = FlexFromFfi(captures, attrs, &params.flex, &capture_data);
  if (status.ok()) status = CaptureGradientsFromFfi(capture_grads, params.flex, &grad_data);
  if (status.ok()) status = ExpectDbiasLikeBias(bias, *dbias);
  if (!status.ok()) return ToFfiError(status);
  AttentionOperands operands =
      OperandsFromFfi(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks, tokens, page_table, kv_descale,
                      bias, dropout);
  operands.flex_captures = capture_data.data();
  BackwardBuffers buffers = BackwardBuffersFromFfi(operands, out, lse, dout, dlse, *dq, *dk, *dv, *dbias, *workspace);
  buffers.flex_capture_grads = grad_data.data();
  return ToFfiError(kRun(params, buffers, context));
}

}  // namespace te_jax::ffi_handlers
