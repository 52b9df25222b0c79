// Attention dropout's keep rule (issue 12), the C++ twin of te_jax/dropout.py: Philox4x32-10 (Salmon et al., SC 2011)
// keyed by the JAX PRNG key's two words, with the element's global indices (b, h, i, j) as the counter. Any kernel,
// tile or shard computes any element's bit alone, so every backend and sharding gives the one mask the key defines.
// Host and device code (NVRTC too) include it.
#pragma once

#include "cpp/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif

namespace te_jax {

struct PhiloxWords {
  uint32_t w[4];
};

TE_JAX_HOST_DEVICE PhiloxWords Philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                             uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{0xD2511F53u} * c0, p1 = uint64_t{0xCD9E8D57u} * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;  // the key increments: the golden ratio and sqrt(3) - 1 in 32-bit fixed point
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// One call's view of the global [B, H, Sq, Skv] keep-mask: the key, the global indices of this call's element
// [0, 0, 0, 0] (nonzero for a shard) and the threshold below which a word drops its element.
struct DropoutMask {
  uint32_t key[2];
  uint32_t offset[4];  // b, h, i, j
  uint32_t threshold;

  // The words of the group of keys 4 * (j / 4) .. + 3 (j global) of local row (b, h, i); element j uses word j % 4.
  TE_JAX_HOST_DEVICE PhiloxWords Group(int64_t b, int64_t h, int64_t i, uint32_t global_j) const {
    return Philox4x32_10(global_j >> 2, offset[2] + static_cast<uint32_t>(i), offset[1] + static_cast<uint32_t>(h),
                         offset[0] + static_cast<uint32_t>(b), key[0], key[1]);
  }
  TE_JAX_HOST_DEVICE bool Keeps(uint32_t word) const { return word >= threshold; }
};

}  // namespace te_jax
