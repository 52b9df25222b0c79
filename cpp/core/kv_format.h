// How k and v are stored: in q's dtype, or as an FP8 KV cache (8-bit floats with float32 descales, q and out keeping
// their dtype), which halves the bytes a decode step reads. The numeric values are part of the legacy descriptor
// format: never renumber.
#pragma once

#include "cpp/core/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cstdint>

#include "cpp/core/dtype.h"
#endif

namespace te_jax {

enum class KvFormat : uint8_t { kAsQ = 0, kE4M3 = 1, kE5M2 = 2 };

inline constexpr int kNumKvFormats = 3;

TE_JAX_HOST_DEVICE constexpr bool IsFp8(KvFormat format) { return format != KvFormat::kAsQ; }

#if !defined(__CUDACC_RTC__)
// The bytes of one element of k or v.
inline int KvElementSize(DType dtype, KvFormat format) { return IsFp8(format) ? 1 : DTypeSize(dtype); }
#endif

// An FP8 KV cache's descales, float32 [2, blocks, heads] (cpp/core/attention_params.h): k's then v's, per block of keys
// (1; the pool's pages of a paged call; the batch entries of a contiguous one) and per K/V head (1 or Hkv), so that
// float(x8) * descale is the value of an element x8 of k or v.
struct KvDescales {
  const float* data = nullptr;
  int64_t blocks = 1;
  int64_t heads = 1;

  // The block of a key: `page` (its page in the pool) in a paged call, `batch` (its batch entry) in a contiguous one.
  TE_JAX_HOST_DEVICE int64_t Block(bool paged, int64_t page, int64_t batch) const {
    return blocks == 1 ? 0 : paged ? page : batch;
  }
  TE_JAX_HOST_DEVICE float K(int64_t block, int64_t head) const { return data[block * heads + (heads == 1 ? 0 : head)]; }
  TE_JAX_HOST_DEVICE float V(int64_t block, int64_t head) const {
    return data[(blocks + block) * heads + (heads == 1 ? 0 : head)];
  }
};

}  // namespace te_jax
