#include "cpp/cuda/cudnn/cudnn_contract.h"

#include <cstdint>
#include <limits>
#include <string>

#include "cpp/cuda/cudnn/cudnn_mask.h"

namespace te_jax::cuda::cudnn {

Status CheckCudnnContract(const AttentionParams& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) {
    return Status::InvalidArgument("the cuDNN engine runs bfloat16 and float16 only");
  }
  if (p.softcap > 0.0f) {
    // The frontend's soft-cap is a score modifier, and score modifiers exclude its padding and diagonal masks.
    return Status::InvalidArgument("cuDNN's fused attention has no soft-cap");
  }
  if (p.has_alibi) {
    return Status::InvalidArgument("cuDNN's ALiBi uses fixed geometric slopes per head (and only with a causal "
                                   "mask); te_jax takes arbitrary alibi_slopes per (batch, head)");
  }
  if (p.dropout_threshold > 0) {
    // cuDNN draws its own mask: te_jax's dropout is the one mask its key defines on every backend (cpp/core/philox.h).
    return Status::InvalidArgument("the cuDNN engine does not apply te_jax's dropout (its keep-mask differs)");
  }
  if (p.has_segment_ids || p.has_positions) {
    // cuDNN has no per-token ids or positions for a padded (non-ragged) layout; ragged offsets would need te_jax to
    // repack the rows, which is not done yet.
    return Status::InvalidArgument("the cuDNN engine does not take segment ids or positions (te_jax's kernels do)");
  }
  if (p.flex.active()) {
    return Status::InvalidArgument("the cuDNN engine does not run a score_mod or mask_mod (te_jax's kernels do)");
  }
  if (p.page_size > 0) {
    return Status::InvalidArgument("the cuDNN engine does not read a paged KV cache (te_jax's decode kernels do)");
  }
  if (IsFp8(p.q_format)) {
    return Status::InvalidArgument("the cuDNN engine does not run FP8 attention (te_jax's sm90 FP8 kernel does)");
  }
  if (IsFp8(p.kv_format)) {
    return Status::InvalidArgument("the cuDNN engine does not read an FP8 KV cache (te_jax's decode kernels do)");
  }
  if (p.has_bias) {
    // cuDNN's SDPA takes a bias (and gives dbias for some broadcast shapes), not wired up yet; te_jax's kernels serve it.
    return Status::InvalidArgument("the cuDNN engine does not take a bias (te_jax's kernels do)");
  }
  if (p.batch == 0 || p.seqlen_q == 0 || p.seqlen_kv == 0) {
    return Status::InvalidArgument("cuDNN's graphs need non-empty tensors (batch, seqlen_q and seqlen_kv >= 1)");
  }
  constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
  if (p.seqlen_q > kInt32Max || p.seqlen_kv > kInt32Max) {
    return Status::InvalidArgument("the cuDNN engine needs seqlen_q and seqlen_kv < 2^31 (cuDNN's lengths are int32)");
  }
  // With Sq > Skv, the first Sq - Skv rows of a bottom-right mask see no key, and a binding left window can leave the
  // last rows none. Whether cuDNN then writes out = 0 and lse = -inf is not documented (the frontend itself refuses
  // both without a padding mask), so those configurations stay with te_jax's kernels.
  const CudnnMask mask = CudnnMaskFor(p);
  if (p.seqlen_q > p.seqlen_kv && mask.bottom_right) {
    return Status::InvalidArgument("a bottom-right causal mask with seqlen_q (" + std::to_string(p.seqlen_q) +
                                   ") > seqlen_kv (" + std::to_string(p.seqlen_kv) +
                                   ") leaves rows with no visible key, which cuDNN does not guarantee to zero");
  }
  if (p.seqlen_q > p.seqlen_kv && mask.left_bound.has_value()) {
    return Status::InvalidArgument("a left window with seqlen_q (" + std::to_string(p.seqlen_q) + ") > seqlen_kv (" +
                                   std::to_string(p.seqlen_kv) +
                                   ") can leave rows with no visible key, which cuDNN does not guarantee to zero");
  }
  return Status::Ok();
}

}  // namespace te_jax::cuda::cudnn
