// Attention dropout in the CUDA kernels: the keep rule of cpp/core/philox.h, so a key gives the same mask as on
// the CPU (cpu/dropout_tile.h) and in te_jax.dropout_keep_mask: an element is kept, and scaled by 1 / (1 - rate), when
// its 16-bit Philox4x32-10 number reaches the threshold. The forward multiplies P by the factor before P.V; the
// backward uses P times the factor for dV and dS = P * (factor * dP - delta') (probability_grad.h).
#pragma once

#include "cpp/core/philox.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

struct KernelDropout {
  DropoutMask mask;
  float keep_scale;
  uint32_t threshold_high;  // mask.threshold << 16: a word's high number is kept when the word reaches it

  // The call's mask from its dropout operand (the key's two words, then the global (b, h, i, j) of element 0).
  static __device__ __forceinline__ KernelDropout Of(const DropoutArgs& d) {
    KernelDropout k;
    k.mask.key[0] = d.operand[0];
    k.mask.key[1] = d.operand[1];
#pragma unroll
    for (int a = 0; a < 4; ++a) k.mask.offset[a] = d.operand[2 + a];
    k.mask.threshold = d.threshold;
    k.threshold_high = d.threshold << 16;
    k.keep_scale = d.keep_scale;
    return k;
  }

  // The keep bits of a word's two numbers: bit 0 the low one's, bit 1 the high one's (compared whole, not extracted).
  __device__ __forceinline__ uint32_t WordKeepBits(uint32_t word) const {
    return static_cast<uint32_t>((word & 0xFFFFu) >= mask.threshold) | static_cast<uint32_t>(word >= threshold_high) << 1;
  }

  // Whether element (b, h, i, j) is kept (local indices).
  __device__ __forceinline__ bool Keeps(int b, int h, int i, int j) const {
    return mask.KeepsElement(b, h, mask.offset[2] + static_cast<uint32_t>(i), mask.offset[3] + static_cast<uint32_t>(j));
  }

  // The keep bits of the 2 x kN8 x 2 elements a thread holds of an m16n8 accumulator tile: bit 2 (r kN8 + j) + c is
  // element (row0 + 8 r, col0 + 8 j + c), with row0 = (a multiple of 16) + lane / 4 and col0 = (a multiple of 16) +
  // 2 (lane % 4). A Philox call draws rows i, i + 8 of a 16-row block by keys 2t, 2t + 1, 8 + 2t, 9 + 2t of a 16-key
  // block (cpp/core/philox.h), so when the call's offsets keep those blocks aligned (always, but for context-parallel
  // shards that start mid-block; every lane of the warp must call this):
  //   queries along the rows (forward, dq): the lane's own call per 16 keys gives all eight of its numbers there;
  //   keys along the rows (the dk/dv kernel's transposed tile): the call of (keys g, g + 8 of a lane; queries 2t + c,
  //     2t + c + 8 of a 16-query block) serves that lane and lane ^ 4 (keys g ^ 1, g ^ 1 + 8), four numbers each: the
  //     two lanes make the calls of c = their g % 2 and trade the other's half of each word (two shuffles a call).
  // The calls run two at a time: one Philox chain alone leaves a consumer warp waiting on its multiplies (measured on
  // an H200: -8% of the dropout forward's time against one at a time); all four at once spills at d = 128.
  template <int kN8, bool kKeysAlongRows>
  __device__ __forceinline__ uint32_t TileBits(int b, int h, int row0, int col0) const {
    static_assert(kN8 <= 8 && kN8 % 2 == 0, "32 keep bits per thread, whole 16-column blocks");
    const int lane = threadIdx.x & 31;
    const int t = lane & 3;
    const uint32_t global_row0 = mask.offset[kKeysAlongRows ? 3 : 2] + static_cast<uint32_t>(row0);
    const uint32_t global_col0 = mask.offset[kKeysAlongRows ? 2 : 3] + static_cast<uint32_t>(col0 - 2 * t);
    const bool aligned = ((global_row0 - static_cast<uint32_t>(lane >> 2)) & 15) == 0 && (global_col0 & 15) == 0;
    if (!__all_sync(0xffffffffu, aligned)) return TileBitsAlone<kN8, kKeysAlongRows>(b, h, row0, col0);
    uint32_t bits = 0;
    if constexpr (kKeysAlongRows) {
      // The lane's keys are global_row0 (+ 8 r); its queries global_col0 + 2 t + c (+ 8 j). Call a (of this lane's
      // c = g % 2) serves queries 16 a + 2 t + c (s = 0) and + 8 (s = 1): number 4 s + 2 r + c' of it belongs to the
      // lane whose key has g % 2 = c'.
      const uint32_t own = (lane >> 2) & 1;
      // __byte_perm selectors of a word pair's low halves and high halves.
      const uint32_t keep_selector = own ? 0x7632u : 0x5410u, send_selector = own ? 0x5410u : 0x7632u;
#pragma unroll 2
      for (int a = 0; a < kN8 / 2; ++a) {
        const PhiloxWords words = mask.Call(b, h, global_col0 + 16 * a + 2 * t + own, global_row0);
        uint32_t mine[2], theirs[2];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          // Numbers 4 s + 2 r + c' are word 2 s + r's halves: the lane's own (r = 0, 1) packed into one word.
          mine[s] = __byte_perm(words.w[2 * s], words.w[2 * s + 1], keep_selector);
          theirs[s] = __shfl_xor_sync(0xffffffffu, __byte_perm(words.w[2 * s], words.w[2 * s + 1], send_selector), 4);
        }
        // mine: query column c = own; theirs (the partner's call): c = 1 - own. Number (s, r) of a column goes to bit
        // 2 (r kN8 + 2 a + s) + c: each column's four bits placed with one shift.
        const auto column_bits = [&](const uint32_t(&numbers)[2]) {
          return static_cast<uint32_t>((numbers[0] & 0xFFFFu) >= mask.threshold) |
                 static_cast<uint32_t>((numbers[1] & 0xFFFFu) >= mask.threshold) << 2 |
                 static_cast<uint32_t>(numbers[0] >= threshold_high) << (2 * kN8) |
                 static_cast<uint32_t>(numbers[1] >= threshold_high) << (2 * kN8 + 2);
        };
        bits |= column_bits(mine) << (4 * a + own) | column_bits(theirs) << (4 * a + 1 - own);
      }
    } else {
#pragma unroll 2
      for (int a = 0; a < kN8 / 2; ++a) {
        // Keys global_col0 + 16 a + 2 t + c (+ 8 n), rows global_row0 (+ 8 s): number 4 s + 2 n + c, word 2 s + n.
        const PhiloxWords words = mask.Call(b, h, global_row0, global_col0 + 16 * a + 2 * t);
        // Row s's four bits (n, c) sit at 2 (s kN8 + 2 a + n) + c: a nibble per row, placed with one shift.
        const uint32_t row0_bits = WordKeepBits(words.w[0]) | WordKeepBits(words.w[1]) << 2;
        const uint32_t row8_bits = WordKeepBits(words.w[2]) | WordKeepBits(words.w[3]) << 2;
        bits |= (row0_bits | row8_bits << (2 * kN8)) << (4 * a);
      }
    }
    return bits;
  }

  // TileBits with every element drawn alone by the lane that holds it (any offsets).
  template <int kN8, bool kKeysAlongRows>
  __device__ __forceinline__ uint32_t TileBitsAlone(int b, int h, int row0, int col0) const {
    uint32_t bits = 0;
#pragma unroll 1
    for (int k = 0; k < 4 * kN8; ++k) {
      const int row = row0 + 8 * (k / (2 * kN8)), col = col0 + 8 * ((k / 2) % kN8) + (k & 1);
      const bool kept = kKeysAlongRows ? Keeps(b, h, col, row) : Keeps(b, h, row, col);
      bits |= static_cast<uint32_t>(kept) << k;
    }
    return bits;
  }

  // The factor of bit `index` of TileBits: 1 / (1 - rate) kept, 0 dropped.
  __device__ __forceinline__ float Factor(uint32_t bits, int index) const {
    return (bits >> index) & 1u ? keep_scale : 0.0f;
  }
};

}  // namespace te_jax::cuda
