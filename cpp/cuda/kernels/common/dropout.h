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
  // element (row0 + 8 r, col0 + 8 j + c). With queries along the rows (forward, dq) a Philox call serves a pair; with
  // keys along the rows (the dk/dv kernel's transposed tile) each element needs its own. The loop is rolled so that one
  // call's registers are live at a time (unrolled, the d = 128 forward spilled ~500 bytes).
  template <int kN8, bool kKeysAlongRows>
  __device__ __forceinline__ uint32_t TileBits(int b, int h, int row0, int col0) const {
    static_assert(kN8 <= 16, "32 keep bits per thread");
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
