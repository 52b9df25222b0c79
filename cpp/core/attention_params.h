// The static description of one attention call, shared by every backend and both entry paths. The FFI handlers fill it
// from buffer shapes and typed attributes, the legacy handlers from the descriptor; ValidateAttentionParams checks it
// once, in one place, before any backend sees it.
#pragma once

#include <cstdint>

#include "cpp/core/dtype.h"
#include "cpp/core/engine.h"
#include "cpp/core/flex_mods.h"
#include "cpp/core/kv_format.h"
#include "cpp/core/mask_type.h"

namespace te_jax {

// Layouts (row-major):
//   q [B, Sq, H, D], k [B, Skv, Hkv, D], v [B, Skv, Hkv, Dv], out [B, Sq, H, Dv], lse float32 [B, H, Sq],
//   q_seqlens / kv_seqlens int32 [B] (read only with a padding mask, IsPadding; the other masks see all Sq rows and
//   Skv keys; a paged call reads kv_seqlens only, QuerySeqlensRead), alibi_slopes float32 [B, H] (read only when
//   has_alibi).
//   sinks float32 [B, H] (read only by the forward when has_sinks: each finished row merges its head's sink logit,
//   cpp/core/sink.h; the backward is given that forward's out and lse and reads nothing of it).
//   q_segment_ids / q_positions int32 [B, Sq], kv_segment_ids / kv_positions int32 [B, Skv] (read only when
//   has_segment_ids / has_positions; see cpp/core/token_mask.h for what they mean).
//   bias [B or 1, H or 1, Sq or 1, Skv or 1] in bias_dtype (read only when has_bias; bias_broadcast says which dims
//   are 1, cpp/core/bias.h), and the backward's dbias of the same shape and dtype. Without a bias both are float32
//   [1, 1, 1, 1] placeholders (bias_broadcast kBroadcastAll).
//   dropout uint32 [6]: the PRNG key's two words, then the global (b, h, i, j) of this call's element [0, 0, 0, 0]
//   (read only when dropout_threshold > 0; cpp/core/philox.h).
//   kv_descale float32 [2, kv_descale_blocks, kv_descale_heads]: an FP8 KV cache's descales (read only when
//   IsFp8(kv_format); cpp/core/kv_format.h KvDescales), k's then v's, per block of keys (1, or the pool's pages of a
//   paged call, or the batch entries of a contiguous one) and per K/V head (1 or Hkv). k and v are then FP8 while q
//   and out keep dtype. FP8 attention (IsFp8(q_format): q, k and v FP8, out in dtype, bfloat16): float32 [3, 1, H],
//   q's, k's and v's descales per query head (k's and v's those of its K/V head), and v holds V^T (below).
//   flex_captures: the arrays score_mod / mask_mod capture (flex.capture_shapes, row-major; the score_mod's first),
//   read only when flex.active() (cpp/core/flex_mods.h); the custom call's last operands, as many as the call has.
//   page_table int32 [B, max_pages_per_seq] (read only when page_size > 0; an int32 [1, 1] placeholder without
//   paging). With page_size > 0 (a paged KV cache) k is the page pool [num_pages, page_size, Hkv, D] and v
//   [num_pages, page_size, Hkv, Dv], seqlen_kv is the logical capacity max_pages_per_seq * page_size, and key j of
//   batch entry b lives at pool row page_table[b][j / page_size] * page_size + j % page_size (cpp/core/kv_rows.h). Only the
//   pages holding keys below kv_seqlens[b] are read; their ids must lie in [0, num_pages) (ValidatePageTable).
// Every operand is always passed, so every layer (lowering, batching, sharding) sees one operand list: where it is not
// read the Python layer passes a placeholder of its rank with every dim 1, a literal constant in the compiled program.
// (Zeros of the full shape were broadcast kernels per call, 3-7 us on an H200: a tenth of a decode step at 1k keys.)
struct AttentionParams {
  int64_t batch = 0;
  int64_t seqlen_q = 0;
  int64_t seqlen_kv = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;    // D, of q and k
  int64_t head_dim_v = 0;  // Dv, of v and out
  DType dtype = DType::kFloat32;  // of q and out, and of k and v unless they are an FP8 KV cache
  KvFormat kv_format = KvFormat::kAsQ;  // forward only: the backward takes the dequantized values
  // FP8 attention (the CUDA sm90 forward only): q, k and v in this FP8 format (kv_format the same), out in dtype; v's
  // buffer, of v's shape, holds each K/V head's V^T [Dv, Skv] with the keys of every 16 in the FP8 kernel's fragment
  // order (te_jax/fp8.py fp8_values_transposed). kAsQ: q in dtype.
  KvFormat q_format = KvFormat::kAsQ;
  int64_t kv_descale_blocks = 1;        // the kv_descale operand's dims (1, 1 unless FP8)
  int64_t kv_descale_heads = 1;
  MaskType mask_type = MaskType::kNoMask;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded
  float scale = 0.0f;         // applied to q.k; the Python layer resolves the 1/sqrt(D) default
  float softcap = 0.0f;       // 0: off
  bool has_alibi = false;
  // Attention sinks, merged by te_jax's kernels; the lowering applies them itself after cuDNN's.
  bool has_sinks = false;
  // Packed sequences. Only with mask_type kNoMask or kCausal (the CUDA backend: sm80-family kernels).
  bool has_segment_ids = false;  // a query sees only keys of its own segment id; id 0 is padding
  bool has_positions = false;    // causal masks, windows and ALiBi use these positions instead of the indices
  // Additive logit bias: s = softcap(scale * q.k) + alibi + bias, before the mask (the CUDA backend: sm80-family
  // kernels; deterministic=True there only where dbias sums over no dim, cpp/core/bias.h BiasGradientSums).
  bool has_bias = false;
  DType bias_dtype = DType::kFloat32;
  uint8_t bias_broadcast = 0xF;  // cpp/core/bias.h: bit set = that dim of bias is 1 (batch, heads, Sq, Skv)
  // Attention dropout: a probability is dropped when its 16-bit Philox number (cpp/core/philox.h) is below this
  // threshold (round(rate * 2^16), < 2^16) and the kept ones are scaled by 2^16 / (2^16 - threshold); 0: none.
  uint32_t dropout_threshold = 0;
  // Paged KV cache, forward only: 0, k and v are contiguous [B, Skv, ...]; else the keys per page (a
  // multiple of 8 in [8, 256]) and k, v are pools of num_pages pages read through the page table (layout above).
  int64_t page_size = 0;
  int64_t num_pages = 0;
  // Backward only. false: the CUDA backward sums dq over key blocks with float atomics in one pass (fast; the order
  // of the additions, and so dq's last bits, can differ between runs). true: a second pass recomputes each dq row in
  // a fixed order (bitwise reproducible, ~1.4x the backward's work). The CPU backward likewise sums dq in an order that
  // follows the thread scheduling unless this is set (then in chunks of key tiles fixed by the problem alone).
  bool deterministic = false;
  Engine engine = Engine::kTe;  // resolved at lowering; the CPU backend serves kTe only
  // score_mod / mask_mod (te_jax.flex; the CPU backend only so far): s = mask(score_mod(the logit above)), where the
  // mask is every built-in mask and the mask_mod (cpp/core/flex_mods.h).
  FlexSpec flex;
};

// The operands both directions read: q, k, v and the call's array options (layouts above).
struct AttentionOperands {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_seqlens = nullptr;
  const int32_t* kv_seqlens = nullptr;
  const float* alibi_slopes = nullptr;
  const float* sinks = nullptr;
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  const int32_t* q_positions = nullptr;
  const int32_t* kv_positions = nullptr;
  const void* bias = nullptr;
  const uint32_t* dropout = nullptr;
  // The backward refuses paging (ValidateBackwardParams): present so both directions share one operand list.
  const int32_t* page_table = nullptr;
  const float* kv_descale = nullptr;
  const void* const* flex_captures = nullptr;  // params.flex.num_captures() addresses
};

struct ForwardBuffers : AttentionOperands {
  void* out = nullptr;
  float* lse = nullptr;
  // Scratch of the engine (ForwardWorkspaceBytes of the backend; 0 for te_jax's kernels), an extra result of the
  // custom call on both paths, like the backward's.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

// The query lengths a call reads, nullptr where every batch entry has seqlen_q rows: q_seqlens with a padding mask,
// except in a paged call, whose queries are the last seqlen_q tokens of every sequence (paged_attention passes a
// placeholder, so a decode step needs no array of Sq's made per call).
inline const int32_t* QuerySeqlensRead(const AttentionParams& p, const int32_t* q_seqlens) {
  return IsPadding(p.mask_type) && p.page_size == 0 ? q_seqlens : nullptr;
}

struct BackwardBuffers : AttentionOperands {
  const void* out = nullptr;
  const float* lse = nullptr;
  const void* dout = nullptr;
  // Cotangent of lse (float32 [B, H, Sq]; zeros when only out is used). The logits' gradient is
  // dS = P * (dP - D + dlse) with D = rowsum(dout * out), so lse returned to the user is differentiable too.
  const float* dlse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dbias = nullptr;  // bias's shape and dtype, summed over its broadcast dims; zero without a bias
  // The gradients of the score_mod's floating-point captures (float32, their shapes; flex.capture_gradients says
  // which), flex.num_capture_gradients() addresses.
  void* const* flex_capture_grads = nullptr;
  // Scratch the backend needs for this call (BackwardWorkspaceBytes of the backend), an extra result of the custom
  // call on both paths so XLA owns its memory; its contents are undefined on entry and on exit.
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
};

}  // namespace te_jax
