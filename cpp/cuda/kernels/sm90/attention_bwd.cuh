// Backward flash attention, sm90 family (sm_90a), after the row kernels' preprocess (common/backward_row_kernels.cuh).
// One template, two kernels: dk/dv (kOwnsKeys) owns a block of keys of a kv head and steps over the query tiles of its
// GQA group that see them, by default also adding each step's dq block to the float accumulator (kAccumulateDq, one
// bulk reduction a step: dq's last bits vary between runs); dq (deterministic) owns a block of queries and steps over
// their key tiles, writing each row once. The forward's machinery: a producer thread's TMA copies into a two-stage
// ring, two consumer warpgroups on wgmma, which split rows up to 128 columns and columns above (tile_size.h). Packed
// sequences, dropout and the bias (its gradient through common/bias_grad.h): docs/ARCHITECTURE.md, "The sm90 backward".
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/bias_grad.h"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/dq_accum.h"
#include "cpp/cuda/kernels/common/dropout.h"
#include "cpp/cuda/kernels/common/probability_grad.h"
#include "cpp/cuda/kernels/common/token_mask.h"
#include "cpp/cuda/kernels/primitives/bulk_reduce.h"
#include "cpp/cuda/kernels/primitives/fragment.h"
#include "cpp/cuda/kernels/primitives/pipeline.h"
#include "cpp/cuda/kernels/primitives/swizzled_tile.h"
#include "cpp/cuda/kernels/primitives/wgmma.h"
#include "cpp/cuda/kernels/sm90/bias_tile.h"
#include "cpp/cuda/kernels/sm90/tile_size.h"

namespace te_jax::cuda::sm90 {

// Named barrier 1 over the two consumer warpgroups (never met by __syncthreads, which is barrier 0).
__device__ __forceinline__ void ConsumersSync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// kOwnsKeys: the dk/dv kernel (owned rows are keys, steps are query tiles); else the dq kernel (the other way round).
// Operand 0 of a side is its [rows][d] tensor (k or q), operand 1 its [rows][dv] tensor (v or dout). kAccumulateDq:
// the dk/dv kernel also adds dq to the accumulator. kDocuments: the dk/dv kernel of a packed row read as documents
// (kernels/common/document_tables.cuh): CTA (work, kv head) owns the work's block of keys of one document, which only
// that document's rows see; its grid is (DocumentWorksOfGrid works, kv heads), the CTAs past the table's works return.
template <typename Element, int kD, int kDv, typename Variant, bool kOwnsKeys, bool kAccumulateDq = false,
          bool kDocuments = false>
struct BackwardKernel {
  static constexpr bool kBias = Variant::kHasBias;
  static constexpr int kBiasBytes = Variant::Bias::kBytes;
  static constexpr int kOwned = BackwardOwnedRows(kD, kDv);
  static constexpr int kStep = BackwardStepRows(kD, kDv, Variant::kHasTokens, Variant::kHasDropout, kBias);
  static constexpr int kStages = kBackwardStages;
  static constexpr int kThreads = kBackwardThreads;
  static constexpr int kDP = PadTo64(kD);
  static constexpr int kDvP = PadTo64(kDv);
  // A warpgroup's share of a step: its owned rows (64 of them) against kScoreCols of the step's rows, and kAcc0Cols /
  // kAcc1Cols columns of the [rows][d] / [rows][dv] accumulators, from column Acc0Col0 / Acc1Col0.
  static constexpr bool kSplitsColumns = BackwardSplitsColumns(kD, kDv);
  static constexpr int kScoreCols = kSplitsColumns ? kStep / 2 : kStep;
  static constexpr int kAcc0Cols = kSplitsColumns ? kDP / 2 : kDP;
  static constexpr int kAcc1Cols = kSplitsColumns ? kDvP / 2 : kDvP;
  static __device__ __forceinline__ int OwnedRow0(int wg) { return kSplitsColumns ? 0 : 64 * wg; }
  static __device__ __forceinline__ int ScoreCol0(int wg) { return kSplitsColumns ? wg * kScoreCols : 0; }
  static __device__ __forceinline__ int Acc0Col0(int wg) { return kSplitsColumns ? wg * kAcc0Cols : 0; }
  static __device__ __forceinline__ int Acc1Col0(int wg) { return kSplitsColumns ? wg * kAcc1Cols : 0; }
  // n of each product into an accumulator: the widest of 128, 64, 32 that divides its columns.
  static constexpr int ProductN(int cols) { return cols % 128 == 0 ? 128 : cols % 64 == 0 ? 64 : 32; }
  static constexpr int kN0 = ProductN(kAcc0Cols);
  static constexpr int kN1 = ProductN(kAcc1Cols);
  using Owned0 = SwizzledTile<kOwned, kDP>;
  using Owned1 = SwizzledTile<kOwned, kDvP>;
  using Step0 = SwizzledTile<kStep, kDP>;
  using Step1 = SwizzledTile<kStep, kDvP>;
  static constexpr int kOwned1Offset = Owned0::kBytes;
  static constexpr int kStep0Offset = kOwned1Offset + Owned1::kBytes;
  static constexpr int kStep1Offset = kStep0Offset + kStages * Step0::kBytes;
  // A bias: per stage the step's [queries][keys] block, after the step tiles' ring.
  using BiasStage = BiasTile<typename Variant::Bias, kOwnsKeys ? kStep : kOwned, kOwnsKeys ? kOwned : kStep>;
  static constexpr int kBiasOffset = kStep1Offset + kStages * Step1::kBytes;
  static constexpr int kStatsOffset = kBiasOffset + (kBias ? kStages * BiasStage::kBytes : 0);
  // The step's [owned rows][step rows] tiles in shared memory: ds^T (ds in the dq kernel) with kAccumulateDq or split
  // columns, p^T with split columns in the dk/dv kernel; then with kAccumulateDq the step's float dq block (the
  // accumulator's layout).
  using StepTile = SwizzledTile<kOwned, kStep>;
  static constexpr bool kDsInSmem = kAccumulateDq || kSplitsColumns;
  static constexpr bool kPInSmem = kSplitsColumns && kOwnsKeys;
  using Accum = DqAccum<kD, kDv>;
  // The step's dq block [kStep][d] split between the consumer warpgroups: by columns (64-row steps), or by rows
  // (128-row steps, whose d is 64: each warpgroup a 64 x 64 product).
  static constexpr bool kDqSplitsRows = kStep == 128;
  static constexpr int kDqN = kDqSplitsRows ? kDP : kDP / 2;  // dq columns per consumer warpgroup
  // The first row and column of warpgroup wg's part of the block.
  static __device__ __forceinline__ int DqRow0(int wg) { return kDqSplitsRows ? 64 * wg : 0; }
  static __device__ __forceinline__ int DqCol0(int wg) { return kDqSplitsRows ? 0 : wg * kDqN; }
  static constexpr int kDsOffset = kStatsOffset + kStages * 2 * kStep * 4;
  static constexpr int kPOffset = kDsOffset + (kDsInSmem ? StepTile::kBytes : 0);
  static constexpr int kDqOffset = kPOffset + (kPInSmem ? StepTile::kBytes : 0);
  // Tokens: the owned rows' entries and granule summaries, which land with the owned tiles, then per stage the step
  // rows' entries and granule summary, which land with the step's tiles (an entry: a query's 16 bytes, a key's 8, in a
  // 16-byte slot). The consumers read the entries where a step needs them (held in registers, the owned rows' made the
  // kernels spill, as in the forward).
  static constexpr bool kTokens = Variant::kHasTokens;
  static constexpr bool kDropout = Variant::kHasDropout;
  static constexpr int kStepTokenBytes = 16 * kStep + kTokenSummaryBytes;
  static constexpr int kTokensOffset = kDqOffset + (kAccumulateDq ? kStep * kDP * 4 : 0);
  static constexpr int kOwnedSummariesOffset = kTokensOffset + 16 * kOwned;
  static constexpr int kStepTokensOffset = kOwnedSummariesOffset + kOwned / kTokenGranule * kTokenSummaryBytes;
  static constexpr int kBarrierOffset = kTokensOffset + (kTokens ? BackwardTokenBytes(kOwned) : 0);
  static constexpr int kSmemBytes = 1024 + kBarrierOffset + 8 * (1 + 2 * kStages);
  static constexpr int kStatsWarp = 1;  // of the producer warpgroup: copies each step's lse and delta' (dk/dv)
  static constexpr BackwardKernelKind kKind = kAccumulateDq ? BackwardKernelKind::kDkDvAccumulatingDq
                                              : kOwnsKeys   ? BackwardKernelKind::kDkDv
                                                            : BackwardKernelKind::kDq;
  static_assert(kSmemBytes == BackwardSmemBytes(kD, kDv, kKind, kTokens, kDropout, kBiasBytes),
                "tile_size.h and the kernel disagree on shared memory");
  static_assert(kSmemBytes <= kMaxDynamicSmem, "the kernel's tiles fit in shared memory");
  // A score_mod's dk/dv kernel: its capture gradients' scratch past the rest (the launch adds it to the shared memory).
  static constexpr bool kGradientScratch = kOwnsKeys && Variant::kHasScoreMod;
  static_assert(!kTokens || kStepTokensOffset + kStages * kStepTokenBytes == kBarrierOffset,
                "tile_size.h and the kernel disagree on the token tables");
  static_assert(!kTokens || kStep == kTokenGranule, "a step's rows are one granule of tokens");
  static_assert(!kAccumulateDq || kOwnsKeys, "only the dk/dv kernel accumulates dq");
  static_assert(!kDocuments || (kOwnsKeys && kAccumulateDq && !kTokens && !kBias && !kDropout),
                "the document kernel is the plain product's dk/dv kernel accumulating dq");
  static_assert(!kAccumulateDq || (Accum::kLayout.slices == 1 && Accum::kLayout.row_block % kStep == 0 &&
                                   Accum::kLayout.cols <= kDP && !kSplitsColumns),
                "a step's dq block is one contiguous block of the accumulator, beside the ring");
  static_assert(kDsOffset % 1024 == 0 && kPOffset % 1024 == 0, "the step tiles start on swizzle atoms");
  static_assert(kOwned == (kSplitsColumns ? 64 : 2 * 64) && (kStep == 64 || kStep == 128) && kThreads == 3 * 128,
                "a producer and two consumer warpgroups");
  static_assert(!kSplitsColumns || (kStep == 64 && kScoreCols % 32 == 0 && kAcc0Cols % 32 == 0 && kAcc1Cols % 32 == 0),
                "split columns: each warpgroup's scores and accumulator columns are whole 32-wide products");
  static_assert(!kDqSplitsRows || kDP == 64, "a warpgroup's half of a 128-row dq block takes every column");
  static constexpr int kTensorMapBoxRows = kBackwardBoxRows;  // tensor_maps.h

  struct Smem {
    uint32_t base;
    float* stats;  // generic address of kStatsOffset: per stage, the step rows' lse then their delta'
    __device__ __forceinline__ float* Lse(int stage) const { return stats + stage * 2 * kStep; }
    __device__ __forceinline__ float* Delta(int stage) const { return Lse(stage) + kStep; }
    __device__ __forceinline__ Owned0 Own0() const { return {base}; }
    __device__ __forceinline__ Owned1 Own1() const { return {base + kOwned1Offset}; }
    __device__ __forceinline__ Step0 Stp0(int stage) const { return {base + kStep0Offset + stage * Step0::kBytes}; }
    __device__ __forceinline__ Step1 Stp1(int stage) const { return {base + kStep1Offset + stage * Step1::kBytes}; }
    __device__ __forceinline__ BiasStage Bias(int stage) const {
      return {base + kBiasOffset + stage * BiasStage::kBytes};
    }
    __device__ __forceinline__ StepTile Ds() const { return {base + kDsOffset}; }
    __device__ __forceinline__ float** GradientScratch() const {
      return reinterpret_cast<float**>(reinterpret_cast<char*>(stats) - kStatsOffset + kSmemBytes - 1024);
    }
    __device__ __forceinline__ StepTile P() const { return {base + kPOffset}; }
    __device__ __forceinline__ uint32_t DqBlock() const { return base + kDqOffset; }
    __device__ __forceinline__ uint32_t OwnedFull() const { return base + kBarrierOffset; }
    __device__ __forceinline__ uint32_t Full(int stage) const { return OwnedFull() + 8 * (1 + stage); }
    __device__ __forceinline__ uint32_t Empty(int stage) const { return OwnedFull() + 8 * (1 + kStages + stage); }
    // Tokens: the owned rows' entries and granule summaries; per stage the step rows' entries, then the step's summary.
    __device__ __forceinline__ uint32_t OwnedTokens() const { return base + kTokensOffset; }
    __device__ __forceinline__ uint32_t OwnedSummaries() const { return base + kOwnedSummariesOffset; }
    __device__ __forceinline__ uint32_t StepTokens(int stage) const {
      return base + kStepTokensOffset + stage * kStepTokenBytes;
    }
    __device__ __forceinline__ uint32_t StepSummary(int stage) const { return StepTokens(stage) + 16 * kStep; }
  };

  // What a CTA owns and where its steps go. Owned rows [owned0, owned0 + 128) of (batch b, head owned_head); step i
  // covers rows [StepRow0(i), + kStep) of head StepHead(i) on the other side.
  struct Work {
    int b;
    int owned_head;  // kv head (dk/dv) or query head (dq)
    int owned0;
    int group;       // query heads per kv head
    int tile_begin;  // the first step tile
    int tiles;       // step tiles per head
    int steps;       // dk/dv: tiles x group (head-major); dq: tiles
    BatchLengths len;
    RowMask mask;

    __device__ __forceinline__ int StepHead(int i) const {
      return kOwnsKeys ? owned_head * group + i / tiles : owned_head / group;
    }
    __device__ __forceinline__ int StepRow0(int i) const { return (tile_begin + (kOwnsKeys ? i % tiles : i)) * kStep; }
    __device__ __forceinline__ int QueryHead(int i) const { return kOwnsKeys ? StepHead(i) : owned_head; }
    // Whether some (query, key) pair of step i is hidden by the mask, so the step needs the per-element mask.
    __device__ __forceinline__ bool StepMasked(int i) const {
      const int q0 = kOwnsKeys ? StepRow0(i) : owned0, k0 = kOwnsKeys ? owned0 : StepRow0(i);
      return !KeysOfRows(mask, q0, kOwnsKeys ? kStep : kOwned).Unmasked(k0, kOwnsKeys ? kOwned : kStep);
    }
  };

  // A block mask: a work's step tiles narrowed to those its blocks may show for some query head it takes
  // (KernelMods::NarrowTiles; every thread).
  static __device__ __forceinline__ void NarrowToBlockMask(const typename Variant::Mods& mods, Work& w) {
    int begin = w.tile_begin, end = w.tile_begin + w.tiles;
    const int h0 = kOwnsKeys ? w.owned_head * w.group : w.owned_head;
    mods.template NarrowTiles<kStep, kOwnsKeys>(mods.Batch(w.b), h0, h0 + (kOwnsKeys ? w.group : 1), w.owned0,
                                                w.owned0 + kOwned, begin, end);
    w.tile_begin = begin;
    w.tiles = end - begin;
    w.steps = kOwnsKeys ? w.tiles * w.group : w.tiles;
  }

  static __device__ __forceinline__ Work WorkOf(const ShapeArgs& s, const BackwardArgs& args) {
    Work w;
    w.group = s.num_heads / s.num_kv_heads;
    if constexpr (kDocuments) {
      // The works longest first within each kv head, a head's works together so that they share its query rows in L2
      // (Run has returned past the table's works).
      const int4 entry =
          reinterpret_cast<const int4*>(args.tokens.documents + kDocumentTableHeaderInts)[blockIdx.x];
      const QueryBlockOfCta c = DocumentBlockOf<kOwned, kStep>(s, args.tokens, entry, 0);
      w.owned0 = entry.y;
      w.owned_head = static_cast<int>(blockIdx.y);
      w.b = entry.x;
      w.len = c.len;
      w.mask = c.mask;
      const RowSpan rows = RowsOfKeys(w.mask, w.owned0, w.owned0 + kOwned);
      w.tile_begin = rows.begin / kStep;
      w.tiles = rows.end > rows.begin ? (rows.end + kStep - 1) / kStep - w.tile_begin : 0;
      w.steps = w.tiles * w.group;
    } else if constexpr (kOwnsKeys) {
      // The grid is (key blocks, kv heads, batch), or with a bias (batch, key blocks, kv heads): the batch entries of a
      // key block run side by side, so their float atomics into a dbias accumulator summed over the batch meet in L2
      // rather than in memory (the launcher's grid follows kBias).
      if constexpr (kBias) {
        w.owned0 = blockIdx.y * kOwned;
        w.owned_head = blockIdx.z;
        w.b = blockIdx.x;
      } else {
        w.owned0 = blockIdx.x * kOwned;
        w.owned_head = blockIdx.y;
        w.b = blockIdx.z;
      }
      w.len = ReadLengths(s, args.q_seqlens, args.kv_seqlens, w.b);
      w.mask = MakeMask(s, w.len);
      const RowSpan rows = RowsOfKeys(w.mask, w.owned0, w.owned0 + kOwned);
      w.tile_begin = rows.begin / kStep;
      w.tiles = rows.end > rows.begin ? (rows.end + kStep - 1) / kStep - w.tile_begin : 0;
      if constexpr (kTokens) {
        // Only the query tiles the keys' tokens may meet.
        int tile_end = w.tile_begin + w.tiles;
        NarrowToTokenSpan(TokenTileSpan<kStep>(BatchTokens::Of(args.tokens, s, w.b).kv_span, w.owned0, kOwned,
                                               s.seqlen_kv),
                          w.tile_begin, tile_end);
        w.tiles = tile_end - w.tile_begin;
      }
      w.steps = w.tiles * w.group;
    } else {
      // The last query blocks see the most keys under causal masks: they start first so the tail of the grid is short.
      QueryBlockOfCta cta = QueryBlockOf<kOwned, kStep>(s, args.q_seqlens, args.kv_seqlens,
                                                        static_cast<int>(gridDim.x - 1 - blockIdx.x));
      if constexpr (kTokens) {
        // Only the key tiles the rows' tokens may meet.
        const BatchTokens tokens = BatchTokens::Of(args.tokens, s, cta.b);
        NarrowToTokenSpan(TokenTileSpan<kStep>(tokens.q_span, cta.m0, kOwned, s.seqlen_q), cta.tile_begin,
                          cta.tile_end);
      }
      w.owned0 = cta.m0;
      w.owned_head = cta.head;
      w.b = cta.b;
      w.len = cta.len;
      w.mask = cta.mask;
      w.tile_begin = cta.tile_begin;
      w.tiles = cta.tile_end > cta.tile_begin ? cta.tile_end - cta.tile_begin : 0;
      w.steps = w.tiles;
    }
    return w;
  }

  // The producer thread: the owned tiles, then each step's two tiles into the ring. With tokens, the owned rows'
  // entries and granule summaries come with the owned tiles, and each step's rows' entries and granule summary with
  // its tiles (query rows past Sq are not copied: the index range hides every key from them; keys are copied in whole
  // granules, the keys table's padding filling the last).
  static __device__ __forceinline__ void Produce(const TmaBackwardArgs& a, const Smem& sm, const Work& w) {
    const TensorMap* own0 = kOwnsKeys ? &a.k : &a.q;
    const TensorMap* own1 = kOwnsKeys ? &a.v : &a.dout;
    const TensorMap* step0 = kOwnsKeys ? &a.q : &a.k;
    const TensorMap* step1 = kOwnsKeys ? &a.dout : &a.v;
    const ShapeArgs& s = a.args.shape;
    const int owned_len = kOwnsKeys ? s.seqlen_kv : s.seqlen_q;
    const int owned_granules = kTokens ? TokenGranuleEnd(w.owned0, kOwned, owned_len) - w.owned0 / kTokenGranule : 0;
    const int owned_entry_bytes = !kTokens ? 0
                                  : kOwnsKeys ? 8 * kTokenGranule * owned_granules
                                              : 16 * min(kOwned, s.seqlen_q - w.owned0);
    LoadTile<kTensorMapBoxRows>(sm.Own0(), own0, sm.OwnedFull(), w.owned_head, w.owned0, w.b,
                                owned_entry_bytes + owned_granules * kTokenSummaryBytes);
    if constexpr (kTokens) {
      const BatchTokens tokens = BatchTokens::Of(a.args.tokens, s, w.b);
      const void* entries = kOwnsKeys ? static_cast<const void*>(tokens.keys + w.owned0) : tokens.q_rows + w.owned0;
      BulkLoad(sm.OwnedTokens(), entries, owned_entry_bytes, sm.OwnedFull());
      BulkLoad(sm.OwnedSummaries(),
               (kOwnsKeys ? tokens.kv_summary : tokens.q_summary) + w.owned0 / kTokenGranule * kTokenSummaryInts,
               owned_granules * kTokenSummaryBytes, sm.OwnedFull());
    }
    LoadTile<kTensorMapBoxRows>(sm.Own1(), own1, sm.OwnedFull(), w.owned_head, w.owned0, w.b);
    for (int i = 0; i < w.steps; ++i) {
      const int stage = StageOf<kStages>(i);
      MbarrierWait(sm.Empty(stage), ParityOf<kStages>(i) ^ 1u);
      const int entry_bytes = !kTokens ? 0 : kOwnsKeys ? 16 * min(kStep, s.seqlen_q - w.StepRow0(i)) : 8 * kStep;
      LoadTile<kTensorMapBoxRows>(sm.Stp0(stage), step0, sm.Full(stage), w.StepHead(i), w.StepRow0(i), w.b,
                                  kTokens ? entry_bytes + kTokenSummaryBytes : 0);
      if constexpr (kTokens) {
        // The tables' addresses from the parameters at each use: held through the loop, they made the producer spill.
        const BatchTokens tokens = BatchTokens::Of(a.args.tokens, s, w.b);
        const int row0 = w.StepRow0(i);
        const void* entries = kOwnsKeys ? static_cast<const void*>(tokens.q_rows + row0) : tokens.keys + row0;
        BulkLoad(sm.StepTokens(stage), entries, entry_bytes, sm.Full(stage));
        BulkLoad(sm.StepSummary(stage),
                 (kOwnsKeys ? tokens.q_summary : tokens.kv_summary) + row0 / kTokenGranule * kTokenSummaryInts,
                 kTokenSummaryBytes, sm.Full(stage));
      }
      LoadTile<kTensorMapBoxRows>(sm.Stp1(stage), step1, sm.Full(stage), w.StepHead(i), w.StepRow0(i), w.b);
      if constexpr (kBias) {
        const int queries0 = kOwnsKeys ? w.StepRow0(i) : w.owned0, keys0 = kOwnsKeys ? w.owned0 : w.StepRow0(i);
        sm.Bias(stage).template Load<kTensorMapBoxRows>(
            &a.bias, sm.Full(stage), BiasBoxes::Of(a.args.bias, s.num_heads, w.b, w.QueryHead(i), queries0), keys0);
      }
    }
  }

  // The dk/dv kernel's stats warp: each step's query rows' lse and delta' into the stage, with plain loads (the rows
  // past Sq get zeros, never read); its 32 arrivals on the stage's full barrier publish them.
  static __device__ __forceinline__ void ProduceStats(const BackwardArgs& args, const Smem& sm, const Work& w,
                                                      int lane) {
    const ShapeArgs& s = args.shape;
    for (int i = 0; i < w.steps; ++i) {
      const int stage = StageOf<kStages>(i);
      MbarrierWait(sm.Empty(stage), ParityOf<kStages>(i) ^ 1u);
      const int64_t base = (static_cast<int64_t>(w.b) * s.num_heads + w.QueryHead(i)) * s.seqlen_q;
#pragma unroll
      for (int c = lane; c < kStep; c += 32) {
        const int q = w.StepRow0(i) + c;
        sm.Lse(stage)[c] = q < s.seqlen_q ? args.lse[base + q] : 0.0f;
        sm.Delta(stage)[c] = q < s.seqlen_q ? args.delta_scratch[base + q] : 0.0f;
      }
      MbarrierArrive(sm.Full(stage));
    }
  }

  static __device__ __forceinline__ void Run(const TmaBackwardArgs& a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const uint32_t base = (SmemAddress(smem_raw) + 1023u) & ~1023u;
    const Smem sm{base, reinterpret_cast<float*>(smem_raw + (base - SmemAddress(smem_raw)) + kStatsOffset)};
    const BackwardArgs& args = a.args;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, warpgroup = warp >> 2;
    // A packed row: the document kernel serves it where the table says the reading holds (its CTAs past the table's
    // works return), else the token kernel.
    if constexpr (kDocuments) {
      if (!ReadAsDocuments(args.tokens) || static_cast<int>(blockIdx.x) >= args.tokens.documents[1]) return;
    } else if constexpr (kTokens) {
      if (ReadAsDocuments(args.tokens)) return;
    }
    if (tid == 0) {
      PrefetchTensorMap(&a.q);
      PrefetchTensorMap(&a.k);
      PrefetchTensorMap(&a.v);
      PrefetchTensorMap(&a.dout);
      if constexpr (kBias) PrefetchTensorMap(&a.bias);
      MbarrierInit(sm.OwnedFull(), 2);
      for (int st = 0; st < kStages; ++st) {
        // The copies' arrivals (the two tiles', the bias's), and the stats warp's.
        MbarrierInit(sm.Full(st), 2 + (kBias ? 1 : 0) + (kOwnsKeys ? 32 : 0));
        // Every consumer thread arrives: the stats warp overwrites the stage's lse and delta' with plain stores, and
        // each thread's own arrival orders its reads of them before those stores.
        MbarrierInit(sm.Empty(st), 256);
      }
      FenceMbarrierInit();
    }
    __syncthreads();
    Work w = WorkOf(args.shape, args);
    typename Variant::Mods mods{};
    if constexpr (Variant::kHasMods) mods = Variant::Mods::Of(a);
    if constexpr (Variant::kHasMaskMod) NarrowToBlockMask(mods, w);
    if (warpgroup == 0) {
      DecreaseRegisters<24>();
      if (warp == 0 && lane == 0 && w.steps > 0) Produce(a, sm, w);
      if (kOwnsKeys && warp == kStatsWarp) ProduceStats(args, sm, w, lane);
    } else {
      IncreaseRegisters<240>();
      Consume(args, mods, sm, w, warpgroup - 1, warp & 3, lane);
    }
  }

  // A fragments of an [owned rows][step rows] matrix (p^T or ds^T in the dk/dv kernel, ds in the dq kernel) into a
  // shared step tile, at this thread's rows row and row + 8, from column col0.
  static __device__ __forceinline__ void StoreStepTile(StepTile tile, const uint32_t (&a)[kScoreCols / 16][4], int row,
                                                       int col0, int t) {
#pragma unroll
    for (int kk = 0; kk < kScoreCols / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint32_t at = tile.Address(row + 8 * (r & 1), col0 + 16 * kk + 8 * (r >> 1) + 2 * t);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(a[kk][r]) : "memory");
      }
  }

  // This warpgroup's part of the step's dq block (its thread's rows query_row and query_row + 8 of it) into the shared
  // copy, laid out as the accumulator (common/dq_accum.h); columns past its width are padding.
  static __device__ __forceinline__ void StoreDqBlock(const Smem& sm, const float (&dq)[kDqN / 2], int wg,
                                                      int query_row, int t) {
    constexpr int kCols = Accum::kLayout.cols;
#pragma unroll
    for (int j = 0; j < kDqN / 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = DqRow0(wg) + query_row + 8 * r, col = DqCol0(wg) + 8 * j + 2 * t;
        if (col < kCols) {
          const uint32_t at = sm.DqBlock() + 4 * (row * kCols + Accum::Column(row, col));
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(dq[4 * j + 2 * r]), "f"(dq[4 * j + 2 * r + 1])
                       : "memory");
        }
      }
  }

  // One k16 step of acc (kCols columns of an accumulator, from col0) += A B: A the step's [owned][step] operand (p^T,
  // ds^T or ds), from registers, or with split columns from its shared step tile; B the step tile's k16 block kk.
  template <int kCols, int kN, typename Tile>
  static __device__ __forceinline__ void AccumulateK16(float (&acc)[kCols / 8][4],
                                                       const uint32_t (&a)[kScoreCols / 16][4], StepTile a_tile,
                                                       Tile b_tile, int col0, int kk) {
#pragma unroll
    for (int n = 0; n < kCols / kN; ++n) {
      float(&part)[kN / 2] = reinterpret_cast<float(&)[kN / 2]>(acc[n * kN / 8]);
      const uint64_t b = b_tile.MNMajor(kk, col0 + n * kN);
      if constexpr (kSplitsColumns) {
        Wgmma<Element, kN>::SSMNB(part, a_tile.KMajor(0, kk), b, 1);
      } else {
        Wgmma<Element, kN>::RS(part, a[kk], b);
      }
    }
  }

  static __device__ __forceinline__ void Consume(const BackwardArgs& args, const typename Variant::Mods& mods,
                                                 const Smem& sm, const Work& w, int wg,
                                                 int warp_in_wg, int lane) {
    const ShapeArgs& s = args.shape;
    const int g = lane >> 2, t = lane & 3;
    // The warpgroup's first owned row, and the first of the step's rows it scores. Both are the same in every thread of
    // the warpgroup, but the compiler cannot tell from the thread index; read from one lane they are, and the matrix
    // descriptors built from them stay in uniform registers instead of being moved over before each wgmma (21 moves in
    // the d = 128 loop instead of 53).
    const int row0 = __shfl_sync(0xffffffffu, OwnedRow0(wg), 0);
    const int col0 = __shfl_sync(0xffffffffu, ScoreCol0(wg), 0);
    const int owned_row = w.owned0 + row0 + 16 * warp_in_wg + g;  // this thread's owned rows: owned_row, owned_row + 8
    const int diag = static_cast<int>(w.mask.diag_offset);
    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;
    variant.mods = mods;
    [[maybe_unused]] int mod_b = 0;
    if constexpr (Variant::kHasMods) {
      mod_b = mods.Batch(w.b);
      if constexpr (!kOwnsKeys) variant.mods.grads = nullptr;  // the dk/dv kernel adds the captures' gradients
    }
    if constexpr (kGradientScratch) {
      variant.mods.template BeginScratchGradients<256>(sm.GradientScratch(), 128 * wg + 32 * warp_in_wg + lane);
      ConsumersSync();
    }

    // Accumulators, this warpgroup's columns of them: dk and dv (dk/dv kernel) or dq (acc0 only).
    float acc0[kAcc0Cols / 8][4];
    float acc1[kOwnsKeys ? kAcc1Cols / 8 : 1][4];
#pragma unroll
    for (int j = 0; j < kAcc0Cols / 8; ++j) acc0[j][0] = acc0[j][1] = acc0[j][2] = acc0[j][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < (kOwnsKeys ? kAcc1Cols / 8 : 1); ++j) acc1[j][0] = acc1[j][1] = acc1[j][2] = acc1[j][3] = 0.0f;

    // dq: its rows' lse and delta' for every step (rows past Sq see no key: their values are never used). The quad
    // of threads sharing a row splits its dot product.
    float row_lse[2] = {0.0f, 0.0f}, row_delta[2] = {0.0f, 0.0f};
    if constexpr (!kOwnsKeys) {
      float dot[2] = {0.0f, 0.0f}, dlse[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = owned_row + 8 * r;
        if (q >= s.seqlen_q) continue;
        const int64_t row = (static_cast<int64_t>(w.b) * s.seqlen_q + q) * s.num_heads + w.owned_head;
        const uint32_t* out = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(args.out) + row * kDv);
        const uint32_t* dout = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(args.dout) + row * kDv);
        for (int c = t; c < kDv / 2; c += 4) {
          const uint32_t x = out[c], y = dout[c];
          dot[r] = fmaf(Element::ToFloat(static_cast<uint16_t>(x & 0xffffu)),
                        Element::ToFloat(static_cast<uint16_t>(y & 0xffffu)), dot[r]);
          dot[r] = fmaf(Element::ToFloat(static_cast<uint16_t>(x >> 16)), Element::ToFloat(static_cast<uint16_t>(y >> 16)),
                        dot[r]);
        }
        const int64_t at = (static_cast<int64_t>(w.b) * s.num_heads + w.owned_head) * s.seqlen_q + q;
        row_lse[r] = args.lse[at];
        dlse[r] = args.dlse[at];
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) row_delta[r] = QuadSum(dot[r]) - dlse[r];
    }
    if constexpr (Variant::kHasAlibi && !kOwnsKeys) variant.slope = args.alibi_slopes[w.b * s.num_heads + w.owned_head];

    [[maybe_unused]] KernelDropout dropout;
    if constexpr (kDropout) dropout = KernelDropout::Of(args.dropout);
    // A bias: a query-broadcast one's stages hold one row. The dk/dv kernel sums a query-broadcast bias's gradient
    // over the step's queries before adding it to the accumulator (where dbias is written straight, such a bias has
    // one query).
    [[maybe_unused]] const bool bias_one_row = kBias && args.bias.query_stride == 0;
    [[maybe_unused]] const bool dbias_sums_queries = bias_one_row && args.dbias_accum != nullptr;
    using BiasGrad = BiasGradTarget<typename Variant::Bias>;
    float sc[kScoreCols / 8][4], dp[kScoreCols / 8][4];
    uint32_t pa[kScoreCols / 16][4], da[kScoreCols / 16][4];
    float dq[kAccumulateDq ? kDqN / 2 : 1];  // kAccumulateDq: the step's dq block, this warpgroup's columns
    const bool leader = wg == 0 && warp_in_wg == 0 && lane == 0;  // issues the bulk additions
    if (w.steps > 0) MbarrierWait(sm.OwnedFull(), 0);
    for (int i = 0; i < w.steps; ++i) {
      const int stage = StageOf<kStages>(i);
      const int head = w.QueryHead(i);
      const int step0 = w.StepRow0(i);
      if constexpr (Variant::kHasAlibi && kOwnsKeys) variant.slope = args.alibi_slopes[w.b * s.num_heads + head];
      MbarrierWait(sm.Full(stage), ParityOf<kStages>(i));
      // Tokens: whether the step needs the per-element test, by the index range or by the tokens' summaries. Asked
      // before the products, where no scores are live.
      [[maybe_unused]] bool step_masked = false;
      if constexpr (kTokens) {
        const TokenSummary owned = TokenSummaryOf(SharedPointer<const int32_t>(sm.OwnedSummaries()), 0, kOwned,
                                                  (kOwnsKeys ? s.seqlen_kv : s.seqlen_q) - w.owned0);
        const TokenSummary step = TokenSummaryOf(SharedPointer<const int32_t>(sm.StepSummary(stage)), 0, kStep,
                                                 (kOwnsKeys ? s.seqlen_q : s.seqlen_kv) - step0);
        step_masked = w.StepMasked(i) || !(kOwnsKeys ? TokensAllSee(step, owned) : TokensAllSee(owned, step));
      }

      // s = owned rows . step rows over d, dp over dv: both K-major, like the forward's q k^T.
      FenceOperands(reinterpret_cast<float(&)[kScoreCols / 2]>(sc));
      FenceOperands(reinterpret_cast<float(&)[kScoreCols / 2]>(dp));
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < (kD + 15) / 16; ++kk) {
        Wgmma<Element, kScoreCols>::SS(reinterpret_cast<float(&)[kScoreCols / 2]>(sc), sm.Own0().KMajor(row0, kk),
                                       sm.Stp0(stage).KMajor(col0, kk), kk > 0);
      }
#pragma unroll
      for (int kk = 0; kk < (kDv + 15) / 16; ++kk) {
        Wgmma<Element, kScoreCols>::SS(reinterpret_cast<float(&)[kScoreCols / 2]>(dp), sm.Own1().KMajor(row0, kk),
                                       sm.Stp1(stage).KMajor(col0, kk), kk > 0);
      }
      WgmmaCommit();
      // Dropout's keep bits of the thread's owned rows x the step's columns (keys along the rows in the dk/dv kernel).
      [[maybe_unused]] uint32_t keep_bits = 0;
      if constexpr (kDropout) {
        keep_bits = dropout.TileBits<kScoreCols / 8, kOwnsKeys>(w.b, head, owned_row, step0 + col0 + 2 * t);
      }

      WgmmaWait<0>();
      FenceOperands(reinterpret_cast<float(&)[kScoreCols / 2]>(sc));
      FenceOperands(reinterpret_cast<float(&)[kScoreCols / 2]>(dp));

      // dk/dv with a bias: where the step's logit gradients go (dbias, or its accumulator, at the step's query head),
      // and a query-broadcast bias's sums per owned key.
      auto dbias = [&]() { return BiasGrad::Of(args, w.b, head); };
      [[maybe_unused]] float key_sums[2] = {0.0f, 0.0f};
      // The bias of (query, key) from the stage, and (dk/dv) the logit's gradient to dbias.
      auto bias_at = [&](int query, int key) {
        if constexpr (kBias) {
          const int queries0 = kOwnsKeys ? step0 : w.owned0, keys0 = kOwnsKeys ? w.owned0 : step0;
          return sm.Bias(stage).At(bias_one_row ? 0 : query - queries0, key - keys0);
        } else {
          return 0.0f;
        }
      };
      auto add_dbias = [&](int query, int key, float dlogit, int r) {
        if constexpr (kBias && kOwnsKeys) {
          if (query >= s.seqlen_q || key >= s.seqlen_kv) return;
          if (dbias_sums_queries) {
            key_sums[r] += dlogit;
          } else {
            dbias().Add(dbias().At(query, key), dlogit, w.len.invalid);
          }
        }
      };

      // p and ds in place of s and dp; (query, key) of element e of n8 tile j.
      // A mask_mod: spared on a step whose block mask's blocks all keep every pair.
      [[maybe_unused]] bool apply_mask_mod = true;
      if constexpr (Variant::kHasMaskMod) {
        const int queries0 = kOwnsKeys ? step0 : w.owned0, keys0 = kOwnsKeys ? w.owned0 : step0;
        apply_mask_mod = !variant.mods.AllVisible(mod_b, head, queries0, queries0 + (kOwnsKeys ? kStep : kOwned), keys0,
                                                  keys0 + (kOwnsKeys ? kOwned : kStep));
      }
      auto apply = [&](auto masked) {
        // Tokens: the entries of the thread's two owned rows (loaded once a step), and of element e of n8 tile j's
        // query and key; the step's are the thread's columns col0 + 8 j + 2 t (+ 1), a pair of keys in one 16-byte
        // load.
        [[maybe_unused]] int4 owned_rows[2];  // dq: the owned queries'
        [[maybe_unused]] int2 owned_keys[2];  // dk/dv: the owned keys'
        if constexpr (kTokens) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int at = owned_row - w.owned0 + 8 * r;
            if constexpr (kOwnsKeys) {
              owned_keys[r] = SharedPointer<const int2>(sm.OwnedTokens())[at];
            } else {
              owned_rows[r] = SharedPointer<const int4>(sm.OwnedTokens())[at];
            }
          }
        }
        // The mask of the thread's two owned rows (keys in the dk/dv kernel, queries in the dq kernel): the columns each
        // sees, from the thread's first column (step0 + col0 + 2 t).
        [[maybe_unused]] ColumnRange seen[2];
        if constexpr (decltype(masked)::value) {
          const int64_t first = step0 + col0 + 2 * t;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int owned = owned_row + 8 * r;
            seen[r] = ColumnsFrom(kOwnsKeys ? w.mask.Rows(owned) : w.mask.Keys(owned), first, kStep);
          }
        }
        auto query_token = [&](int j, int e) {
          if constexpr (kOwnsKeys) {
            return SharedPointer<const int4>(sm.StepTokens(stage))[col0 + 8 * j + 2 * t + (e & 1)];
          } else {
            return owned_rows[e >> 1];
          }
        };
        auto key_token = [&](int j, int e) {
          if constexpr (kOwnsKeys) {
            return owned_keys[e >> 1];
          } else {
            const int4 pair = SharedPointer<const int4>(sm.StepTokens(stage))[col0 / 2 + 4 * j + t];
            return e & 1 ? make_int2(pair.z, pair.w) : make_int2(pair.x, pair.y);
          }
        };
#pragma unroll
        for (int j = 0; j < kScoreCols / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int own = owned_row + 8 * (e >> 1), other = step0 + col0 + 8 * j + 2 * t + (e & 1);
            const int query = kOwnsKeys ? other : own, key = kOwnsKeys ? own : other;
            bool visible = decltype(masked)::value ? seen[e >> 1].Contains(8 * j + (e & 1)) : true;
            if constexpr (Variant::kHasMaskMod) {
              if (apply_mask_mod) visible = visible && variant.mods.Mask(ModIndex{mod_b, head, query, key});
            }
            // dk/dv: the columns are the step's queries, their lse and delta' in the stage.
            const float lse = kOwnsKeys ? sm.Lse(stage)[other - step0] : row_lse[e >> 1];
            const float delta = kOwnsKeys ? sm.Delta(stage)[other - step0] : row_delta[e >> 1];
            float keep = 1.0f;
            if constexpr (kDropout) keep = dropout.Factor(keep_bits, 2 * ((e >> 1) * (kScoreCols / 8) + j) + (e & 1));
            if constexpr (kTokens) {
              // The tokens' test (no short cut: a load behind one is predicated and not shared between elements) and
              // positions.
              const int4 query_entry = query_token(j, e);
              const int2 key_entry = key_token(j, e);
              if constexpr (decltype(masked)::value) visible = visible & TokenSees(query_entry, key_entry);
              const float dlogit = ProbabilityGrad<Variant>::Apply(variant, sc[j][e], dp[j][e], query_entry.w,
                                                                   key_entry.y, visible, lse, delta,
                                                                   bias_at(query, key), keep,
                                                                   ModIndex{mod_b, head, query, key});
              add_dbias(query, key, dlogit, e >> 1);
            } else {
              const float dlogit =
                  ProbabilityGrad<Variant>::Apply(variant, sc[j][e], dp[j][e], query + diag, key, visible, lse, delta,
                                                  bias_at(query, key), keep, ModIndex{mod_b, head, query, key});
              add_dbias(query, key, dlogit, e >> 1);
            }
          }
      };
      // The test written twice: without tokens, the kernels keep the exact code they had before tokens existed.
      if constexpr (kTokens) {
        if (step_masked) {
          apply(Masked<true>{});
        } else {
          apply(Masked<false>{});
        }
      } else if (w.StepMasked(i)) {
        apply(Masked<true>{});
      } else {
        apply(Masked<false>{});
      }
      if constexpr (kBias && kOwnsKeys) {
        if (dbias_sums_queries) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float sum = QuadSum(key_sums[r]);
            const int key = owned_row + 8 * r;
            if (t == 0 && key < s.seqlen_kv) dbias().Add(dbias().At(0, key), sum, w.len.invalid);
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < kScoreCols / 16; ++kk) {
        PackAFragment<Element>(sc, kk, pa[kk]);
        PackAFragment<Element>(dp, kk, da[kk]);
      }
      if constexpr (kSplitsColumns) {
        // Both warpgroups' halves of p^T and ds^T into the step tiles; the barrier before orders the stores after the
        // other warpgroup's products of the previous step, which read the tiles.
        ConsumersSync();
        if constexpr (kPInSmem) StoreStepTile(sm.P(), pa, 16 * warp_in_wg + g, col0, t);
        StoreStepTile(sm.Ds(), da, 16 * warp_in_wg + g, col0, t);
        FenceSharedForAsyncProxy();  // wgmma reads shared memory through the async proxy
        ConsumersSync();
      }

      // dk/dv: dv += p^T dout, dk += ds^T q; dq: dq += ds k. The step's rows are the products' K, its tiles MN-major B;
      // the A operands from registers, or with split columns the whole step's from the step tiles.
      FenceOperands(reinterpret_cast<float(&)[kAcc0Cols / 2]>(acc0));
      if constexpr (kOwnsKeys) FenceOperands(reinterpret_cast<float(&)[kAcc1Cols / 2]>(acc1));
      if constexpr (!kSplitsColumns) {
        FenceOperands(pa);
        FenceOperands(da);
      }
      if constexpr (kAccumulateDq) FenceOperands(dq);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kStep / 16; ++kk) {
        AccumulateK16<kAcc0Cols, kN0>(acc0, da, sm.Ds(), sm.Stp0(stage), Acc0Col0(wg), kk);
        if constexpr (kOwnsKeys) AccumulateK16<kAcc1Cols, kN1>(acc1, pa, sm.P(), sm.Stp1(stage), Acc1Col0(wg), kk);
      }
      WgmmaCommit();
      if constexpr (kAccumulateDq) {
        // dq block = ds k over all 128 owned keys: both warpgroups' ds^T into shared memory first (the previous step's
        // dq products, which read it, are done: see the barrier below), and the previous block read by the copy engine.
        StoreStepTile(sm.Ds(), da, row0 + 16 * warp_in_wg + g, 0, t);
        FenceSharedForAsyncProxy();  // wgmma reads shared memory through the async proxy
        if (leader) BulkWaitSharedRead();
        ConsumersSync();
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kOwned / 16; ++kk) {
          Wgmma<Element, kDqN>::SSMN(dq, sm.Ds().MNMajor(kk, DqRow0(wg)), sm.Own0().MNMajor(kk, DqCol0(wg)), kk > 0);
        }
        WgmmaCommit();
      }
      WgmmaWait<0>();
      FenceOperands(reinterpret_cast<float(&)[kAcc0Cols / 2]>(acc0));
      if constexpr (kOwnsKeys) FenceOperands(reinterpret_cast<float(&)[kAcc1Cols / 2]>(acc1));
      StressDelay();
      MbarrierArrive(sm.Empty(stage));
      if constexpr (kAccumulateDq) {
        FenceOperands(dq);
        StoreDqBlock(sm, dq, wg, 16 * warp_in_wg + g, t);
        FenceSharedForAsyncProxy();  // the copy engine reads the block through the async proxy
        ConsumersSync();             // the block is whole, and every dq product of the step is done with ds^T
        if (leader) {
          BulkReduceAddF32(args.dq_accum + Accum::Offset(s, w.b, head, 0, step0), sm.DqBlock(),
                           kStep * Accum::kLayout.cols * 4);
        }
      }
    }
    if constexpr (kAccumulateDq) {
      if (leader) BulkWaitComplete();  // the block's shared memory lives until the copy engine is done with it
    }
    if constexpr (kGradientScratch) {
      variant.mods.FlushGradientRun();
      ConsumersSync();
      variant.mods.template EndScratchGradients<256>(sm.GradientScratch(), 128 * wg + 32 * warp_in_wg + lane);
    }
    if constexpr (kBias && kOwnsKeys) {
      // Written straight, dbias gets the zeros of the query rows no step visited, for the owned keys of each head.
      if (args.dbias_accum == nullptr) {
        for (int h = 0; h < w.group; ++h) {
          ZeroUnvisitedBiasGrad<typename Variant::Bias, kOwned, 256>(
              BiasGrad::Of(args, w.b, w.owned_head * w.group + h), w.tile_begin * kStep,
              (w.tile_begin + w.tiles) * kStep, w.owned0, s.seqlen_q, s.seqlen_kv, w.len.invalid,
              128 * wg + 32 * warp_in_wg + lane);
        }
      }
    }

    // Every owned row is written (zeros where no step saw it; NaN for a batch with invalid lengths); a document's
    // rows only: the rest of its block belongs to the next document's work.
    const int owned_len = kOwnsKeys ? s.seqlen_kv : s.seqlen_q;
    const int owned_end = kDocuments ? static_cast<int>(w.mask.kv_len) : owned_len;
    const int64_t stride0 = static_cast<int64_t>(kOwnsKeys ? s.num_kv_heads : s.num_heads) * kD;
    const int64_t stride1 = static_cast<int64_t>(s.num_kv_heads) * kDv;
    uint16_t* out0 = static_cast<uint16_t*>(kOwnsKeys ? args.dk : args.dq) +
                     static_cast<int64_t>(w.b) * owned_len * stride0 + w.owned_head * kD;
    uint16_t* out1 = static_cast<uint16_t*>(args.dv) + static_cast<int64_t>(w.b) * owned_len * stride1 + w.owned_head * kDv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = owned_row + 8 * r;
      if (row >= owned_end) continue;
#pragma unroll
      for (int j = 0; j < kAcc0Cols / 8; ++j) {
        const int col = Acc0Col0(wg) + 8 * j + 2 * t;
        if (col < kD) {
          *reinterpret_cast<uint32_t*>(out0 + row * stride0 + col) =
              w.len.invalid ? kPackedNaN : Element::Pack(acc0[j][2 * r], acc0[j][2 * r + 1]);
        }
      }
      if constexpr (kOwnsKeys) {
#pragma unroll
        for (int j = 0; j < kAcc1Cols / 8; ++j) {
          const int col = Acc1Col0(wg) + 8 * j + 2 * t;
          if (col < kDv) {
            *reinterpret_cast<uint32_t*>(out1 + row * stride1 + col) =
                w.len.invalid ? kPackedNaN : Element::Pack(acc1[j][2 * r], acc1[j][2 * r + 1]);
          }
        }
      }
    }
  }
};

}  // namespace te_jax::cuda::sm90
