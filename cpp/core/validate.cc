#include "cpp/core/validate.h"

#include <cmath>
#include <string>

#include "cpp/core/bias.h"
#include "cpp/core/kv_rows.h"
#include "cpp/core/philox.h"

namespace te_jax {
namespace {

std::string Str(int64_t v) { return std::to_string(v); }

Status CheckHeadDim(const char* name, int64_t d) {
  if (d <= 0 || d % 8 != 0 || d > kMaxHeadDim) {
    return Status::InvalidArgument(std::string(name) + " must be a multiple of 8 in [8, " + Str(kMaxHeadDim) +
                                   "], got " + Str(d));
  }
  return Status::Ok();
}

const char* MaskName(MaskType m) {
  static const char* const kNames[kNumMaskTypes] = {"no_mask", "causal", "causal_bottom_right", "padding",
                                                    "padding_causal", "padding_causal_bottom_right"};
  return kNames[static_cast<int>(m)];
}

// A paged KV cache (page_size > 0) serves decoding and chunked prefill over a cache: queries at the end of their
// sequence over its first kv_seqlens[b] keys, nothing that indexes keys by their position in k (ids, positions, bias)
// or that needs the backward (dropout).
Status CheckPaging(const AttentionParams& p, Backend backend) {
  if (p.page_size == 0) {
    if (p.num_pages != 0) {
      return Status::InvalidArgument("num_pages must be 0 without a paged KV cache (page_size 0), got " +
                                     Str(p.num_pages));
    }
    return Status::Ok();
  }
  if (p.page_size < 0 || p.page_size % kPageSizeMultiple != 0 || p.page_size > kMaxPageSize) {
    return Status::InvalidArgument("page_size must be 0 (contiguous k and v) or a multiple of " +
                                   Str(kPageSizeMultiple) + " in [" + Str(kPageSizeMultiple) + ", " +
                                   Str(kMaxPageSize) + "], got " + Str(p.page_size));
  }
  // KvRows divides keys by the page size in 32 bits, so the capacity is bounded like a window.
  if (p.num_pages < 0 || p.seqlen_kv % p.page_size != 0 || p.seqlen_kv > kMaxWindow) {
    return Status::InvalidArgument("a paged KV cache needs num_pages >= 0 and seqlen_kv (max_pages_per_seq x "
                                   "page_size) a multiple of page_size " + Str(p.page_size) + " up to " +
                                   Str(kMaxWindow) + ", got num_pages=" + Str(p.num_pages) + " seqlen_kv=" +
                                   Str(p.seqlen_kv));
  }
  if (p.mask_type != MaskType::kPadding && p.mask_type != MaskType::kPaddingCausalBottomRight) {
    return Status::InvalidArgument(std::string("a paged KV cache (page_size > 0) goes with mask_type padding or "
                                               "padding_causal_bottom_right (queries at the end of their sequence), "
                                               "got ") + MaskName(p.mask_type));
  }
  if (p.has_segment_ids || p.has_positions) {
    return Status::InvalidArgument("a paged KV cache (page_size > 0) takes no segment ids or positions "
                                   "(has_segment_ids and has_positions must be false)");
  }
  if (p.has_bias) {
    return Status::InvalidArgument("a paged KV cache (page_size > 0) takes no bias (has_bias must be false)");
  }
  if (p.dropout_threshold > 0) {
    return Status::InvalidArgument("a paged KV cache (page_size > 0) takes no dropout (dropout_threshold must be 0)");
  }
  if (!BackendServesPagesInPlace(backend, p.seqlen_q)) {
    return Status::InvalidArgument("the CUDA backend reads a paged KV cache in place for at most " +
                                   Str(kMaxDecodeSeqlenQ) + " query positions (its decode kernels), got "
                                   "seqlen_q=" + Str(p.seqlen_q) + "; te_jax.paged_attention gathers the pages into "
                                   "contiguous k and v for longer queries");
  }
  return Status::Ok();
}

// score_mod / mask_mod (cpp/core/flex_mods.h): their captures' shapes, the batch fold, a paged call (whose keys are no
// positions in k) and what the CUDA kernels take are checked here; which kernel family serves them, by the backend.
Status CheckFlex(const AttentionParams& p, Backend backend) {
  const FlexSpec& f = p.flex;
  if (!f.active()) {
    if (f.num_captures() != 0 || f.batch_fold != 1) {
      return Status::InvalidArgument("a call without score_mod and mask_mod has no captures and batch_fold 1, got " +
                                     Str(f.num_captures()) + " captures and batch_fold " + Str(f.batch_fold));
    }
    return Status::Ok();
  }
  if (backend == Backend::kCuda) {
    if (f.num_captures() > kMaxKernelCaptures) {
      return Status::InvalidArgument("the CUDA kernels take at most " + Str(kMaxKernelCaptures) + " arrays the "
                                     "score_mod and mask_mod capture (a block mask's counts as one), got " +
                                     Str(f.num_captures()) + ": pack tables into one array, or run on the CPU");
    }
    for (int64_t i = 0; i < f.num_captures(); ++i) {
      const std::vector<int64_t>& shape = f.capture_shapes[i];
      if (static_cast<int64_t>(shape.size()) > kMaxKernelCaptureRank) {
        return Status::InvalidArgument("the CUDA kernels take captures of at most " + Str(kMaxKernelCaptureRank) +
                                       " dims, got one of " + Str(shape.size()) + ": reshape it");
      }
      if (f.capture_elements(i) > 0x7fffffffll) {  // their reads index in 32 bits (cpp/core/flex_math.h: FlexIndex)
        return Status::InvalidArgument("the CUDA kernels take captures of fewer than 2^31 elements, got one of " +
                                       Str(f.capture_elements(i)));
      }
    }
    if (p.deterministic && f.num_capture_gradients() > 0) {
      return Status::InvalidArgument("deterministic=True with a score_mod whose floating-point captures get "
                                     "gradients: the CUDA kernels add those atomically, in no fixed order (the CPU "
                                     "backend's are reproducible); drop deterministic, or run the call on the CPU");
    }
  }
  if (p.page_size != 0) {
    return Status::InvalidArgument("score_mod/mask_mod take no paged KV cache (page_size must be 0)");
  }
  if (f.batch_fold < 1 || p.batch % f.batch_fold != 0) {
    return Status::InvalidArgument("batch_fold must be a positive divisor of batch " + Str(p.batch) + ", got " +
                                   Str(f.batch_fold));
  }
  if (f.score_captures < 0 || f.score_captures > f.num_captures() ||
      (!f.has_score_mod() && f.score_captures != 0) ||
      (!f.has_mask_mod() && f.score_captures != f.num_captures() - (f.has_block_mask() ? 1 : 0))) {
    return Status::InvalidArgument("score_captures " + Str(f.score_captures) + " does not split the " +
                                   Str(f.num_captures()) + " captures between the call's mods");
  }
  if (f.block_q < 0 || f.block_kv < 0 || (f.block_q > 0) != (f.block_kv > 0)) {
    return Status::InvalidArgument("a block mask's blocks must have positive sizes, got " + Str(f.block_q) + " x " +
                                   Str(f.block_kv));
  }
  if (f.has_block_mask()) {
    const std::vector<int64_t> want{-1, -1, (p.seqlen_q + f.block_q - 1) / f.block_q,
                                    (p.seqlen_kv + f.block_kv - 1) / f.block_kv};
    const std::vector<int64_t>* blocks = f.num_captures() > 0 ? &f.capture_shapes.back() : nullptr;
    // A shard's call (of batch entries, heads, or a context-parallel block) has the whole call's block mask, whose
    // dims may exceed its own.
    if (!f.has_mask_mod() || f.mask_captures() < 0 || blocks == nullptr || blocks->size() != 4 ||
        ((*blocks)[0] != 1 && (*blocks)[0] < p.batch / f.batch_fold) ||
        ((*blocks)[1] != 1 && (*blocks)[1] < p.num_heads) || (*blocks)[2] < want[2] || (*blocks)[3] < want[3]) {
      return Status::InvalidArgument("a block mask goes with a mask_mod, its blocks the last capture, of shape [1 or "
                                     "B, 1 or H, " + Str(want[2]) + ", " + Str(want[3]) + "] (at least: those of the "
                                     "whole call where this one is a shard)");
    }
  }
  if (f.capture_gradients < 0 || f.score_captures > 62 || (f.capture_gradients >> f.score_captures) != 0) {
    return Status::InvalidArgument("capture_gradients " + Str(f.capture_gradients) + " names captures the score_mod "
                                   "does not have (it has " + Str(f.score_captures) + "; at most 62 get gradients)");
  }
  for (const std::vector<int64_t>& shape : f.capture_shapes) {
    if (static_cast<int64_t>(shape.size()) > kMaxFlexCaptureRank) {
      return Status::InvalidArgument("a score_mod/mask_mod capture has rank " + Str(shape.size()) + "; at most " +
                                     Str(kMaxFlexCaptureRank) + " dims");
    }
    for (int64_t extent : shape) {
      if (extent < 0) return Status::InvalidArgument("a score_mod/mask_mod capture has a negative dim");
    }
  }
  return Status::Ok();
}

// k's and v's storage: q's dtype (the kv_descale operand a [1, 1, 1] placeholder), or an FP8 KV cache with descales
// per block of keys (1, pages, or batch entries) and per K/V head (1 or Hkv). Which FP8 calls the CUDA kernels serve
// is their module decision's (cpp/cuda/kernel_config.h Fp8Refusal).
Status CheckKvFormat(const AttentionParams& p, Backend backend) {
  if (static_cast<int>(p.kv_format) >= kNumKvFormats || static_cast<int>(p.q_format) >= kNumKvFormats) {
    return Status::InvalidArgument("kv_format and q_format must be as_q (0), e4m3 (1) or e5m2 (2), got codes " +
                                   Str(static_cast<int>(p.kv_format)) + " and " + Str(static_cast<int>(p.q_format)));
  }
  if (IsFp8(p.q_format)) {
    // FP8 attention: the CUDA kernels read the bytes; elsewhere the Python layer dequantizes first (te_jax/fp8.py).
    if (backend != Backend::kCuda) {
      return Status::InvalidArgument("FP8 q, k and v reach only the CUDA kernels as they are: the CPU backend is given "
                                     "the dequantized values");
    }
    if (p.kv_format != p.q_format) return Status::InvalidArgument("FP8 attention takes k and v in q's FP8 format");
    if (p.page_size > 0) return Status::InvalidArgument("FP8 attention takes contiguous k and v, not pages");
    if (p.kv_descale_blocks != 1 || p.kv_descale_heads != p.num_heads) {
      return Status::InvalidArgument("FP8 attention's descales operand must be float32 [3, 1, H] with H = " +
                                     Str(p.num_heads) + " (q's, k's and v's per query head), got [3, " +
                                     Str(p.kv_descale_blocks) + ", " + Str(p.kv_descale_heads) + "]");
    }
    if (p.seqlen_kv % 16 != 0) {
      return Status::InvalidArgument("FP8 attention on the GPU takes key sequences of a multiple of 16 keys (V^T's "
                                     "rows: whole 16-byte chunks, 16-key groups), got seqlen_kv " + Str(p.seqlen_kv));
    }
    return Status::Ok();
  }
  if (!IsFp8(p.kv_format)) {
    if (p.kv_descale_blocks != 1 || p.kv_descale_heads != 1) {
      return Status::InvalidArgument("kv_descale goes with an FP8 KV cache: with k and v in q's dtype its operand must "
                                     "be the float32 [1, 1, 1] placeholder");
    }
    return Status::Ok();
  }
  const bool paged = p.page_size > 0;
  const int64_t blocks = paged ? p.num_pages : p.batch;
  if ((p.kv_descale_blocks != 1 && p.kv_descale_blocks != blocks) ||
      (p.kv_descale_heads != 1 && p.kv_descale_heads != p.num_kv_heads)) {
    return Status::InvalidArgument("kv_descale must be float32 [2, blocks, heads] with blocks 1 or " + Str(blocks) +
                                   (paged ? " (the pool's pages)" : " (the batch entries)") + " and heads 1 or " +
                                   Str(p.num_kv_heads) + ", got [2, " + Str(p.kv_descale_blocks) + ", " +
                                   Str(p.kv_descale_heads) + "]");
  }
  return Status::Ok();
}

}  // namespace

Status ValidateAttentionParams(const AttentionParams& p, Backend backend) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_kv < 0) {
    return Status::InvalidArgument("batch and sequence lengths must be non-negative, got batch=" + Str(p.batch) +
                                   " seqlen_q=" + Str(p.seqlen_q) + " seqlen_kv=" + Str(p.seqlen_kv));
  }
  if (p.num_heads <= 0 || p.num_kv_heads <= 0 || p.num_heads % p.num_kv_heads != 0) {
    return Status::InvalidArgument("num_heads (" + Str(p.num_heads) + ") must be a positive multiple of num_kv_heads (" +
                                   Str(p.num_kv_heads) + ")");
  }
  TE_JAX_RETURN_IF_ERROR(CheckHeadDim("head_dim", p.head_dim));
  TE_JAX_RETURN_IF_ERROR(CheckHeadDim("head_dim_v", p.head_dim_v));
  if (static_cast<int>(p.dtype) >= kNumDTypes) {
    return Status::InvalidArgument("dtype must be one of float32, bfloat16, float16, got code " +
                                   Str(static_cast<int>(p.dtype)));
  }
  if (backend == Backend::kCuda && p.dtype == DType::kFloat32) {
    return Status::InvalidArgument("the CUDA backend computes in bfloat16 or float16; got float32 inputs");
  }
  if (static_cast<int>(p.mask_type) >= kNumMaskTypes) {
    return Status::InvalidArgument("mask_type must be one of no_mask, causal, causal_bottom_right, padding, "
                                   "padding_causal, padding_causal_bottom_right, got code " +
                                   Str(static_cast<int>(p.mask_type)));
  }
  if (p.window_left < -1 || p.window_right < -1 || p.window_left > kMaxWindow || p.window_right > kMaxWindow) {
    return Status::InvalidArgument("window_size entries must be -1 (unbounded) or in [0, " + Str(kMaxWindow) +
                                   "], got (" + Str(p.window_left) + ", " + Str(p.window_right) + ")");
  }
  if (!(std::isfinite(p.scale) && p.scale > 0.0f)) {
    return Status::InvalidArgument("scale must be a finite positive number, got " + std::to_string(p.scale));
  }
  if (!(std::isfinite(p.softcap) && p.softcap >= 0.0f)) {
    return Status::InvalidArgument("softcap must be a finite number >= 0, got " + std::to_string(p.softcap));
  }
  TE_JAX_RETURN_IF_ERROR(CheckPaging(p, backend));
  TE_JAX_RETURN_IF_ERROR(CheckKvFormat(p, backend));
  TE_JAX_RETURN_IF_ERROR(CheckFlex(p, backend));
  const bool packed = p.has_segment_ids || p.has_positions;
  if (packed && p.mask_type != MaskType::kNoMask && p.mask_type != MaskType::kCausal) {
    return Status::InvalidArgument(
        "segment ids and positions go with mask_type no_mask or causal only: for padding use segment id 0, for a "
        "bottom-right diagonal pass positions (e.g. q_positions = kv_len - q_len + i)");
  }
  if (p.bias_broadcast > kBroadcastAll || static_cast<int>(p.bias_dtype) >= kNumDTypes) {
    return Status::InvalidArgument("bias must be a float32, bfloat16 or float16 array with each dim full or 1, got "
                                   "broadcast bits " + Str(p.bias_broadcast) + " and dtype code " +
                                   Str(static_cast<int>(p.bias_dtype)));
  }
  if (!p.has_bias && (p.bias_broadcast != kBroadcastAll || p.bias_dtype != DType::kFloat32)) {
    return Status::InvalidArgument("without a bias its operand must be the float32 [1, 1, 1, 1] placeholder");
  }
  if (p.dropout_threshold >= kDropoutThresholdLimit) {
    return Status::InvalidArgument("dropout_threshold must be below 2^16 (round(dropout_rate * 2^16)), got " +
                                   Str(p.dropout_threshold));
  }
  if (static_cast<int>(p.engine) >= kNumEngines) {
    return Status::InvalidArgument("engine must be te (0) or cudnn (1), got code " + Str(static_cast<int>(p.engine)));
  }
  if (backend == Backend::kCpu && p.engine != Engine::kTe) {
    return Status::InvalidArgument("the CPU backend runs te_jax's own kernels only (engine te); cuDNN needs a GPU");
  }
  if (p.has_sinks && p.engine != Engine::kTe) {
    return Status::InvalidArgument("has_sinks goes with engine te only: te_jax's lowering merges the sinks into "
                                   "cuDNN's out and lse itself");
  }
  if (backend == Backend::kCuda) {
    constexpr int64_t kMaxCudaLength = kMaxWindow;  // the kernels index rows and keys with 32-bit integers
    if (p.seqlen_q > kMaxCudaLength || p.seqlen_kv > kMaxCudaLength || p.batch > kMaxCudaGridDim ||
        p.num_heads > kMaxCudaGridDim) {
      return Status::InvalidArgument("the CUDA backend needs batch and num_heads <= " + Str(kMaxCudaGridDim) +
                                     " and sequence lengths <= " + Str(kMaxCudaLength) + ", got batch=" +
                                     Str(p.batch) + " num_heads=" + Str(p.num_heads) + " seqlen_q=" +
                                     Str(p.seqlen_q) + " seqlen_kv=" + Str(p.seqlen_kv));
    }
  }
  return Status::Ok();
}

Status ValidateBackwardParams(const AttentionParams& p, Backend backend) {
  if (IsFp8(p.q_format)) {
    return Status::InvalidArgument("the backward takes no FP8 q, k and v: FP8 operands get no gradient (fp8=True "
                                   "trains through the dequantized values)");
  }
  if (IsFp8(p.kv_format)) {
    return Status::InvalidArgument("the backward takes no FP8 KV cache: it is given the dequantized k and v (te_jax's "
                                   "VJPs dequantize them)");
  }
  if (p.page_size != 0) {
    return Status::InvalidArgument("the backward takes no paged KV cache (page_size must be 0, got " +
                                   Str(p.page_size) + "): te_jax.paged_attention differentiates through the gathered "
                                   "pages");
  }
  if (backend == Backend::kCuda && p.has_bias && p.deterministic && BiasGradientSums(p)) {
    const BiasLayout layout = MakeBiasLayout(p);
    return Status::InvalidArgument(
        "deterministic=True with a broadcast bias (shape [" + Str(layout.dims[0]) + ", " + Str(layout.dims[1]) + ", " +
        Str(layout.dims[2]) + ", " + Str(layout.dims[3]) + "] for [B, H, Sq, Skv] = [" + Str(p.batch) + ", " +
        Str(p.num_heads) + ", " + Str(p.seqlen_q) + ", " + Str(p.seqlen_kv) + "]) on the GPU: its gradient sums over "
        "the broadcast dims with float atomics, in an order that varies between runs; pass the bias in full shape "
        "(jnp.broadcast_to) or deterministic=False");
  }
  return Status::Ok();
}

Status ValidateSeqlens(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens) {
  if (!IsPadding(p.mask_type)) return Status::Ok();  // the lengths are placeholders: Sq and Skv
  q_seqlens = QuerySeqlensRead(p, q_seqlens);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (q_seqlens != nullptr && (q_seqlens[b] < 0 || q_seqlens[b] > p.seqlen_q)) {
      return Status::InvalidArgument("q_seqlens[" + Str(b) + "] = " + Str(q_seqlens[b]) + " is outside [0, " +
                                     Str(p.seqlen_q) + "]");
    }
    if (kv_seqlens[b] < 0 || kv_seqlens[b] > p.seqlen_kv) {
      return Status::InvalidArgument("kv_seqlens[" + Str(b) + "] = " + Str(kv_seqlens[b]) + " is outside [0, " +
                                     Str(p.seqlen_kv) + "]");
    }
  }
  return Status::Ok();
}

Status ValidatePageTable(const AttentionParams& p, const int32_t* page_table, const int32_t* kv_seqlens) {
  if (p.page_size == 0) return Status::Ok();
  const KvRows rows = MakeKvRows(p, page_table, p.head_dim);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t j = 0; j < rows.PagesOf(kv_seqlens[b]); ++j) {
      if (!rows.PageInPool(b, j)) {
        const int32_t page = page_table[b * rows.pages_per_seq + j];
        return Status::InvalidArgument("page_table[" + Str(b) + ", " + Str(j) + "] = " + Str(page) +
                                       " is not a page of the pool [0, " + Str(p.num_pages) + "), and sequence " +
                                       Str(b) + " (kv_seqlens[" + Str(b) + "] = " + Str(kv_seqlens[b]) + ") uses it");
      }
    }
  }
  return Status::Ok();
}

}  // namespace te_jax
