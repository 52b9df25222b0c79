// The tuning table of the sm90 (wgmma, TMA, warp-specialised) forward: one place for its tile shapes, read by the host
// (launch geometry, shared memory) and checked by the kernel. Head dims are padded to whole 64-column swizzle blocks in
// shared memory (the TMA copy zero-fills the padding); the products skip the k16 steps past the head dim.
#pragma once

#include "cpp/core/host_device.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda::sm90 {

TE_JAX_HOST_DEVICE constexpr int PadTo64(int d) { return (d + 63) / 64 * 64; }

// With segment ids or positions (tokens) the kernels also stage token tables (kernels/common/token_mask.h): granule
// summaries (32 bytes each), key entries (8 bytes) and query rows' entries (16 bytes).
inline constexpr int kTokenSummaryBytes = kTokenSummaryInts * 4;

inline constexpr int kMaxDynamicSmem = 227 * 1024;  // sm90's opt-in limit per block

// A producer warpgroup (one thread issues the TMA copies) and consumer warpgroups of 64 query rows each.
struct ForwardTile {
  int block_m;    // query rows per CTA: 64 per consumer warpgroup
  int block_n;    // keys per pipeline stage
  int stages;     // k and v each have a ring of this many stages
  int consumers;  // consumer warpgroups
};

TE_JAX_HOST_DEVICE constexpr int ForwardThreads(ForwardTile t) { return 128 * (1 + t.consumers); }

// The producer keeps 24 registers per thread (setmaxnreg), 32 in the persistent kernel (its work loop spilled 149
// times at 24, 47 at 32 at d 128), and the consumers share the rest of the CTA's launch allocation (its threads times
// their launch count, 65536 / threads rounded down to 8; asking for more leaves setmaxnreg.inc waiting forever): 240
// each of two consumers (232 in the persistent kernel), 160 each of three.
TE_JAX_HOST_DEVICE constexpr int ForwardProducerRegisters(bool persistent) { return persistent ? 32 : 24; }
TE_JAX_HOST_DEVICE constexpr int ForwardConsumerRegisters(ForwardTile t, bool persistent = false) {
  const int threads = ForwardThreads(t);
  const int launch = 65536 / threads / 8 * 8 * threads;
  return (launch - 128 * ForwardProducerRegisters(persistent)) / (128 * t.consumers) / 8 * 8;
}

// The forward's token tables: the CTA's query rows' entries, "saw a key" flags and granule summaries, and a ring of a
// stage more than k's (attention_fwd.cuh says why), each a key tile's entries and its granules' summaries.
TE_JAX_HOST_DEVICE constexpr int ForwardTokenBytes(ForwardTile t) {
  return (16 + 4) * t.block_m + t.block_m / kTokenGranule * kTokenSummaryBytes +
         (t.stages + 1) * (8 * t.block_n + t.block_n / kTokenGranule * kTokenSummaryBytes);
}

// A stage of a bias ring (sm90/bias_tile.h): query rows x keys in the bias's element type.
TE_JAX_HOST_DEVICE constexpr int BiasTileBytes(int rows, int keys, int bias_bytes) {
  return rows * keys * bias_bytes;
}

// Buffers of the q tile: the persistent kernel loads a work's q into the second while the consumers still read the
// first (attention_fwd.cuh's PrefetchWork), and beside each buffer the word of the item whose q it holds.
TE_JAX_HOST_DEVICE constexpr int ForwardQBuffers(bool persistent) { return persistent ? 2 : 1; }

// bias_bytes: the element size of the bias of a kernel built with one (0 without); input_bytes: q's, k's and v's (1:
// FP8, whose head dims are whole 128-byte rows, ServesFp8Forward).
TE_JAX_HOST_DEVICE constexpr int ForwardSmemBytesFor(int d, int dv, ForwardTile t, bool tokens = false,
                                                     int bias_bytes = 0, bool persistent = false,
                                                     int input_bytes = 2) {
  const int q_buffers = ForwardQBuffers(persistent);
  return 1024 +  // slack to align the tiles to the swizzle atom
         q_buffers * t.block_m * PadTo64(d) * input_bytes +
         t.stages * t.block_n * (PadTo64(d) + PadTo64(dv)) * input_bytes +
         t.stages * BiasTileBytes(t.block_m, t.block_n, bias_bytes) + (tokens ? ForwardTokenBytes(t) : 0) +
         8 * (2 * q_buffers + 4 * t.stages) +  // mbarriers: q full, q empty per buffer; k full, k empty, v full, v
                                               // empty per stage
         (bias_bytes > 0 ? 8 * 2 * t.stages : 0) +  // and bias full, bias empty per stage
         (persistent ? 8 : 0);                      // the item word of each q buffer
}

// Two consumer warpgroups: 128 keys per stage when the output accumulator (dv / 2 floats per thread) leaves registers
// for 64 logits and the two stages fit (with the token tables or the bias ring of kernels built with them: d = 256,
// dv <= 64 fits only without tokens, and a float bias takes 64); else 64. Three (ForwardHasThreeConsumerKernel):
// FlashAttention-3's 192-row tile.
// FP8 (input_bytes 1): 128 keys a stage, V's stage being dv rows of 128 one-byte keys (attention_fwd.cuh).
TE_JAX_HOST_DEVICE constexpr ForwardTile ForwardTileSize(int d, int dv, bool tokens = false, int consumers = 2,
                                                        int bias_bytes = 0, int input_bytes = 2) {
  if (input_bytes == 1) return {128, 128, 2, 2};
  if (consumers == 3) return {192, 128, 2, 3};
  const ForwardTile wide{128, 128, 2, 2};
  if (PadTo64(dv) <= 128 && ForwardSmemBytesFor(d, dv, wide, tokens, bias_bytes) <= kMaxDynamicSmem) return wide;
  return {128, 64, 2, 2};
}

TE_JAX_HOST_DEVICE constexpr int ForwardSmemBytes(int d, int dv, bool tokens = false, int consumers = 2,
                                                  int bias_bytes = 0, bool persistent = false, int input_bytes = 2) {
  return ForwardSmemBytesFor(d, dv, ForwardTileSize(d, dv, tokens, consumers, bias_bytes, input_bytes), tokens,
                             bias_bytes, persistent, input_bytes);
}

// FP8 q, k and v (sm90 FP8 wgmma, attention_fwd.cuh): head dims of whole 128-byte rows (128 so far: at 256 the
// output accumulator and 128 keys' logits outgrow the consumers' registers), the plain product's kernel alone.
TE_JAX_HOST_DEVICE constexpr bool ServesFp8Forward(int d, int dv) { return d == 128 && dv == 128; }

// Where both head dims pad to 64 a tile's products are short against its softmax, and with two warpgroups the tensor
// cores wait for it: a forward module there also has a kernel of three consumer warpgroups, whose softmax runs under
// the two others' products (H200, d 64, b s = 16k: 0.84-0.92x cuDNN -> 0.94-1.11x at s >= 2k).
// Only for the plain product: with soft-cap or ALiBi (positions per element), dropout (keep bits) or tokens, the
// 160 registers per consumer thread spill in the loop; a bias keeps two consumer warpgroups too (a three-consumer
// kernel with a bias was never built or measured).
TE_JAX_HOST_DEVICE constexpr bool ForwardHasThreeConsumerKernel(int d, int dv, bool plain) {
  return plain && PadTo64(d) == 64 && PadTo64(dv) == 64;
}

// A forward module of the plain product also has a persistent kernel (attention_fwd.cuh's ForEachWork): one CTA per
// multiprocessor, each taking query blocks from a counter, so the next block's q and first k and v tiles load under
// this one's epilogue and no CTA is launched, set up and drained per block.
// Only the plain product up to head dims of 128: the variants' modules keep one kernel each (NVRTC time), and above 128
// the consumers' 232 registers spill (d 256: 59 spill instructions; and it runs at 0.89-0.95x cuDNN at s 512-2k without).
TE_JAX_HOST_DEVICE constexpr bool ForwardHasPersistentKernel(int d, int dv, bool plain) {
  return plain && PadTo64(d) <= 128 && PadTo64(dv) <= 128;
}

// Which calls take it (H200, bf16, b s = 16k, te / cuDNN forward, one CTA per block -> persistent):
// beside a first kernel of two consumer warpgroups (d 128), every call (s 512: 0.80 -> 0.86, 2k: 0.90
// -> 0.95, causal 0.93 -> 1.01; at 16k causal, now that the CTAs take blocks from a counter, 1.06 -> 1.11). Where the
// first kernel has three (d 64), those run long blocks faster than the persistent kernel's two: it takes non-causal
// calls of at most 8 key tiles and causal ones of at most 16 (s 512: 0.73 -> 0.81, causal 0.61 -> 0.76; 1k: 0.84 ->
// 0.86, causal 0.68 -> 0.81; 2k causal 0.83 -> 0.87, but non-causal 0.96 -> 0.88; 16k causal 1.06 -> 0.95).
inline constexpr int kPersistentMaxKeyTilesBesideThreeConsumers = 8;
inline constexpr int kPersistentMaxCausalKeyTilesBesideThreeConsumers = 16;
TE_JAX_HOST_DEVICE constexpr bool ForwardPrefersPersistentKernel(bool three_consumer_module, int key_tiles,
                                                                bool causal) {
  if (!three_consumer_module) return true;
  return key_tiles <= (causal ? kPersistentMaxCausalKeyTilesBesideThreeConsumers
                              : kPersistentMaxKeyTilesBesideThreeConsumers);
}

// Head dims the family serves (TMA needs 16-byte rows strides: multiples of 8 elements), where the tiles fit in shared
// memory with the token tables or the bias ring of a kernel built with them (a float bias at d = 256 does not).
TE_JAX_HOST_DEVICE constexpr bool ServesForward(int d, int dv, bool tokens = false, int bias_bytes = 0) {
  return d % 8 == 0 && dv % 8 == 0 && d >= 8 && dv >= 8 && d <= 256 && dv <= 256 &&
         ForwardSmemBytes(d, dv, tokens, 2, bias_bytes) <= kMaxDynamicSmem;
}

// The backward's two kernels (attention_bwd.cuh) share one shape: a CTA owns rows (keys for dk/dv, queries for dq)
// held in shared memory, two consumer warpgroups work on them, and it steps over tiles of rows of the other side
// through a two-stage ring. How the warpgroups share the work follows the register budget of the accumulators (dk and
// dv, or dq: 64 rows x their columns each):
//  - up to 128 columns each, the CTA owns 128 rows, 64 per warpgroup, and a warpgroup's accumulators take every column
//    (64 x d / 128 floats per thread each);
//  - above (d or dv padding to 192 or 256), the CTA owns 64 rows and the warpgroups split columns: each computes the
//    scores of half the step's rows against all 64, and half of each accumulator's columns, from the step's p^T and
//    ds^T, which pass through shared memory (FlashAttention-3's layout for these head dims).
inline constexpr int kBackwardThreads = 384;
inline constexpr int kBackwardStages = 2;
inline constexpr int kBackwardBoxRows = 64;  // the rows of one TMA box of the backward's tensor maps

TE_JAX_HOST_DEVICE constexpr bool BackwardSplitsColumns(int d, int dv) { return PadTo64(d) > 128 || PadTo64(dv) > 128; }
TE_JAX_HOST_DEVICE constexpr int BackwardOwnedRows(int d, int dv) { return BackwardSplitsColumns(d, dv) ? 64 : 128; }

// Rows per step: 128 where both head dims pad to 64, 64 elsewhere. At d = 64 a 64-row step gives each warpgroup
// 64 x 64 x 64 products, short against the elementwise work and the barriers between them: on an H200, forward +
// backward 0.79-0.90x cuDNN with 64-row steps, 0.85-0.98x with 128; above d = 64 the step's
// scores and their gradients (2 x 64 floats per thread at 128 rows) no longer fit beside the accumulators. Tokens keep
// 64 (a step is one granule of the token summaries), as do dropout (32 keep bits per thread and step) and a bias
// (whose 128 x 128 ring stages do not fit beside the d = 64 tiles).
TE_JAX_HOST_DEVICE constexpr int BackwardStepRows(int d, int dv, bool tokens, bool dropout, bool bias = false) {
  return PadTo64(d) == 64 && PadTo64(dv) == 64 && !tokens && !dropout && !bias ? 128 : 64;
}

// The backward's token tables: the owned rows' entries and granule summaries, and per stage the step rows' entries
// and granule summary (a step with tokens is one granule). An entry takes 16 bytes (a query's; a key's takes 8 of them).
TE_JAX_HOST_DEVICE constexpr int BackwardTokenBytes(int owned) {
  return 16 * owned + owned / kTokenGranule * kTokenSummaryBytes +
         kBackwardStages * (16 * kTokenGranule + kTokenSummaryBytes);
}

// The backward's kernels: dk/dv, which by default also adds each step's ds k to a float dq accumulator
// (attention_bwd.cuh) and then keeps the step's ds^T and the float dq block in shared memory too; and the dq kernel of
// the deterministic scheme.
enum class BackwardKernelKind { kDkDvAccumulatingDq, kDkDv, kDq };

// bias_bytes: the element size of the bias of a kernel built with one (0 without); its ring's stages hold the step's
// [rows][owned rows] block of it.
TE_JAX_HOST_DEVICE constexpr int BackwardSmemBytes(int d, int dv, BackwardKernelKind kind, bool tokens, bool dropout,
                                                   int bias_bytes = 0) {
  const int step = BackwardStepRows(d, dv, tokens, dropout, bias_bytes > 0);
  const int owned = BackwardOwnedRows(d, dv);
  const bool accumulate_dq = kind == BackwardKernelKind::kDkDvAccumulatingDq;
  const bool splits = BackwardSplitsColumns(d, dv);
  // The step's [owned][step] tiles in shared memory: ds^T (or ds) to accumulate dq or with split columns, and p^T
  // with split columns in the dk/dv kernel.
  const int step_tiles = (accumulate_dq || splits ? 1 : 0) + (splits && kind != BackwardKernelKind::kDq ? 1 : 0);
  return 1024 + (owned + kBackwardStages * step) * (PadTo64(d) + PadTo64(dv)) * 2 +
         kBackwardStages * BiasTileBytes(step, owned, bias_bytes) +
         kBackwardStages * step * 2 * 4 +  // each stage's rows' lse and delta' (dk/dv)
         step_tiles * owned * step * 2 + (accumulate_dq ? step * PadTo64(d) * 4 : 0) +
         (tokens ? BackwardTokenBytes(owned) : 0) +
         8 * (1 + 2 * kBackwardStages);  // mbarriers: owned tiles full; each stage full and empty
}

// The dk/dv kernels of a score_mod: shared memory past the kernel's own in which a CTA's additions to its captures'
// gradients add up before they go to memory (kernels/common/kernel_mods.h): 16 KB of them (a relative-position table
// of 16 heads x 256 distances) and a pointer per capture where the kernel leaves that much, else what it leaves in
// whole KB, none below 4 KB.
TE_JAX_HOST_DEVICE constexpr int CaptureGradientScratchBytes(int smem_bytes) {
  const int room = kMaxDynamicSmem - smem_bytes, full = 16384 + 8 * kMaxKernelCaptures;
  return room >= full ? full : room >= 4096 ? room / 1024 * 1024 : 0;
}

TE_JAX_HOST_DEVICE constexpr int BackwardCaptureScratchBytes(int d, int dv, BackwardKernelKind kind, bool tokens,
                                                             bool dropout, int bias_bytes = 0) {
  return CaptureGradientScratchBytes(BackwardSmemBytes(d, dv, kind, tokens, dropout, bias_bytes));
}

// With split columns the default scheme's dq block (64 x d floats) does not fit beside the ring: those head dims take
// the deterministic scheme, which the sm80 tuning picks for d + dv > 256 (rounded up to 16); the default scheme of the
// rest (e.g. d 192, dv 64) stays on the sm80 family, as do the kernels whose bias ring does not fit (a float bias
// beside the default scheme's dq block).
TE_JAX_HOST_DEVICE constexpr bool ServesBackward(int d, int dv, bool accumulate_dq, bool tokens = false,
                                                 bool dropout = false, int bias_bytes = 0) {
  using Kind = BackwardKernelKind;
  const auto smem = [&](Kind kind) { return BackwardSmemBytes(d, dv, kind, tokens, dropout, bias_bytes); };
  const bool fits = accumulate_dq ? smem(Kind::kDkDvAccumulatingDq) <= kMaxDynamicSmem
                                  : smem(Kind::kDkDv) <= kMaxDynamicSmem && smem(Kind::kDq) <= kMaxDynamicSmem;
  return ServesForward(d, dv) && !(accumulate_dq && BackwardSplitsColumns(d, dv)) && fits;
}

}  // namespace te_jax::cuda::sm90
