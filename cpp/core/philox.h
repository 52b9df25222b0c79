// Attention dropout's keep rule, the C++ twin of te_jax/dropout.py: Philox4x32-10 (Salmon et al., SC 2011)
// keyed by the JAX PRNG key's two words, with a counter made of the element's global indices. One call draws eight
// 16-bit numbers (16 bits resolve a rate to 2^-16, well inside the 0.1% the kept fraction must meet): those of rows
// i and i + 8 of a 16-row block and keys 2t, 2t + 1, 8 + 2t, 9 + 2t of a 16-key block, which are the elements one lane
// holds of an m16n8 accumulator (rows g, g + 8; columns 2t, 2t + 1 of two n8 tiles), so a kernel's lane draws its own
// numbers without trading them with other lanes. Any kernel, tile or shard computes any element's bit alone, so every
// backend and sharding gives the one mask the key defines.
// Host and device code (NVRTC too) include it.
#pragma once

#include "cpp/core/host_device.h"

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

// The drop threshold's unit: a rate r drops an element whose 16-bit number is below round(r * 2^16).
constexpr uint32_t kDropoutThresholdLimit = 1u << 16;

// 1 / the keep probability of a threshold: what a kept element is scaled by.
TE_JAX_HOST_DEVICE double DropoutKeepScale(uint32_t threshold) {
  return static_cast<double>(kDropoutThresholdLimit) / static_cast<double>(kDropoutThresholdLimit - threshold);
}

// One call's view of the global [B, H, Sq, Skv] keep-mask: the key, the global indices of this call's element
// [0, 0, 0, 0] (nonzero for a shard) and the threshold (< 2^16) below which a 16-bit number drops its element.
// Element (b, h, i, j) (i, j global) takes number 4 ((i / 8) % 2) + 2 ((j / 8) % 2) + j % 2 of the call at counter
// (4 (j / 16) + (j / 2) % 4, 8 (i / 16) + i % 8, h, b); number k is the low (even k) or high (odd k) half of word k / 2.
struct DropoutMask {
  uint32_t key[2];
  uint32_t offset[4];  // b, h, i, j
  uint32_t threshold;

  // The call that draws element (b, h, i, j): b and h local, i and j global.
  TE_JAX_HOST_DEVICE PhiloxWords Call(int64_t b, int64_t h, uint32_t global_i, uint32_t global_j) const {
    return Philox4x32_10(4 * (global_j >> 4) + ((global_j >> 1) & 3), 8 * (global_i >> 4) + (global_i & 7),
                         offset[1] + static_cast<uint32_t>(h), offset[0] + static_cast<uint32_t>(b), key[0], key[1]);
  }
  // Which of its call's eight numbers element (i, j) (global) takes.
  static TE_JAX_HOST_DEVICE uint32_t NumberIndex(uint32_t global_i, uint32_t global_j) {
    return 4 * ((global_i >> 3) & 1) + 2 * ((global_j >> 3) & 1) + (global_j & 1);
  }
  // Word w of a result, by selects (an indexed read would put the four words in local memory on the GPU).
  static TE_JAX_HOST_DEVICE uint32_t Word(const PhiloxWords& p, uint32_t w) {
    return w == 0 ? p.w[0] : w == 1 ? p.w[1] : w == 2 ? p.w[2] : p.w[3];
  }
  // 16-bit number k of a result: the low half of word k / 2 for even k, the high half for odd k.
  static TE_JAX_HOST_DEVICE uint32_t Half(uint32_t word, uint32_t k) { return k & 1 ? word >> 16 : word & 0xFFFFu; }
  static TE_JAX_HOST_DEVICE uint32_t Number(const PhiloxWords& p, uint32_t k) { return Half(Word(p, k >> 1), k); }
  TE_JAX_HOST_DEVICE bool Keeps(uint32_t number) const { return number >= threshold; }
  // Whether element (b, h, i, j) (b, h local; i, j global) is kept, drawn alone.
  TE_JAX_HOST_DEVICE bool KeepsElement(int64_t b, int64_t h, uint32_t global_i, uint32_t global_j) const {
    return Keeps(Number(Call(b, h, global_i, global_j), NumberIndex(global_i, global_j)));
  }
};

}  // namespace te_jax
