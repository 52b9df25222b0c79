// The attention masks. The numeric values are shared with te_jax.MaskType in Python and with the legacy descriptor
// format: never renumber.
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif

#include "cpp/core/host_device.h"

namespace te_jax {

enum class MaskType : uint8_t {
  kNoMask = 0,
  kCausal = 1,
  kCausalBottomRight = 2,
  kPadding = 3,
  kPaddingCausal = 4,
  kPaddingCausalBottomRight = 5,
};

inline constexpr int kNumMaskTypes = 6;

TE_JAX_HOST_DEVICE bool IsCausal(MaskType m) {
  return m == MaskType::kCausal || m == MaskType::kCausalBottomRight || m == MaskType::kPaddingCausal ||
         m == MaskType::kPaddingCausalBottomRight;
}
TE_JAX_HOST_DEVICE bool IsBottomRight(MaskType m) {
  return m == MaskType::kCausalBottomRight || m == MaskType::kPaddingCausalBottomRight;
}
// The masks that read the run-time lengths q_seqlens and kv_seqlens (the others see all Sq rows and Skv keys).
TE_JAX_HOST_DEVICE bool IsPadding(MaskType m) {
  return m == MaskType::kPadding || m == MaskType::kPaddingCausal || m == MaskType::kPaddingCausalBottomRight;
}

}  // namespace te_jax
