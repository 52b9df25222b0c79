// Attention dropout in the CUDA kernels (issue 12): the keep rule of cpp/philox.h, so a key gives the same mask as on
// the CPU (cpu/dropout_tile.h) and in te_jax.dropout_keep_mask. An element (b, h, i, j) is kept, and scaled by
// 1 / (1 - rate), when 16-bit number j % 8 of Philox4x32-10 at counter (j / 8, i, h, b) (global indices) reaches the
// threshold. The forward multiplies P by the factor before P.V; the backward uses P times the factor for dV and
// dS = P * (factor * dP - delta') (probability_grad.h).
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/philox.h"

namespace te_jax::cuda {

struct KernelDropout {
  DropoutMask mask;
  float keep_scale;

  // The call's mask from its dropout operand (the key's two words, then the global (b, h, i, j) of element 0).
  static __device__ __forceinline__ KernelDropout Of(const DropoutArgs& d) {
    KernelDropout k;
    k.mask.key[0] = d.operand[0];
    k.mask.key[1] = d.operand[1];
#pragma unroll
    for (int a = 0; a < 4; ++a) k.mask.offset[a] = d.operand[2 + a];
    k.mask.threshold = d.threshold;
    k.keep_scale = d.keep_scale;
    return k;
  }

  // Whether element (b, h, i, j) is kept (local indices).
  __device__ __forceinline__ bool Keeps(int b, int h, int i, int j) const {
    const uint32_t global_j = mask.offset[3] + static_cast<uint32_t>(j);
    return mask.Keeps(DropoutMask::Half(mask.Group(b, h, i, global_j), global_j & 7));
  }

  // The keep bits of the 2 x kN8 x 2 elements a thread holds of an m16n8 accumulator tile: bit 2 (r kN8 + j) + c is
  // element (row0 + 8 r, col0 + 8 j + c), with row0 = (a multiple of 8) + lane / 4 and col0 = (a multiple of 8) +
  // 2 (lane % 4). A Philox call draws the numbers of 8 keys of one query, which several lanes hold; when the key offset
  // is a multiple of 8 (always, but for context-parallel shards that start mid-group) the lanes that need the same
  // calls split them and deal the numbers out by shuffles (every lane of the warp must call this):
  //   queries along the rows (forward, dq): the call of (row, n8 tile j) serves the quad, each lane a word (its two
  //     keys); in round m lane t makes call 4 m + t of the quad's 2 kN8 and a 4 x 4 transpose deals the words;
  //   keys along the rows (the dk/dv kernel's transposed tile): the call of (query, 8 key rows) serves the 8 lanes
  //     4 apart, each a 16-bit number (its key); in round m lane g makes call 8 m + g (= the bit it feeds) and an 8 x 8
  //     transpose deals the numbers.
  // The rounds run two at a time: one Philox chain alone leaves a consumer warp waiting on its multiplies (measured
  // on an H200: -8% of the dropout forward's time against one at a time); all four at once spills at d = 128.
  template <int kN8, bool kKeysAlongRows>
  __device__ __forceinline__ uint32_t TileBits(int b, int h, int row0, int col0) const {
    static_assert(kN8 <= 8 && kN8 % 2 == 0, "32 keep bits per thread, whole rounds of calls");
    if ((mask.offset[3] & 7u) != 0) return TileBitsAlone<kN8, kKeysAlongRows>(b, h, row0, col0);
    const int lane = threadIdx.x & 31;
    uint32_t bits = 0;
    if constexpr (kKeysAlongRows) {
      const int g = lane >> 2;  // this lane's key within its group of 8 (and the number it keeps)
      const uint32_t group = mask.offset[3] + static_cast<uint32_t>(row0 - g);
#pragma unroll 2
      for (int m = 0; m < kN8 / 2; ++m) {
        // Call k = 8 m + g = 2 (r kN8 + j) + c: query col0 + 8 j + c, keys group + 8 r ..
        const int k = 8 * m + g;
        const int r = k / (2 * kN8), j = (k / 2) % kN8, c = k & 1;
        const PhiloxWords words = mask.Group(b, h, col0 + 8 * j + c, group + 8 * r);
#pragma unroll
        for (int q = 0; q < 8; ++q) {
          // Lane g sends number g ^ q to lane g ^ q, which keeps it as bit 8 m + g.
          const uint32_t sent = DropoutMask::Half(words, static_cast<uint32_t>(g ^ q));
          const uint32_t got = q == 0 ? sent : __shfl_xor_sync(0xffffffffu, sent, 4 * q);
          bits |= static_cast<uint32_t>(mask.Keeps(got)) << (8 * m + (g ^ q));
        }
      }
    } else {
      const int t = lane & 3;  // this lane's word of each call (its keys 2 t, 2 t + 1 of the 8)
      const uint32_t key0 = mask.offset[3] + static_cast<uint32_t>(col0 - 2 * t);
#pragma unroll 2
      for (int m = 0; m < kN8 / 2; ++m) {
        // Call k = 4 m + t = r kN8 + j: row row0 + 8 r, keys key0 + 8 j ..
        const int k = 4 * m + t;
        const int r = k / kN8, j = k % kN8;
        const PhiloxWords words = mask.Group(b, h, row0 + 8 * r, key0 + 8 * j);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          // Lane t sends word t ^ q to lane t ^ q, whose two keys of call 4 m + t it holds: bits 2 (4 m + t) + c.
          const uint32_t sent = DropoutMask::Word(words, static_cast<uint32_t>(t ^ q));
          const uint32_t got = q == 0 ? sent : __shfl_xor_sync(0xffffffffu, sent, q);
          const uint32_t pair = static_cast<uint32_t>(mask.Keeps(DropoutMask::Half(got, 0))) |
                                static_cast<uint32_t>(mask.Keeps(DropoutMask::Half(got, 1))) << 1;
          bits |= pair << (2 * (4 * m + (t ^ q)));
        }
      }
    }
    return bits;
  }

  // TileBits with every element's call made by the lane that holds it (any key offset).
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
