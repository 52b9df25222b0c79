// Attention dropout in the CUDA kernels (issue 12): the keep rule of cpp/philox.h, so a key gives the same mask as on
// the CPU (cpu/dropout_tile.h) and in te_jax.dropout_keep_mask. An element (b, h, i, j) is kept, and scaled by
// 1 / (1 - rate), when word j % 4 of Philox4x32-10 at counter (j / 4, i, h, b) (global indices) reaches the threshold.
// The forward multiplies P by the factor before P.V; the backward uses P times the factor for dV and
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

  // Word w of a Philox result by selects (an indexed read would put the four words in local memory).
  static __device__ __forceinline__ uint32_t Word(const PhiloxWords& p, uint32_t w) {
    return w == 0 ? p.w[0] : w == 1 ? p.w[1] : w == 2 ? p.w[2] : p.w[3];
  }

  // Whether element (b, h, i, j) is kept (local indices).
  __device__ __forceinline__ bool Keeps(int b, int h, int i, int j) const {
    const uint32_t global_j = mask.offset[3] + static_cast<uint32_t>(j);
    return mask.Keeps(Word(mask.Group(b, h, i, global_j), global_j & 3));
  }

  // Whether elements (b, h, i, j) and (b, h, i, j + 1) are kept: one Philox call unless the pair straddles a group of
  // four keys (only with an odd key offset, i.e. a context-parallel shard that starts mid-group).
  __device__ __forceinline__ void PairKeeps(int b, int h, int i, int j, bool& k0, bool& k1) const {
    const uint32_t global_j = mask.offset[3] + static_cast<uint32_t>(j);
    const PhiloxWords words = mask.Group(b, h, i, global_j);
    const uint32_t w = global_j & 3;
    k0 = mask.Keeps(Word(words, w));
    k1 = mask.Keeps(w != 3 ? Word(words, w + 1) : mask.Group(b, h, i, global_j + 1).w[0]);
  }

  // The keep bits of the 2 x kN8 x 2 elements a thread holds of an m16n8 accumulator tile: bit 2 (r kN8 + j) + c is
  // element (row0 + 8 r, col0 + 8 j + c), with col0 = (a multiple of 8) + 2 (lane % 4). Loops are rolled so that one
  // Philox call's registers are live at a time (unrolled, the d = 128 forward spilled ~500 bytes). When the key offset
  // is a multiple of 4 (always, but for context-parallel shards that start mid-group) lanes that need the same Philox
  // calls split them and trade words by shuffles (every lane of the warp must call this):
  //   queries along the rows (forward, dq): lanes t and t ^ 1 read the same group of 4 keys, each computes one row's;
  //   keys along the rows (the dk/dv kernel's transposed tile): the 4 lanes whose keys form one group (lanes 4 apart)
  //     need the same 32 calls and one word each: each computes 8, and a 4 x 4 transpose by shuffles deals the words.
  template <int kN8, bool kKeysAlongRows>
  __device__ __forceinline__ uint32_t TileBits(int b, int h, int row0, int col0) const {
    static_assert(kN8 <= 16, "32 keep bits per thread");
    if ((mask.offset[3] & 3u) != 0) return TileBitsAlone<kN8, kKeysAlongRows>(b, h, row0, col0);
    const int lane = threadIdx.x & 31;
    uint32_t bits = 0;
    if constexpr (kKeysAlongRows) {
      const int s = (lane >> 2) & 3;  // this lane's key within its group of 4 (and the word it keeps)
#pragma unroll 1
      for (int m = 0; m < kN8; ++m) {
        // Round m: this lane makes the call of element k = 4 m + s = 2 (r kN8 + j) + c, (query col0 + 8 j + c, the
        // group of key row0 + 8 r), which is the same group for the four lanes.
        const int k = 4 * m + s;
        const int r = k / (2 * kN8), j = (k / 2) % kN8, c = k & 1;
        const uint32_t key = mask.offset[3] + static_cast<uint32_t>(row0 + 8 * r);
        const PhiloxWords words = mask.Group(b, h, col0 + 8 * j + c, key);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          // Lane s sends word s ^ q to lane s ^ q, which keeps it for element 4 m + s.
          const uint32_t sent = Word(words, static_cast<uint32_t>(s ^ q));
          const uint32_t got = q == 0 ? sent : __shfl_xor_sync(0xffffffffu, sent, 4 * q);
          bits |= static_cast<uint32_t>(mask.Keeps(got)) << (4 * m + (s ^ q));
        }
      }
    } else {
      const int pair = lane & 1;  // which row of the two this lane computes; its partner (lane ^ 1) the other
#pragma unroll 1
      for (int j = 0; j < kN8; ++j) {
        const uint32_t key = mask.offset[3] + static_cast<uint32_t>(col0 + 8 * j);
        const PhiloxWords words = mask.Group(b, h, row0 + 8 * pair, key);
        // This lane's columns are words 2 pair, 2 pair + 1 of the group; the partner's the other two.
        const uint32_t own0 = pair ? words.w[2] : words.w[0], own1 = pair ? words.w[3] : words.w[1];
        const uint32_t got0 = __shfl_xor_sync(0xffffffffu, pair ? words.w[0] : words.w[2], 1);
        const uint32_t got1 = __shfl_xor_sync(0xffffffffu, pair ? words.w[1] : words.w[3], 1);
        const uint32_t own = static_cast<uint32_t>(mask.Keeps(own0)) | static_cast<uint32_t>(mask.Keeps(own1)) << 1;
        const uint32_t other = static_cast<uint32_t>(mask.Keeps(got0)) | static_cast<uint32_t>(mask.Keeps(got1)) << 1;
        bits |= own << (2 * (pair * kN8 + j)) | other << (2 * ((1 - pair) * kN8 + j));
      }
    }
    return bits;
  }

  // TileBits with every call made by the lane that needs it (any key offset).
  template <int kN8, bool kKeysAlongRows>
  __device__ __forceinline__ uint32_t TileBitsAlone(int b, int h, int row0, int col0) const {
    uint32_t bits = 0;
#pragma unroll 1
    for (int k = 0; k < 2 * kN8; ++k) {
      const int row = row0 + 8 * (k / kN8), col = col0 + 8 * (k % kN8);
      bool k0, k1;
      if constexpr (kKeysAlongRows) {
        k0 = Keeps(b, h, col, row);
        k1 = Keeps(b, h, col + 1, row);
      } else {
        PairKeeps(b, h, row, col, k0, k1);
      }
      bits |= (static_cast<uint32_t>(k0) | static_cast<uint32_t>(k1) << 1) << (2 * k);
    }
    return bits;
  }

  // The factor of bit `index` of TileBits: 1 / (1 - rate) kept, 0 dropped.
  __device__ __forceinline__ float Factor(uint32_t bits, int index) const {
    return (bits >> index) & 1u ? keep_scale : 0.0f;
  }
};

}  // namespace te_jax::cuda
