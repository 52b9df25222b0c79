// Maps the positional buffer arrays of a legacy custom call onto the core's buffer structs. The operand order is the
// one the Python lowering emits (te_jax/_primitives.py), the same as the FFI handlers' Arg/Ret order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "cpp/core/attention_params.h"
#include "cpp/core/bias.h"
#include "cpp/core/dtype.h"

namespace te_jax::legacy {

// Both directions end their inputs with the four packed-sequence operands: q_segment_ids, kv_segment_ids, q_positions,
// kv_positions ([1, 1] placeholders when the descriptor's flags say they are absent), then page_table (int32
// [B, max_pages_per_seq]; an int32 [1, 1] placeholder when page_size is 0), then kv_descale (float32 [2, blocks,
// heads] with an FP8 KV cache, else a [1, 1, 1] placeholder), then bias (a placeholder without one), then dropout
// (uint32 [6], key and offsets, which the mods read too; a placeholder without dropout or mods), then the arrays
// score_mod / mask_mod capture, as many as the call has (legacy/flex_descriptor.h; none without mods).
inline constexpr int kTokenInputs = 4;
inline constexpr int kForwardInputs = 11 + kTokenInputs;   // q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks,
                                                           // tokens, page_table, kv_descale, bias, dropout
inline constexpr int kForwardOutputs = 3;                  // out, lse, workspace
inline constexpr int kBackwardInputs = 15 + kTokenInputs;  // q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens,
                                                           // alibi_slopes, sinks, tokens, page_table, kv_descale,
                                                           // bias, dropout
inline constexpr int kBackwardOutputs = 5;                 // dq, dk, dv, dbias, workspace

// q, k, v from in[0..2]; the options from in[first]: q_seqlens, kv_seqlens, alibi_slopes, sinks, the four tokens,
// page_table, kv_descale, bias, dropout, then the captures.
inline AttentionOperands OperandsFromLegacy(const void* const* in, int first) {
  AttentionOperands o;
  o.q = in[0];
  o.k = in[1];
  o.v = in[2];
  o.q_seqlens = static_cast<const int32_t*>(in[first]);
  o.kv_seqlens = static_cast<const int32_t*>(in[first + 1]);
  o.alibi_slopes = static_cast<const float*>(in[first + 2]);
  o.sinks = static_cast<const float*>(in[first + 3]);
  o.q_segment_ids = static_cast<const int32_t*>(in[first + 4]);
  o.kv_segment_ids = static_cast<const int32_t*>(in[first + 5]);
  o.q_positions = static_cast<const int32_t*>(in[first + 6]);
  o.kv_positions = static_cast<const int32_t*>(in[first + 7]);
  o.page_table = static_cast<const int32_t*>(in[first + 4 + kTokenInputs]);
  o.kv_descale = static_cast<const float*>(in[first + 5 + kTokenInputs]);
  o.bias = in[first + 6 + kTokenInputs];
  o.dropout = static_cast<const uint32_t*>(in[first + 7 + kTokenInputs]);
  o.flex_captures = in + first + 8 + kTokenInputs;
  return o;
}

// Legacy buffers carry no sizes: `workspace_bytes` is the backend's workspace size for params, the size the lowering
// gave the workspace result from the same params.
inline ForwardBuffers ForwardBuffersFromLegacy(const void* const* in, void* const* out, int64_t workspace_bytes) {
  ForwardBuffers b;
  static_cast<AttentionOperands&>(b) = OperandsFromLegacy(in, 3);
  b.out = out[0];
  b.lse = static_cast<float*>(out[1]);
  b.workspace = out[2];
  b.workspace_bytes = workspace_bytes;
  return b;
}

inline BackwardBuffers BackwardBuffersFromLegacy(const void* const* in, void* const* out, int64_t workspace_bytes) {
  BackwardBuffers b;
  static_cast<AttentionOperands&>(b) = OperandsFromLegacy(in, 7);
  b.out = in[3];
  b.lse = static_cast<const float*>(in[4]);
  b.dout = in[5];
  b.dlse = static_cast<const float*>(in[6]);
  b.dq = out[0];
  b.dk = out[1];
  b.dv = out[2];
  b.dbias = out[3];
  b.workspace = out[4];
  b.workspace_bytes = workspace_bytes;
  b.flex_capture_grads = out + kBackwardOutputs;  // the score_mod's capture gradients, as many as it has
  return b;
}

// Bytes of each output to fill with 0xFF on failure, in output order: every result whole, none of the workspace
// (scratch that nothing reads).
inline void ForwardOutputBytes(const AttentionParams& p, size_t bytes[kForwardOutputs]) {
  bytes[0] = static_cast<size_t>(p.batch * p.seqlen_q * p.num_heads * p.head_dim_v) * DTypeSize(p.dtype);
  bytes[1] = static_cast<size_t>(p.batch * p.num_heads * p.seqlen_q) * sizeof(float);
  bytes[2] = 0;
}

// A failed backward's capture gradients (after the fixed outputs), filled with 0xFF like them: fill(address, bytes),
// a memset on the backend's memory.
template <typename Fill>
void PoisonCaptureGradients(const AttentionParams& p, const BackwardBuffers& b, Fill fill) {
  const std::vector<int64_t> captures = p.flex.gradient_captures();
  for (size_t i = 0; i < captures.size(); ++i) {
    const int64_t elements = p.flex.capture_elements(captures[i]);
    if (elements > 0) fill(b.flex_capture_grads[i], static_cast<size_t>(elements) * sizeof(float));
  }
}

// dk and dv have k's and v's shapes: [B, Skv, ...], or the pool [num_pages, page_size, ...] of a paged call (which
// the backward refuses, and so poisons).
inline void BackwardOutputBytes(const AttentionParams& p, size_t bytes[kBackwardOutputs]) {
  const size_t elem = DTypeSize(p.dtype);
  const int64_t key_rows = p.page_size > 0 ? p.num_pages * p.page_size : p.batch * p.seqlen_kv;
  bytes[0] = static_cast<size_t>(p.batch * p.seqlen_q * p.num_heads * p.head_dim) * elem;
  bytes[1] = static_cast<size_t>(key_rows * p.num_kv_heads * p.head_dim) * elem;
  bytes[2] = static_cast<size_t>(key_rows * p.num_kv_heads * p.head_dim_v) * elem;
  bytes[3] = static_cast<size_t>(MakeBiasLayout(p).elements()) * DTypeSize(p.bias_dtype);
  bytes[4] = 0;
}

}  // namespace te_jax::legacy
