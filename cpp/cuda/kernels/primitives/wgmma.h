// wgmma (sm90a): warpgroup-wide asynchronous matrix products, 64 x N x 16 per instruction with float accumulators.
// The four warps of a warpgroup issue it together; B (and A, for the shared-memory form) is read from shared memory
// through a matrix descriptor, A may instead come from registers in the m16n8 fragment layout (primitives/fragment.h).
// The accumulator of a 64 x N product holds N / 2 floats per thread in that same layout: warp w of the warpgroup owns
// rows 16 w .. 16 w + 15, and float 4 j + e is element e of the m16n8 tile j.
// Products run asynchronously: issued instructions are committed as a group, and wgmma.wait_group is the only point
// after which their accumulators may be read and their register operands changed. FenceOperands tells the compiler so.
#pragma once

#include "cpp/cuda/kernels/primitives/element.h"

namespace te_jax::cuda {

// A shared-memory matrix descriptor for the 128-byte swizzle (swizzled_tile.h says how tiles are laid out): start
// address, leading and stride byte offsets, each in 16-byte units, and the swizzle mode in bits 62-63.
__device__ __forceinline__ uint64_t MatrixDescriptor(uint32_t smem_addr, uint32_t leading_bytes, uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(leading_bytes >> 4) << 16 |
         static_cast<uint64_t>(stride_bytes >> 4) << 32 | 1ull << 62;
}

// The descriptor of the matrix `bytes` (a multiple of 16) further on in shared memory: an add to the start address
// field alone (bits 0-13, in 16-byte units), which holds any shared-memory address of the CTA without carrying into
// the next field. A product's k steps then cost one add each on the descriptor of its first, where building each one
// from its address took a mask, a shift and the merge with the other fields.
__device__ __forceinline__ uint64_t AdvanceDescriptor(uint64_t desc, uint32_t bytes) {
  const uint32_t start = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | start;
}

// Orders this thread's earlier register writes before the next wgmma reads them (accumulators, A fragments).
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most kPending committed groups of this warpgroup are still running (groups finish in order).
template <int kPending>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Pins registers a wgmma reads or writes to this point of the program: after a wait, so that reads of accumulators
// are not moved above it, and before WgmmaFence, so that their last writes are not moved below it (ptxas would then
// insert its own fence and serialise the products).
template <int kN>
__device__ __forceinline__ void FenceOperands(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void FenceOperands(uint32_t (&r)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(r[i][0]), "+r"(r[i][1]), "+r"(r[i][2]), "+r"(r[i][3])::"memory");
}

#define TE_JAX_WGMMA_ACC4(d, i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define TE_JAX_WGMMA_ACC16(d, i) \
  TE_JAX_WGMMA_ACC4(d, i), TE_JAX_WGMMA_ACC4(d, i + 4), TE_JAX_WGMMA_ACC4(d, i + 8), TE_JAX_WGMMA_ACC4(d, i + 12)
#define TE_JAX_WGMMA_ACC32(d) TE_JAX_WGMMA_ACC16(d, 0), TE_JAX_WGMMA_ACC16(d, 16)
#define TE_JAX_WGMMA_ACC64(d) TE_JAX_WGMMA_ACC32(d), TE_JAX_WGMMA_ACC16(d, 32), TE_JAX_WGMMA_ACC16(d, 48)
#define TE_JAX_WGMMA_REGS16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define TE_JAX_WGMMA_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  ""
#define TE_JAX_WGMMA_REGS64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  ""

// d (64 x N) = A B (accumulate == 0) or d + A B, A and B in shared memory: TRANSPOSE "0, 0" for both K-major (q k^T:
// q [rows][d] and k [keys][d]), "1, 1" for both MN-major (dq = ds k from ds^T [keys][queries] and k [keys][d]: M and N
// contiguous, K along the rows), "0, 1" for A K-major and B MN-major (dv += p^T dout from p^T [keys][queries] and
// dout [queries][dv]).
#define TE_JAX_WGMMA_SS(N, TYPE, REGS, A, B, ACCUMULATE, TRANSPOSE)          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\n"                      \
  "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, " \
  A ", " B ", p, 1, 1, " TRANSPOSE ";\n}\n"
// d (64 x N) += A B, A (64 x 16) from registers, B MN-major in shared memory (p v: v [keys][dv], dv contiguous).
#define TE_JAX_WGMMA_RS(N, TYPE, REGS, A, B, ACCUMULATE)                     \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\n"                      \
  "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" REGS "}, " \
  A ", " B ", p, 1, 1, 1;\n}\n"

template <typename Element, int kN>
struct Wgmma;

// A shared-memory product member: SS (A and B K-major), SSMN (both MN-major) or SSMNB (B MN-major), which differ in
// TE_JAX_WGMMA_SS's TRANSPOSE.
#define TE_JAX_WGMMA_SS_MEMBER(NAME, TRANSPOSE, N, ACC, REGS, A, B, FLAG)                                       \
  static __device__ __forceinline__ void NAME(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {       \
    if constexpr (Element::kIsBf16) {                                                                           \
      asm volatile(TE_JAX_WGMMA_SS(N, "bf16", REGS, A, B, FLAG, TRANSPOSE)                                      \
                   : ACC(d) : "l"(a), "l"(b), "r"(accumulate));                                                 \
    } else {                                                                                                    \
      asm volatile(TE_JAX_WGMMA_SS(N, "f16", REGS, A, B, FLAG, TRANSPOSE)                                       \
                   : ACC(d) : "l"(a), "l"(b), "r"(accumulate));                                                 \
    }                                                                                                           \
  }

// One specialisation per n: N accumulator registers (N / 2 floats), their placeholders, and the operand numbers that
// follow them (A or its four registers, B, the accumulate flag).
#define TE_JAX_WGMMA_SPECIALISATION(N, ACC, REGS, SS_A, SS_B, SS_FLAG, RS_A, RS_B, RS_FLAG)                        \
  template <typename Element>                                                                                   \
  struct Wgmma<Element, N> {                                                                                    \
    TE_JAX_WGMMA_SS_MEMBER(SS, "0, 0", N, ACC, REGS, SS_A, SS_B, SS_FLAG)                                       \
    TE_JAX_WGMMA_SS_MEMBER(SSMN, "1, 1", N, ACC, REGS, SS_A, SS_B, SS_FLAG)                                     \
    TE_JAX_WGMMA_SS_MEMBER(SSMNB, "0, 1", N, ACC, REGS, SS_A, SS_B, SS_FLAG)                                    \
    static __device__ __forceinline__ void RS(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {           \
      if constexpr (Element::kIsBf16) {                                                                         \
        asm volatile(TE_JAX_WGMMA_RS(N, "bf16", REGS, RS_A, RS_B, RS_FLAG)                                       \
                     : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                    \
      } else {                                                                                                  \
        asm volatile(TE_JAX_WGMMA_RS(N, "f16", REGS, RS_A, RS_B, RS_FLAG)                                        \
                     : ACC(d) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                    \
      }                                                                                                         \
    }                                                                                                           \
  };

#define TE_JAX_WGMMA_ACC16_ALL(d) TE_JAX_WGMMA_ACC16(d, 0)
TE_JAX_WGMMA_SPECIALISATION(32, TE_JAX_WGMMA_ACC16_ALL, TE_JAX_WGMMA_REGS16, "%16", "%17", "%18",
                            "{%16, %17, %18, %19}", "%20", "%21")
TE_JAX_WGMMA_SPECIALISATION(64, TE_JAX_WGMMA_ACC32, TE_JAX_WGMMA_REGS32, "%32", "%33", "%34", "{%32, %33, %34, %35}",
                            "%36", "%37")
TE_JAX_WGMMA_SPECIALISATION(128, TE_JAX_WGMMA_ACC64, TE_JAX_WGMMA_REGS64, "%64", "%65", "%66", "{%64, %65, %66, %67}",
                            "%68", "%69")

// FP8 (8-bit A and B, k 32 per instruction): both operands K-major, the only form 8-bit wgmma has; A (64 x 32) from
// shared memory or from registers (primitives/fragment.h PackFp8AFragment). AType and BType are E4M3 or E5M2.
#define TE_JAX_WGMMA_FP8(N, A_TYPE, B_TYPE, REGS, A, B, ACCUMULATE)                                   \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " ACCUMULATE ", 0;\n"                                             \
  "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32." A_TYPE "." B_TYPE " {" REGS "}, " A ", " B ", p, 1, 1;\n}\n"
#define TE_JAX_WGMMA_FP8_TYPES(N, REGS, A, B, ACCUMULATE, OPERANDS, ACC, d)                                     \
  if constexpr (AType::kIsE4M3 && BType::kIsE4M3) {                                                            \
    asm volatile(TE_JAX_WGMMA_FP8(N, "e4m3", "e4m3", REGS, A, B, ACCUMULATE) : ACC(d) : OPERANDS);               \
  } else if constexpr (AType::kIsE4M3) {                                                                       \
    asm volatile(TE_JAX_WGMMA_FP8(N, "e4m3", "e5m2", REGS, A, B, ACCUMULATE) : ACC(d) : OPERANDS);               \
  } else if constexpr (BType::kIsE4M3) {                                                                       \
    asm volatile(TE_JAX_WGMMA_FP8(N, "e5m2", "e4m3", REGS, A, B, ACCUMULATE) : ACC(d) : OPERANDS);               \
  } else {                                                                                                     \
    asm volatile(TE_JAX_WGMMA_FP8(N, "e5m2", "e5m2", REGS, A, B, ACCUMULATE) : ACC(d) : OPERANDS);               \
  }
#define TE_JAX_COMMA ,

template <typename AType, typename BType, int kN>
struct WgmmaFp8;

template <typename AType, typename BType>
struct WgmmaFp8<AType, BType, 128> {
  static __device__ __forceinline__ void SS(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
    TE_JAX_WGMMA_FP8_TYPES(128, TE_JAX_WGMMA_REGS64, "%64", "%65", "%66",
                           "l"(a) TE_JAX_COMMA "l"(b) TE_JAX_COMMA "r"(accumulate), TE_JAX_WGMMA_ACC64, d)
  }
  static __device__ __forceinline__ void RS(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
    TE_JAX_WGMMA_FP8_TYPES(128, TE_JAX_WGMMA_REGS64, "{%64, %65, %66, %67}", "%68", "%69",
                           "r"(a[0]) TE_JAX_COMMA "r"(a[1]) TE_JAX_COMMA "r"(a[2]) TE_JAX_COMMA "r"(a[3])
                               TE_JAX_COMMA "l"(b) TE_JAX_COMMA "r"(1),
                           TE_JAX_WGMMA_ACC64, d)
  }
};

#undef TE_JAX_COMMA
#undef TE_JAX_WGMMA_FP8_TYPES
#undef TE_JAX_WGMMA_FP8
#undef TE_JAX_WGMMA_SPECIALISATION
#undef TE_JAX_WGMMA_SS_MEMBER
#undef TE_JAX_WGMMA_RS
#undef TE_JAX_WGMMA_SS
#undef TE_JAX_WGMMA_REGS64
#undef TE_JAX_WGMMA_REGS32
#undef TE_JAX_WGMMA_REGS16
#undef TE_JAX_WGMMA_ACC16_ALL
#undef TE_JAX_WGMMA_ACC64
#undef TE_JAX_WGMMA_ACC32
#undef TE_JAX_WGMMA_ACC16
#undef TE_JAX_WGMMA_ACC4

// setmaxnreg: moves registers between warpgroups. The kernel starts with an equal share per thread (its launch bounds);
// the producer warpgroup gives most of its share back and the consumer warpgroups take it.
template <int kRegisters>
__device__ __forceinline__ void DecreaseRegisters() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegisters));
}
template <int kRegisters>
__device__ __forceinline__ void IncreaseRegisters() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegisters));
}

}  // namespace te_jax::cuda
