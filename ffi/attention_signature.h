// The FFI signature of the attention handlers: operands, results and attributes in the order te_jax/_primitives.py
// emits them. The CPU and CUDA handlers bind the same chains after their own context argument (thread pool or stream),
// so the two backends cannot decode a call differently.
#pragma once

#include "ffi/ffi_params.h"
#include "xla/ffi/api/ffi.h"

// The attributes, decoded by name into one struct (ffi_params.h registers its members).
#define TE_JAX_FFI_ATTENTION_ATTRS .Attrs<te_jax::ffi_handlers::AttentionAttrs>()

// The packed-sequence operands that follow alibi_slopes and sinks in both directions: q_segment_ids, kv_segment_ids,
// q_positions, kv_positions (int32 [B, Sq] / [B, Skv]; [1, 1] placeholders when the has_ flags are false).
#define TE_JAX_FFI_TOKEN_ARGS \
  .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()

// The operands after the tokens in both directions: page_table (int32 [B, max_pages_per_seq]; an int32 [1, 1]
// placeholder when the attribute page_size is 0), kv_descale (float32 [2, blocks, heads] with an FP8 KV cache, else a
// [1, 1, 1] placeholder), bias, dropout.
#define TE_JAX_FFI_KV_CACHE_BIAS_DROPOUT_ARGS \
  .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>()

// The operands after dropout in both directions: the arrays score_mod / mask_mod capture, as many as the call has
// (none without mods). Variadic rather than a fixed maximum of placeholders: a mod may capture any number of arrays,
// and a call without mods passes nothing more than before.
#define TE_JAX_FFI_FLEX_CAPTURE_ARGS .RemainingArgs()

// q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
// page_table, kv_descale, bias, dropout, *captures -> out, lse, workspace (uint8 [n], the backend's
// ForwardWorkspaceBytes)
#define TE_JAX_FFI_FORWARD_SIGNATURE                                                                            \
  .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>() \
      .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>() TE_JAX_FFI_TOKEN_ARGS     \
          TE_JAX_FFI_KV_CACHE_BIAS_DROPOUT_ARGS TE_JAX_FFI_FLEX_CAPTURE_ARGS.Ret<xla::ffi::AnyBuffer>()          \
      .Ret<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>() TE_JAX_FFI_ATTENTION_ATTRS

// q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi_slopes, sinks, q_segment_ids, kv_segment_ids,
// q_positions, kv_positions, page_table, kv_descale, bias, dropout, *captures -> dq, dk, dv, dbias, workspace
// (uint8 [n], the backend's BackwardWorkspaceBytes), *capture gradients (float32, one per floating-point capture of
// the score_mod)
#define TE_JAX_FFI_BACKWARD_SIGNATURE                                                                           \
  .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>() \
      .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>() \
      .Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>() TE_JAX_FFI_TOKEN_ARGS     \
          TE_JAX_FFI_KV_CACHE_BIAS_DROPOUT_ARGS TE_JAX_FFI_FLEX_CAPTURE_ARGS.Ret<xla::ffi::AnyBuffer>()          \
      .Ret<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>() \
          .RemainingRets() TE_JAX_FFI_ATTENTION_ATTRS
