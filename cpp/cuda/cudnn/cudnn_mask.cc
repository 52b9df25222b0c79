#include "cpp/cuda/cudnn/cudnn_mask.h"

#include <algorithm>

#include "cpp/core/mask_type.h"

namespace te_jax::cuda::cudnn {

CudnnMask CudnnMaskFor(const AttentionParams& p) {
  CudnnMask m;
  m.padding = IsPadding(p.mask_type);
  m.bottom_right = IsBottomRight(p.mask_type);
  if (IsCausal(p.mask_type)) {
    m.right_bound = 0;
  } else if (p.window_right >= 0 && p.window_right < p.seqlen_kv) {
    // Non-causal masks are top-left, so p = i >= 0 and a right window >= Skv keeps every key.
    m.right_bound = p.window_right;
  }
  // p never exceeds max(Sq, Skv) - 1 (top-left: i <= Sq - 1; bottom-right: i + skv_b - sq_b <= skv_b - 1), so a left
  // window of max(Sq, Skv) or more keeps key 0 for every row.
  if (p.window_left >= 0 && p.window_left < std::max(p.seqlen_q, p.seqlen_kv)) m.left_bound = p.window_left + 1;
  return m;
}

}  // namespace te_jax::cuda::cudnn
