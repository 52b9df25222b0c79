// Builds the core's AttentionParams from FFI buffers and typed attributes: the dimensions come from the buffer shapes,
// the options from the attributes. Shared by the CPU and CUDA handlers, so both decode calls the same way.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/core/bias.h"
#include "cpp/core/status.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::ffi_handlers {

// The attributes every attention handler takes (te_jax/_primitives.py emits them), decoded by name: the registration
// at the end of this file.
struct AttentionAttrs {
  int64_t mask_type;
  int64_t window_left;
  int64_t window_right;
  float scale;
  float softcap;
  bool has_alibi;
  bool has_sinks;  // the forward merges the sinks operand into its rows (cpp/core/sink.h)
  bool deterministic;
  int64_t engine;  // cpp/core/engine.h code, resolved at lowering
  bool has_segment_ids;
  bool has_positions;
  bool has_bias;
  int64_t dropout_threshold;  // cpp/core/attention_params.h; 0: no dropout
  int64_t page_size;          // cpp/core/attention_params.h; 0: k and v contiguous, the page table a placeholder
  // score_mod / mask_mod (cpp/core/flex_mods.h: FlexSpec); empty libraries: none.
  std::string_view score_mod_library;
  std::string_view mask_mod_library;
  int64_t flex_batch_fold;
  int64_t score_mod_captures;
  int64_t score_mod_gradients;  // bit i: the score_mod's capture i has a gradient (FlexSpec::capture_gradients)
  int64_t flex_block_q;         // a block mask's block (FlexSpec::block_q, block_kv); 0 without one
  int64_t flex_block_kv;
};

// The packed-sequence operands (ffi/attention_signature.h: TE_JAX_FFI_TOKEN_ARGS), always present.
struct TokenArgs {
  const xla::ffi::AnyBuffer& q_segment_ids;
  const xla::ffi::AnyBuffer& kv_segment_ids;
  const xla::ffi::AnyBuffer& q_positions;
  const xla::ffi::AnyBuffer& kv_positions;
};

// `what` names the operands in the error: "q, k and v", "bias".
inline Status DTypeFromFfi(xla::ffi::DataType type, DType* dtype, const char* what = "q, k and v") {
  switch (type) {
    case xla::ffi::DataType::F32: *dtype = DType::kFloat32; return Status::Ok();
    case xla::ffi::DataType::BF16: *dtype = DType::kBFloat16; return Status::Ok();
    case xla::ffi::DataType::F16: *dtype = DType::kFloat16; return Status::Ok();
    default: break;
  }
  return Status::InvalidArgument(std::string(what) + " must be float32, bfloat16 or float16");
}

// An FP8 format's code from a buffer's element type (kAsQ for any other).
inline KvFormat Fp8FormatOf(xla::ffi::DataType type) {
  return type == xla::ffi::DataType::F8E4M3FN ? KvFormat::kE4M3
         : type == xla::ffi::DataType::F8E5M2 ? KvFormat::kE5M2
                                               : KvFormat::kAsQ;
}

// q's dtype, or FP8 attention's q_format (q, k and v of one FP8 dtype; out in bfloat16).
inline Status QueryTypeFromFfi(const xla::ffi::AnyBuffer& q, AttentionParams* p) {
  p->q_format = Fp8FormatOf(q.element_type());
  if (!IsFp8(p->q_format)) return DTypeFromFfi(q.element_type(), &p->dtype);
  p->dtype = DType::kBFloat16;
  return Status::Ok();
}

// k's and v's storage (cpp/core/kv_format.h) and the kv_descale operand's dims: q's dtype and the float32 [1, 1, 1]
// placeholder, or an FP8 KV cache (k and v of one FP8 dtype) with float32 descales [2, blocks, heads], or FP8 attention
// (q, k and v of one FP8 dtype) with its descales [3, 1, H].
inline Status KvFormatFromFfi(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                              const xla::ffi::AnyBuffer& kv_descale, AttentionParams* p) {
  const auto kv = k.element_type();
  if (v.element_type() != kv) return Status::InvalidArgument("k and v must have the same dtype");
  if (IsFp8(p->q_format)) {
    if (kv != q.element_type()) return Status::InvalidArgument("FP8 q takes k and v of its FP8 dtype");
    p->kv_format = p->q_format;
  } else if (kv == q.element_type()) {
    p->kv_format = KvFormat::kAsQ;
  } else if (kv == xla::ffi::DataType::F8E4M3FN) {
    p->kv_format = KvFormat::kE4M3;
  } else if (kv == xla::ffi::DataType::F8E5M2) {
    p->kv_format = KvFormat::kE5M2;
  } else {
    return Status::InvalidArgument("k and v must have q's dtype, or one FP8 dtype (float8_e4m3fn or float8_e5m2: an "
                                   "FP8 KV cache)");
  }
  const auto dims = kv_descale.dimensions();
  if (kv_descale.element_type() != xla::ffi::DataType::F32 || dims.size() != 3 ||
      dims[0] != (IsFp8(p->q_format) ? 3 : IsFp8(p->kv_format) ? 2 : 1)) {
    return Status::InvalidArgument("kv_descale must be float32 [2, blocks, heads] with an FP8 KV cache (k's descales, "
                                   "then v's), [3, 1, H] with FP8 q, k and v, else the float32 [1, 1, 1] placeholder");
  }
  p->kv_descale_blocks = dims[1];
  p->kv_descale_heads = dims[2];
  return Status::Ok();
}

// bias's dtype and broadcast bits (cpp/core/bias.h) from its buffer: rank 4, each dim 1 or the full [B, H, Sq, Skv] one.
inline Status BiasFromFfi(const xla::ffi::AnyBuffer& bias, AttentionParams* p) {
  const auto dims = bias.dimensions();
  const int64_t full[4] = {p->batch, p->num_heads, p->seqlen_q, p->seqlen_kv};
  if (dims.size() != 4) return Status::InvalidArgument("bias must have rank 4 [B, H, Sq, Skv] (each dim full or 1)");
  p->bias_broadcast = 0;
  for (int axis = 0; axis < 4; ++axis) {
    if (dims[axis] == 1) {
      p->bias_broadcast |= 1 << axis;
    } else if (dims[axis] != full[axis]) {
      return Status::InvalidArgument("bias dim " + std::to_string(axis) + " is " + std::to_string(dims[axis]) +
                                     ", expected 1 or " + std::to_string(full[axis]));
    }
  }
  return DTypeFromFfi(bias.element_type(), &p->bias_dtype, "bias");
}

inline Status ExpectShape(const char* name, const xla::ffi::AnyBuffer& buffer, std::initializer_list<int64_t> shape) {
  const auto dims = buffer.dimensions();
  bool same = dims.size() == static_cast<int64_t>(shape.size());
  int64_t axis = 0;
  for (int64_t extent : shape) same = same && dims[axis++] == extent;
  if (same) return Status::Ok();
  std::string got, want;
  for (int64_t d : dims) got += (got.empty() ? "" : ", ") + std::to_string(d);
  for (int64_t d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
  return Status::InvalidArgument(std::string(name) + " has shape [" + got + "], expected [" + want + "]");
}

// An optional operand: `shape` when the call reads it, else (unread) the placeholder the lowering passes
// (te_jax/_primitives.py), the same rank with every dim 1, or `shape` (the sinks of a call whose lowering merges them
// after the kernel).
inline Status ExpectOptional(const char* name, const xla::ffi::AnyBuffer& buffer, bool present,
                             std::initializer_list<int64_t> shape) {
  const auto dims = buffer.dimensions();
  bool placeholder = !present && dims.size() == static_cast<int64_t>(shape.size());
  for (int64_t d : dims) placeholder = placeholder && d == 1;
  return placeholder ? Status::Ok() : ExpectShape(name, buffer, shape);
}

// The backward's dbias result must match bias (the core writes it with bias's layout and dtype).
inline Status ExpectDbiasLikeBias(const xla::ffi::AnyBuffer& bias, const xla::ffi::AnyBuffer& dbias) {
  const auto dims = bias.dimensions();
  TE_JAX_RETURN_IF_ERROR(ExpectShape("dbias", dbias, {dims[0], dims[1], dims[2], dims[3]}));
  if (dbias.element_type() != bias.element_type()) return Status::InvalidArgument("dbias must have bias's dtype");
  return Status::Ok();
}

// The keys' layout from k and the page table (cpp/core/attention_params.h): without paging k is [B, Skv, Hkv, D] and the
// page table an int32 [1, 1] placeholder; with page_size > 0 k is the pool [num_pages, page_size, Hkv, D] and the
// page table int32 [B, max_pages_per_seq], which gives the capacity seqlen_kv = max_pages_per_seq * page_size.
inline Status KeyLayoutFromFfi(const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& page_table, int64_t page_size,
                               AttentionParams* p) {
  const auto table = page_table.dimensions();
  if (table.size() != 2 || (page_size > 0 && table[0] != p->batch) ||
      page_table.element_type() != xla::ffi::DataType::S32) {
    return Status::InvalidArgument("page_table must be int32 [B, max_pages_per_seq] with B = " +
                                   std::to_string(p->batch) + " (an int32 [1, 1] placeholder without paging)");
  }
  if (page_size < 0) {
    return Status::InvalidArgument("page_size must be 0 (contiguous k and v) or a multiple of 8 in [8, 256], got " +
                                   std::to_string(page_size));
  }
  if (page_size == 0) {
    p->seqlen_kv = k.dimensions()[1];
    return ExpectShape("page_table", page_table, {1, 1});
  }
  p->page_size = page_size;
  p->num_pages = k.dimensions()[0];
  p->seqlen_kv = table[1] * page_size;
  return Status::Ok();
}

// Decodes params from q, k, v and checks that every other buffer of the call has the shape and type they imply.
inline Status ParamsFromFfi(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k, const xla::ffi::AnyBuffer& v,
                            const xla::ffi::AnyBuffer& q_seqlens, const xla::ffi::AnyBuffer& kv_seqlens,
                            const xla::ffi::AnyBuffer& alibi_slopes, const xla::ffi::AnyBuffer& sinks,
                            const TokenArgs& tokens, const xla::ffi::AnyBuffer& page_table,
                            const xla::ffi::AnyBuffer& kv_descale, const xla::ffi::AnyBuffer& bias,
                            const xla::ffi::AnyBuffer& dropout, const AttentionAttrs& attrs, AttentionParams* params) {
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 || v.dimensions().size() != 4) {
    return Status::InvalidArgument("q, k and v must have rank 4 ([batch, seq, heads, head_dim]; k and v "
                                   "[num_pages, page_size, heads, head_dim] when paged)");
  }
  AttentionParams p;
  p.batch = q.dimensions()[0];
  p.seqlen_q = q.dimensions()[1];
  p.num_heads = q.dimensions()[2];
  p.head_dim = q.dimensions()[3];
  p.num_kv_heads = k.dimensions()[2];
  p.head_dim_v = v.dimensions()[3];
  TE_JAX_RETURN_IF_ERROR(QueryTypeFromFfi(q, &p));
  TE_JAX_RETURN_IF_ERROR(KvFormatFromFfi(q, k, v, kv_descale, &p));
  TE_JAX_RETURN_IF_ERROR(KeyLayoutFromFfi(k, page_table, attrs.page_size, &p));
  // k's and v's leading dims: [B, Skv] or, paged, [num_pages, page_size].
  const int64_t rows0 = p.page_size > 0 ? p.num_pages : p.batch;
  const int64_t rows1 = p.page_size > 0 ? p.page_size : p.seqlen_kv;
  TE_JAX_RETURN_IF_ERROR(ExpectShape("k", k, {rows0, rows1, p.num_kv_heads, p.head_dim}));
  TE_JAX_RETURN_IF_ERROR(ExpectShape("v", v, {rows0, rows1, p.num_kv_heads, p.head_dim_v}));
  if (attrs.mask_type < 0 || attrs.mask_type >= kNumMaskTypes) {
    return Status::InvalidArgument("mask_type code " + std::to_string(attrs.mask_type) + " is not in [0, " +
                                   std::to_string(kNumMaskTypes) + ")");
  }
  const bool lengths = IsPadding(static_cast<MaskType>(attrs.mask_type));
  // A paged call reads no q_seqlens (QuerySeqlensRead): paged_attention passes the placeholder, [B] is taken too.
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("q_seqlens", q_seqlens, lengths && p.page_size == 0, {p.batch}));
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("kv_seqlens", kv_seqlens, lengths, {p.batch}));
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("alibi_slopes", alibi_slopes, attrs.has_alibi, {p.batch, p.num_heads}));
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("sinks", sinks, attrs.has_sinks, {p.batch, p.num_heads}));
  if (q_seqlens.element_type() != xla::ffi::DataType::S32 || kv_seqlens.element_type() != xla::ffi::DataType::S32 ||
      alibi_slopes.element_type() != xla::ffi::DataType::F32 || sinks.element_type() != xla::ffi::DataType::F32) {
    return Status::InvalidArgument("q_seqlens and kv_seqlens must be int32, alibi_slopes and sinks float32");
  }
  const bool ids = attrs.has_segment_ids, positions = attrs.has_positions;
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("q_segment_ids", tokens.q_segment_ids, ids, {p.batch, p.seqlen_q}));
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("kv_segment_ids", tokens.kv_segment_ids, ids, {p.batch, p.seqlen_kv}));
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("q_positions", tokens.q_positions, positions, {p.batch, p.seqlen_q}));
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("kv_positions", tokens.kv_positions, positions, {p.batch, p.seqlen_kv}));
  for (const xla::ffi::AnyBuffer* b :
       {&tokens.q_segment_ids, &tokens.kv_segment_ids, &tokens.q_positions, &tokens.kv_positions}) {
    if (b->element_type() != xla::ffi::DataType::S32) {
      return Status::InvalidArgument("segment ids and positions must be int32");
    }
  }
  TE_JAX_RETURN_IF_ERROR(BiasFromFfi(bias, &p));
  if (attrs.dropout_threshold < 0 || attrs.dropout_threshold > 0xFFFFFFFFll) {
    return Status::InvalidArgument("dropout_threshold " + std::to_string(attrs.dropout_threshold) +
                                   " is not in [0, 2^32)");
  }
  // Its offsets are the mods' too.
  const bool mods = !attrs.score_mod_library.empty() || !attrs.mask_mod_library.empty();
  TE_JAX_RETURN_IF_ERROR(ExpectOptional("dropout", dropout, attrs.dropout_threshold > 0 || mods, {6}));
  if (dropout.element_type() != xla::ffi::DataType::U32) return Status::InvalidArgument("dropout must be uint32");
  if (attrs.engine < 0 || attrs.engine >= kNumEngines) {
    return Status::InvalidArgument("engine code " + std::to_string(attrs.engine) + " is not in [0, " +
                                   std::to_string(kNumEngines) + ")");
  }
  p.mask_type = static_cast<MaskType>(attrs.mask_type);
  p.engine = static_cast<Engine>(attrs.engine);
  p.window_left = attrs.window_left;
  p.window_right = attrs.window_right;
  p.scale = attrs.scale;
  p.softcap = attrs.softcap;
  p.has_alibi = attrs.has_alibi;
  p.has_sinks = attrs.has_sinks;
  p.deterministic = attrs.deterministic;
  p.has_segment_ids = attrs.has_segment_ids;
  p.has_positions = attrs.has_positions;
  p.has_bias = attrs.has_bias;
  p.dropout_threshold = static_cast<uint32_t>(attrs.dropout_threshold);
  *params = p;
  return Status::Ok();
}

// The call's FlexSpec from the attributes and its captures, the operands after dropout (every one of them: a call
// without mods has none); `data` gets their addresses, which AttentionOperands::flex_captures points at.
inline Status FlexFromFfi(const xla::ffi::RemainingArgs& captures, const AttentionAttrs& attrs, FlexSpec* flex,
                          std::vector<const void*>* data) {
  flex->score_library = std::string(attrs.score_mod_library);
  flex->mask_library = std::string(attrs.mask_mod_library);
  flex->batch_fold = attrs.flex_batch_fold;
  flex->score_captures = attrs.score_mod_captures;
  flex->capture_gradients = attrs.score_mod_gradients;
  flex->block_q = attrs.flex_block_q;
  flex->block_kv = attrs.flex_block_kv;
  for (size_t i = 0; i < captures.size(); ++i) {
    const auto buffer = captures.get<xla::ffi::AnyBuffer>(i);
    if (!buffer.has_value()) {
      return Status::InvalidArgument("score_mod/mask_mod capture " + std::to_string(i) + " is not an array");
    }
    const auto dims = buffer->dimensions();
    flex->capture_shapes.emplace_back(dims.begin(), dims.end());
    data->push_back(buffer->untyped_data());
  }
  return Status::Ok();
}

// The backward's results after the workspace: a float32 gradient of each score_mod capture that has one, of its shape.
inline Status CaptureGradientsFromFfi(const xla::ffi::RemainingRets& grads, const FlexSpec& flex,
                                      std::vector<void*>* data) {
  if (static_cast<int64_t>(grads.size()) != flex.num_capture_gradients()) {
    return Status::InvalidArgument("the backward has " + std::to_string(grads.size()) + " capture gradients; the "
                                   "score_mod's floating-point captures need " +
                                   std::to_string(flex.num_capture_gradients()));
  }
  const std::vector<int64_t> captures = flex.gradient_captures();
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t capture = captures[i];
    auto buffer = grads.get<xla::ffi::AnyBuffer>(i);
    if (!buffer.has_value() || (*buffer)->element_type() != xla::ffi::DataType::F32) {
      return Status::InvalidArgument("capture gradient " + std::to_string(i) + " is not a float32 array");
    }
    const auto dims = (*buffer)->dimensions();
    if (std::vector<int64_t>(dims.begin(), dims.end()) != flex.capture_shapes[capture]) {
      return Status::InvalidArgument("capture gradient " + std::to_string(i) + " does not have its capture's shape");
    }
    data->push_back((*buffer)->untyped_data());
  }
  return Status::Ok();
}

// The operands both directions read (AttentionOperands) from their FFI buffers.
inline AttentionOperands OperandsFromFfi(const xla::ffi::AnyBuffer& q, const xla::ffi::AnyBuffer& k,
                                         const xla::ffi::AnyBuffer& v, const xla::ffi::AnyBuffer& q_seqlens,
                                         const xla::ffi::AnyBuffer& kv_seqlens, const xla::ffi::AnyBuffer& alibi_slopes,
                                         const xla::ffi::AnyBuffer& sinks, const TokenArgs& tokens,
                                         const xla::ffi::AnyBuffer& page_table,
                                         const xla::ffi::AnyBuffer& kv_descale, const xla::ffi::AnyBuffer& bias,
                                         const xla::ffi::AnyBuffer& dropout) {
  AttentionOperands o;
  o.q = q.untyped_data();
  o.k = k.untyped_data();
  o.v = v.untyped_data();
  o.q_seqlens = static_cast<const int32_t*>(q_seqlens.untyped_data());
  o.kv_seqlens = static_cast<const int32_t*>(kv_seqlens.untyped_data());
  o.alibi_slopes = static_cast<const float*>(alibi_slopes.untyped_data());
  o.sinks = static_cast<const float*>(sinks.untyped_data());
  o.q_segment_ids = static_cast<const int32_t*>(tokens.q_segment_ids.untyped_data());
  o.kv_segment_ids = static_cast<const int32_t*>(tokens.kv_segment_ids.untyped_data());
  o.q_positions = static_cast<const int32_t*>(tokens.q_positions.untyped_data());
  o.kv_positions = static_cast<const int32_t*>(tokens.kv_positions.untyped_data());
  o.page_table = static_cast<const int32_t*>(page_table.untyped_data());
  o.bias = bias.untyped_data();
  o.dropout = static_cast<const uint32_t*>(dropout.untyped_data());
  o.kv_descale = static_cast<const float*>(kv_descale.untyped_data());
  return o;
}

inline ForwardBuffers ForwardBuffersFromFfi(const AttentionOperands& operands, xla::ffi::AnyBuffer& out,
                                            xla::ffi::AnyBuffer& lse, xla::ffi::AnyBuffer& workspace) {
  ForwardBuffers b;
  static_cast<AttentionOperands&>(b) = operands;
  b.out = out.untyped_data();
  b.lse = static_cast<float*>(lse.untyped_data());
  b.workspace = workspace.untyped_data();
  b.workspace_bytes = workspace.size_bytes();
  return b;
}

inline BackwardBuffers BackwardBuffersFromFfi(const AttentionOperands& operands, const xla::ffi::AnyBuffer& out,
                                              const xla::ffi::AnyBuffer& lse, const xla::ffi::AnyBuffer& dout,
                                              const xla::ffi::AnyBuffer& dlse, xla::ffi::AnyBuffer& dq,
                                              xla::ffi::AnyBuffer& dk, xla::ffi::AnyBuffer& dv,
                                              xla::ffi::AnyBuffer& dbias, xla::ffi::AnyBuffer& workspace) {
  BackwardBuffers b;
  static_cast<AttentionOperands&>(b) = operands;
  b.out = out.untyped_data();
  b.lse = static_cast<const float*>(lse.untyped_data());
  b.dout = dout.untyped_data();
  b.dlse = static_cast<const float*>(dlse.untyped_data());
  b.dq = dq.untyped_data();
  b.dk = dk.untyped_data();
  b.dv = dv.untyped_data();
  b.dbias = dbias.untyped_data();
  b.workspace = workspace.untyped_data();
  b.workspace_bytes = workspace.size_bytes();
  return b;
}

}  // namespace te_jax::ffi_handlers

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(te_jax::ffi_handlers::AttentionAttrs, StructMember<int64_t>("mask_type"),
                                      StructMember<int64_t>("window_left"), StructMember<int64_t>("window_right"),
                                      StructMember<float>("scale"), StructMember<float>("softcap"),
                                      StructMember<bool>("has_alibi"), StructMember<bool>("has_sinks"),
                                      StructMember<bool>("deterministic"),
                                      StructMember<int64_t>("engine"), StructMember<bool>("has_segment_ids"),
                                      StructMember<bool>("has_positions"), StructMember<bool>("has_bias"),
                                      StructMember<int64_t>("dropout_threshold"), StructMember<int64_t>("page_size"),
                                      StructMember<std::string_view>("score_mod_library"),
                                      StructMember<std::string_view>("mask_mod_library"),
                                      StructMember<int64_t>("flex_batch_fold"),
                                      StructMember<int64_t>("score_mod_captures"),
                                      StructMember<int64_t>("score_mod_gradients"),
                                      StructMember<int64_t>("flex_block_q"), StructMember<int64_t>("flex_block_kv"));
