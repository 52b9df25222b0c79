// The m16n8 accumulator layout both tensor-core families share: mma.sync's C tile (sm80) and each warp's 16 rows of a
// wgmma accumulator (sm90) hold, per thread (g = lane / 4, t = lane % 4), c[j][0..1] at (g, 8j + 2t..+1) and c[j][2..3]
// at (g + 8, 8j + 2t..+1). The same 16 x 16 block as a 16-bit A operand (mma.sync's A fragment, wgmma's A from registers)
// is a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..).
#pragma once

#include "cpp/cuda/kernels/primitives/element.h"

namespace te_jax::cuda {

// Two adjacent C tiles (columns 16 kk .. 16 kk + 15) rounded to 16 bits: exactly the A fragment of k 16 kk .. + 15, which
// is how P and dS feed the next product without leaving registers.
template <typename Element, int kN8>
__device__ __forceinline__ void PackAFragment(const float (&c)[kN8][4], int kk, uint32_t (&a)[4]) {
  a[0] = Element::Pack(c[2 * kk][0], c[2 * kk][1]);
  a[1] = Element::Pack(c[2 * kk][2], c[2 * kk][3]);
  a[2] = Element::Pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = Element::Pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

// Four adjacent C tiles (columns 32 kk .. 32 kk + 31) times `scale` in an 8-bit format, as the A fragment of k 32 kk ..
// + 31 of an FP8 product (wgmma k32: a0 (g, 4t..4t+3), a1 (g + 8, 4t..), a2 (g, 16 + 4t..), a3 (g + 8, 16 + 4t..), the
// lowest k in the low byte). No value changes lanes: a thread's columns 8j + 2t, 8j + 2t + 1 of tiles j = 4kk .. 4kk + 3
// fill its k slots in order, so k slot 4t + i of each 16 stands for column 8 (i / 2) + 2t + i % 2 of those 16
// (Fp8KeyOfSlot), and the B operand's rows (V's keys) must be stored in that order.
template <typename Fp8, int kN8>
__device__ __forceinline__ void PackFp8AFragment(const float (&c)[kN8][4], int kk, float scale, uint32_t (&a)[4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float(&x)[4] = c[4 * kk + 2 * h];
    const float(&y)[4] = c[4 * kk + 2 * h + 1];
    a[2 * h] = Fp8::Pack4(x[0] * scale, x[1] * scale, y[0] * scale, y[1] * scale);
    a[2 * h + 1] = Fp8::Pack4(x[2] * scale, x[3] * scale, y[2] * scale, y[3] * scale);
  }
}

// The key (column of the C tiles) that k slot `slot` (0..31) of a PackFp8AFragment stands for, within its 32.
TE_JAX_HOST_DEVICE constexpr int Fp8KeyOfSlot(int slot) {
  return (slot & 16) + 8 * ((slot >> 1) & 1) + 2 * ((slot >> 2) & 3) + (slot & 1);
}

// Whether any accumulator holds NaN (the kernels' cue to rerun a pass with the careful handling of non-finite values).
template <int kN8>
__device__ __forceinline__ bool AnyNaN(const float (&c)[kN8][4]) {
  bool any = false;
#pragma unroll
  for (int j = 0; j < kN8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) any |= c[j][e] != c[j][e];
  return any;
}

template <int kMT, int kN8>
__device__ __forceinline__ bool AnyNaN(const float (&c)[kMT][kN8][4]) {
  bool any = false;
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) any |= AnyNaN(c[mt]);
  return any;
}

}  // namespace te_jax::cuda
