// Forward flash attention, sm90 family (sm_90a): wgmma products, TMA copies into mbarrier-guarded rings and warp
// specialisation. A CTA has a producer warpgroup, one thread of which copies q and each k and v tile into separate
// rings, and two consumer warpgroups of 64 query rows (three where both head dims pad to 64: tile_size.h) that issue
// the next tile's q k^T with this tile's p v and run the softmax while both run, taking turns (ping-pong). The
// persistent kernel (kPersistent) runs one CTA per multiprocessor that takes query blocks in turn (ForEachWork,
// PrefetchWork); the document kernel (kDocuments, persistent) takes them from the document table of a packed row
// (kernels/common/document_tables.cuh), where the token kernel of its module steps aside. Masks, variants, packed sequences, dropout, the bias ring and the careful pass for non-finite values:
// docs/ARCHITECTURE.md, "The sm90 forward" and "NaN and inf".
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/dropout.h"
#include "cpp/cuda/kernels/common/kernel_mods.h"
#include "cpp/cuda/kernels/common/online_softmax.h"
#include "cpp/cuda/kernels/common/token_mask.h"
#include "cpp/cuda/kernels/primitives/fragment.h"
#include "cpp/cuda/kernels/primitives/pipeline.h"
#include "cpp/cuda/kernels/primitives/swizzled_tile.h"
#include "cpp/cuda/kernels/primitives/wgmma.h"
#include "cpp/cuda/kernels/sm90/bias_tile.h"
#include "cpp/cuda/kernels/sm90/tile_size.h"

namespace te_jax::cuda::sm90 {

// Whether any of kThreads threads passes true (a barrier named 1, so it never meets __syncthreads).
template <int kThreads>
__device__ __forceinline__ bool CtaAny(bool pred) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred p, q;\nsetp.ne.u32 p, %1, 0;\nbarrier.red.or.pred q, 1, %2, p;\nselp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "n"(kThreads)
      : "memory");
  return any != 0;
}

// The consumer warpgroups take turns in a ring (FlashAttention-3's ping-pong): a warpgroup waits for its turn (named
// barrier 2 + wg, which it and its predecessor meet) before issuing its products and hands the turn to the next right
// after, so the others' softmax runs while one's products keep the tensor cores busy.
__device__ __forceinline__ void WaitTurn(int wg) { asm volatile("bar.sync %0, 256;" ::"r"(2 + wg) : "memory"); }
template <int kConsumers>
__device__ __forceinline__ void PassTurn(int wg) {
  asm volatile("bar.arrive %0, 256;" ::"r"(2 + (wg + 1) % kConsumers) : "memory");
}

// Input: the type of q, k and v, Element's (16-bit: out is Element too) or FP8 (E4M3, E5M2: out in Element; below).
template <typename Element, int kD, int kDv, typename Variant, int kConsumers = 2, bool kPersistent = false,
          bool kDocuments = false, typename Input = Element>
struct ForwardKernel {
  static constexpr bool kTokens = Variant::kHasTokens;
  static constexpr bool kDropout = Variant::kHasDropout;
  static constexpr bool kBias = Variant::kHasBias;
  static constexpr int kBiasBytes = Variant::Bias::kBytes;
  static constexpr bool kFp8 = Input::kBytes == 1;
  static constexpr ForwardTile kTile = ForwardTileSize(kD, kDv, kTokens, kConsumers, kBiasBytes, Input::kBytes);
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kStages = kTile.stages;
  static constexpr int kThreads = ForwardThreads(kTile);
  // One CTA per block: the rerun vote's threads, the consumer warpgroups and the producer warp (the producer
  // warpgroup's other warps leave once they have given up their registers).
  static constexpr int kVoters = kThreads - 96;
  // Persistent kernels: a q buffer's word names its item, a work's index and whether the item is that work's careful
  // pass; the consumers add kRerunAsked to it when the work's first pass met a non-finite value it must not see.
  static constexpr int kCarefulItem = 1 << 30;
  static constexpr int kRerunAsked = 1 << 29;
  static constexpr int kItemIndex = kRerunAsked - 1;
  static constexpr int kDP = PadTo64(kD);
  static constexpr int kDvP = PadTo64(kDv);
  static constexpr int kKStep = kFp8 ? 32 : 16;  // k of each product instruction: 32 bytes of its rows either way
  static constexpr int kQkSteps = (kD + kKStep - 1) / kKStep;  // k steps of q k^T; the zero padding past kD is skipped
  static constexpr int kPvSteps = kBlockN / kKStep;              // k steps of p v
  static constexpr int kPvN = kDvP % 128 == 0 ? 128 : 64;  // n of each p v instruction
  // The tiles as 16-bit columns (FP8: byte pairs, so the swizzle, TMA boxes and descriptors are the 16-bit tiles'). FP8
  // wgmma takes both operands K-major: v's stage is V^T, dv rows of the tile's keys, which the lowering stores so (the
  // v operand of an FP8 call, te_jax/fp8.py): each kv head's [Dv, Skv], keys in PackFp8AFragment's order within every
  // 16 (Fp8KeyOfSlot), so p's A fragment is the accumulator's own registers.
  using QTile = SwizzledTile<kBlockM, kDP * Input::kBytes / 2>;
  using KTile = SwizzledTile<kBlockN, kDP * Input::kBytes / 2>;
  using VTile = SwizzledTile<kFp8 ? kDvP : kBlockN, kFp8 ? kBlockN / 2 : kDvP>;
  using BiasStage = BiasTile<typename Variant::Bias, kBlockM, kBlockN>;
  static constexpr int kQBuffers = ForwardQBuffers(kPersistent);
  static constexpr int kKOffset = kQBuffers * QTile::kBytes;
  static constexpr int kVOffset = kKOffset + kStages * KTile::kBytes;
  // A bias: its ring after v's (whole 1024-byte swizzle atoms, as k's and v's stages are).
  static constexpr int kBiasOffset = kVOffset + kStages * VTile::kBytes;
  // Tokens: after the v ring (and a bias's), the CTA's query rows' entries, "saw a key" flags and granule summaries,
  // then the token ring, each stage a key tile's entries and granule summaries. The rows' state stays in shared memory,
  // read or set where a tile needs it: held in registers through the loop, it made the d = 128 and d = 256 kernels
  // spill.
  // A tile's tokens land with its k (counted on the k stage's full barrier) but are read until its logits are done,
  // after the k stage went back (right after q k^T). So the ring has a stage more than k's: the producer, which waits
  // for each v stage's release in order, has seen ring position i - kStages - 1 (the previous tenant of position i's
  // token stage, done with its logits before it released its v) released by the time it copies position i's tokens.
  static constexpr int kTokenStages = kStages + 1;
  static constexpr int kKeyGranules = kBlockN / kTokenGranule;
  static constexpr int kKeyGranuleBytes = 8 * kTokenGranule + kTokenSummaryBytes;  // a granule's entries and summary
  static constexpr int kTokensOffset = kBiasOffset + (kBias ? kStages * BiasStage::kBytes : 0);
  static constexpr int kRowSeenOffset = kTokensOffset + 16 * kBlockM;
  static constexpr int kRowSummariesOffset = kRowSeenOffset + 4 * kBlockM;
  static constexpr int kTokenRingOffset = kRowSummariesOffset + kBlockM / kTokenGranule * kTokenSummaryBytes;
  static constexpr int kBarrierOffset = kTokensOffset + (kTokens ? ForwardTokenBytes(kTile) : 0);
  // q full per buffer; k full, k empty, v full, v empty per stage; bias full, bias empty per stage; q empty per buffer.
  static constexpr int kBarriers = kQBuffers + 4 * kStages + (kBias ? 2 * kStages : 0) + kQBuffers;
  static constexpr int kItemsOffset = kBarrierOffset + 8 * kBarriers;  // persistent kernels: an item word per q buffer
  static constexpr int kSmemBytes = 1024 + kItemsOffset + (kPersistent ? 8 : 0);
  static_assert(kSmemBytes == ForwardSmemBytes(kD, kDv, kTokens, kConsumers, kBiasBytes, kPersistent, Input::kBytes),
                "tile_size.h and the kernel disagree on shared memory");
  static_assert(!kTokens || kTokenRingOffset + kTokenStages * kKeyGranules * kKeyGranuleBytes == kBarrierOffset,
                "tile_size.h and the kernel disagree on the token ring");
  static_assert(kSmemBytes <= kMaxDynamicSmem, "the tiles fit in shared memory");
  static_assert(kBlockM == 64 * kConsumers && kTile.consumers == kConsumers, "consumer warpgroups of 64 rows");
  static constexpr bool kPlain = !Variant::kHasSoftcap && !Variant::kHasAlibi && !kTokens && !kDropout && !kBias;
  static_assert(kConsumers == 2 || ForwardHasThreeConsumerKernel(kD, kDv, kPlain),
                "three consumer warpgroups only where tile_size.h gives them");
  static_assert(!kPersistent || ForwardHasPersistentKernel(kD, kDv, kPlain), "persistent only where tile_size.h says");
  static_assert(!kDocuments || kPersistent, "the document kernel is a persistent one");
  static_assert(kBlockN == 64 || kBlockN == 128, "q k^T is one wgmma per k16 step");
  static_assert(!kFp8 || (ServesFp8Forward(kD, kDv) && kBlockN == 128 && kPvN == 128 && kConsumers == 2 &&
                          !kPersistent && !kTokens && !kDropout && !kBias && !Variant::kHasMods),
                "FP8: the plain product's one-CTA-per-block kernel at the head dims ServesFp8Forward names");
  // FP8: p is packed as p * kPScale (at most 256 of e4m3's 448, so p's small values keep e4m3's normal range down to
  // 2^-14), and the output's scale undoes it with v's descale.
  static constexpr float kPScale = 256.0f;

  // Raw scores keep q.k unscaled and fold scale * log2 e into the softmax's exp2 (kernels/common/online_softmax.h); a
  // bias adds to natural-unit logits. ALiBi over index positions adds its term over the scale (AlibiOverScale).
  // A score_mod takes the logit itself.
  static constexpr bool kScoreMod = Variant::kHasScoreMod;
  static constexpr bool kRawAlibi = Variant::kHasAlibi && !Variant::kHasSoftcap && !kBias && !kTokens && !kScoreMod;
  static constexpr bool kRawScores =
      (!Variant::kHasSoftcap && !Variant::kHasAlibi && !kBias && !kScoreMod) || kRawAlibi;

  // The shared-memory map, from the 1024-byte-aligned base.
  struct Smem {
    uint32_t base;
    __device__ __forceinline__ QTile Q(int buffer) const { return {base + buffer * QTile::kBytes}; }
    __device__ __forceinline__ KTile K(int stage) const { return {base + kKOffset + stage * KTile::kBytes}; }
    __device__ __forceinline__ VTile V(int stage) const { return {base + kVOffset + stage * VTile::kBytes}; }
    __device__ __forceinline__ uint32_t Barrier(int index) const { return base + kBarrierOffset + 8 * index; }
    __device__ __forceinline__ uint32_t QFull(int buffer) const { return Barrier(buffer); }
    __device__ __forceinline__ uint32_t KFull(int stage) const { return Barrier(kQBuffers + stage); }
    __device__ __forceinline__ uint32_t KEmpty(int stage) const { return Barrier(kQBuffers + kStages + stage); }
    __device__ __forceinline__ uint32_t VFull(int stage) const { return Barrier(kQBuffers + 2 * kStages + stage); }
    __device__ __forceinline__ uint32_t VEmpty(int stage) const { return Barrier(kQBuffers + 3 * kStages + stage); }
    __device__ __forceinline__ BiasStage Bias(int stage) const {
      return {base + kBiasOffset + stage * BiasStage::kBytes};
    }
    __device__ __forceinline__ uint32_t BiasFull(int stage) const { return Barrier(kQBuffers + 4 * kStages + stage); }
    __device__ __forceinline__ uint32_t BiasEmpty(int stage) const {
      return Barrier(kQBuffers + 5 * kStages + stage);
    }
    // Persistent kernels: the consumers are done with a q buffer; the word of the item whose q a buffer holds.
    __device__ __forceinline__ uint32_t QEmpty(int buffer) const { return Barrier(kBarriers - kQBuffers + buffer); }
    __device__ __forceinline__ int& Item(int buffer) const { return SharedPointer<int>(base + kItemsOffset)[buffer]; }
    // Tokens: the query rows' entries, flags and granule summaries; token stage ts: a key tile's entries, then its
    // granules' summaries.
    __device__ __forceinline__ uint32_t RowTokens() const { return base + kTokensOffset; }
    __device__ __forceinline__ uint32_t RowSeen() const { return base + kRowSeenOffset; }
    __device__ __forceinline__ uint32_t RowSummaries() const { return base + kRowSummariesOffset; }
    __device__ __forceinline__ uint32_t KeyEntries(int ts) const {
      return base + kTokenRingOffset + ts * kKeyGranules * kKeyGranuleBytes;
    }
    __device__ __forceinline__ uint32_t KeySummaries(int ts) const { return KeyEntries(ts) + 8 * kBlockN; }
  };

  // The position of the i-th tile a CTA consumes (counted over both passes) in the rings.
  static __device__ __forceinline__ int StageOf(int i) { return cuda::StageOf<kStages>(i); }
  static __device__ __forceinline__ uint32_t ParityOf(int i) { return cuda::ParityOf<kStages>(i); }
  static __device__ __forceinline__ int TokenStageOf(int i) { return i % kTokenStages; }

  // The producer thread's copies. q into a buffer; with tokens, the query rows' entries and granule summaries come
  // with it (the rows past Sq are not copied: the index range hides every key from them).
  static __device__ __forceinline__ void LoadQ(const TmaForwardArgs& a, const Smem& sm, const QueryBlockOfCta& cta,
                                               int buffer) {
    const ShapeArgs& s = a.args.shape;
    const int q_rows = kTokens ? min(kBlockM, s.seqlen_q - cta.m0) : 0;
    const int q_granules = kTokens ? TokenGranuleEnd(cta.m0, kBlockM, s.seqlen_q) - cta.m0 / kTokenGranule : 0;
    LoadTile<kBlockM>(sm.Q(buffer), &a.q, sm.QFull(buffer), cta.head, cta.m0, cta.b,
                      16 * q_rows + q_granules * kTokenSummaryBytes);
    if constexpr (kTokens) {
      const BatchTokens tokens = BatchTokens::Of(a.args.tokens, s, cta.b);
      BulkLoad(sm.RowTokens(), tokens.q_rows + cta.m0, 16 * q_rows, sm.QFull(buffer));
      BulkLoad(sm.RowSummaries(), tokens.q_summary + cta.m0 / kTokenGranule * kTokenSummaryInts,
               q_granules * kTokenSummaryBytes, sm.QFull(buffer));
    }
  }

  // k, the bias and v of tiles [tile_begin, tile_end), counting ring positions from `i`. With tokens, each tile's key
  // entries and granule summaries come with its k (the granules past Skv are not copied, and the keys table's padding
  // fills the last one).
  static __device__ __forceinline__ void ProduceTiles(const TmaForwardArgs& a, const Smem& sm,
                                                      const QueryBlockOfCta& cta, int i) {
    const ShapeArgs& s = a.args.shape;
    for (int tile = cta.tile_begin; tile < cta.tile_end; ++tile, ++i) {
      const int stage = StageOf(i);
      const uint32_t parity = ParityOf(i) ^ 1u;  // the consumers' release of this stage's previous tile
      MbarrierWait(sm.KEmpty(stage), parity);
      const int granules = kTokens ? TokenGranuleEnd(tile * kBlockN, kBlockN, s.seqlen_kv) - tile * kKeyGranules : 0;
      LoadTile<kBlockN>(sm.K(stage), &a.k, sm.KFull(stage), cta.kv_head, tile * kBlockN, cta.b,
                        granules * kKeyGranuleBytes);
      if constexpr (kTokens) {
        // The tables' addresses from the parameters at each use: held through the loop, they made the producer spill.
        const BatchTokens tokens = BatchTokens::Of(a.args.tokens, s, cta.b);
        const int ts = TokenStageOf(i);
        BulkLoad(sm.KeyEntries(ts), tokens.keys + tile * kBlockN, granules * 8 * kTokenGranule, sm.KFull(stage));
        BulkLoad(sm.KeySummaries(ts), tokens.kv_summary + tile * kKeyGranules * kTokenSummaryInts,
                 granules * kTokenSummaryBytes, sm.KFull(stage));
      }
      if constexpr (kBias) {
        MbarrierWait(sm.BiasEmpty(stage), parity);
        const BiasBoxes boxes = BiasBoxes::Of(a.args.bias, s.num_heads, cta.b, cta.head, cta.m0);
        sm.Bias(stage).template Load<kBlockM>(&a.bias, sm.BiasFull(stage), boxes, tile * kBlockN);
      }
      MbarrierWait(sm.VEmpty(stage), parity);
      if constexpr (kFp8) {
        // V^T: one box of the tile's keys (64 byte pairs) x dv rows of the kv head (tensor_maps.h's transposed map).
        MbarrierArriveExpectBytes(sm.VFull(stage), VTile::kBytes);
        TmaLoad4d(sm.V(stage).base, &a.v, sm.VFull(stage), tile * kBlockN / 2, 0, cta.kv_head, cta.b);
      } else {
        LoadTile<kBlockN>(sm.V(stage), &a.v, sm.VFull(stage), cta.kv_head, tile * kBlockN, cta.b);
      }
    }
  }

  // s = q k^T for the warpgroup's 64 rows (from `row0` of the q tile) and the stage's keys; issued and committed, not
  // waited for.
  static __device__ __forceinline__ void IssueQKt(float (&s)[kBlockN / 8][4], QTile q, const Smem& sm, int row0,
                                                  int stage) {
    float(&flat)[kBlockN / 2] = reinterpret_cast<float(&)[kBlockN / 2]>(s);
#pragma unroll
    for (int kk = 0; kk < kQkSteps; ++kk) {
      if constexpr (kFp8) {
        WgmmaFp8<Input, Input, kBlockN>::SS(flat, q.KMajor(row0, kk), sm.K(stage).KMajor(0, kk), kk > 0);
      } else {
        Wgmma<Element, kBlockN>::SS(flat, q.KMajor(row0, kk), sm.K(stage).KMajor(0, kk), kk > 0);
      }
    }
    WgmmaCommit();
  }

  // o += p v for the stage's keys; issued and committed, not waited for.
  static __device__ __forceinline__ void IssuePV(float (&o)[kDvP / 8][4], const uint32_t (&p)[kPvSteps][4],
                                                 const Smem& sm, int stage) {
#pragma unroll
    for (int kk = 0; kk < kPvSteps; ++kk) {
#pragma unroll
      for (int n = 0; n < kDvP / kPvN; ++n) {
        float(&part)[kPvN / 2] = reinterpret_cast<float(&)[kPvN / 2]>(o[n * kPvN / 8]);
        if constexpr (kFp8) {
          WgmmaFp8<E4M3, Input, kPvN>::RS(part, p[kk], sm.V(stage).KMajor(n * kPvN, kk));
        } else {
          Wgmma<Element, kPvN>::RS(part, p[kk], sm.V(stage).MNMajor(kk, n * kPvN));
        }
      }
    }
    WgmmaCommit();
  }

  // o += p v for a tile that straddles a row's range edge, key by key in plain arithmetic, adding only the keys the row
  // sees: a tensor-core product would add 0 * v to every row, and 0 * inf or 0 * NaN from a key the row does not see
  // is NaN. Only the careful pass runs it. With tokens, p itself says which keys a row sees: the careful pass marks the
  // others' p with -0, which no seen key's p is (exp2 gives +0 at worst, and the 16-bit conversion keeps the sign), so
  // no register carries the mask from the logits to here (a bit mask held from the one to the other, or the token
  // test here, made the d = 128 and d = 256 kernels spill).
  static constexpr uint16_t kNegativeZero = 0x8000;  // in bf16 and fp16 alike
  // FP8: p's fragment holds 4 keys a register (k slots 4t..4t+3 of each 16, keys Fp8KeyOfSlot: V^T's stage holds each
  // key at its slot), against the 16-bit fragment's 2; its key loop stays rolled (unrolled, it spilled).
  static constexpr int kKeysPerWord = kFp8 ? 4 : 2;
  static constexpr int kCarefulUnroll = kFp8 ? 1 : 2;
  static __device__ __forceinline__ void CarefulPV(float (&o)[kDvP / 8][4], const uint32_t (&p)[kPvSteps][4],
                                                   const Smem& sm, int stage, int n0, const int2 (&keys)[2], int lane) {
    const VTile v = sm.V(stage);
    const int t = lane & 3;
    // kk and h unrolled: p must stay in registers (a run-time index would move it to local memory for the whole kernel).
#pragma unroll
    for (int kk = 0; kk < kPvSteps; ++kk) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll 1
        for (int owner = 0; owner < 4; ++owner) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            // Fragment register 2h + r of the quad's lane `owner` holds row r's p at k slots kKStep kk + kKStep / 2 h +
            // kKeysPerWord owner + {0, .., kKeysPerWord - 1}: the keys themselves with 16-bit p.
            const uint32_t word = __shfl_sync(0xffffffffu, p[kk][2 * h + r], (lane & ~3) | owner);
#pragma unroll kCarefulUnroll
            for (int c = 0; c < kKeysPerWord; ++c) {
              const int slot = kKStep * kk + kKStep / 2 * h + kKeysPerWord * owner + c;
              const int key = kFp8 ? 32 * kk + Fp8KeyOfSlot(slot % 32) : slot;
              bool seen = n0 + key >= keys[r].x && n0 + key < keys[r].y;
              float pk;
              if constexpr (kFp8) {
                pk = E4M3::ToFloat(word >> (8 * c));
              } else {
                const uint16_t p_bits = static_cast<uint16_t>(c ? word >> 16 : word & 0xffffu);
                if constexpr (kTokens) seen = p_bits != kNegativeZero;
                pk = Element::ToFloat(p_bits);
              }
              AddCarefulTerm(o, r, pk, seen, [&](int j) {
                if constexpr (kFp8) {
                  // Dims 8 j + 2 t and + 1: their rows of V^T, the slot's byte of its 16-bit pair.
                  uint32_t bytes[2];
#pragma unroll
                  for (int e = 0; e < 2; ++e) {
                    asm volatile("ld.shared.u8 %0, [%1];"
                                 : "=r"(bytes[e])
                                 : "r"(v.Address(8 * j + 2 * t + e, slot / 2) + (slot & 1)));
                  }
                  return make_float2(Input::ToFloat(bytes[0]), Input::ToFloat(bytes[1]));
                } else {
                  // The thread's two columns 8j + 2t and 8j + 2t + 1 in one 32-bit load. (Loading them one by one,
                  // NVVM 13.0 folded the odd column's swizzle chunk to col ^ row instead of (col / 8) ^ row at d = 64.)
                  uint32_t v2;
                  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v2) : "r"(v.Address(key, 8 * j + 2 * t)));
                  return make_float2(Element::ToFloat(static_cast<uint16_t>(v2 & 0xffffu)),
                                     Element::ToFloat(static_cast<uint16_t>(v2 >> 16)));
                }
              });
            }
          }
        }
      }
    }
  }

  // The careful product's term of one key for row r: o += pk v at the thread's columns 8 j + 2 t, + 1 (pair(j): v's
  // values there) where the row sees the key; a select, not a branch, since registers wgmma reads must not be written
  // on divergent paths.
  template <typename Pair>
  static __device__ __forceinline__ void AddCarefulTerm(float (&o)[kDvP / 8][4], int r, float pk, bool seen,
                                                        Pair&& pair) {
#pragma unroll
    for (int j = 0; j < kDvP / 8; ++j) {
      const float2 v = pair(j);
      const float sum0 = fmaf(pk, v.x, o[j][2 * r]), sum1 = fmaf(pk, v.y, o[j][2 * r + 1]);
      o[j][2 * r] = seen ? sum0 : o[j][2 * r];
      o[j][2 * r + 1] = seen ? sum1 : o[j][2 * r + 1];
    }
  }

  // A CTA's work: one block of query rows of one (batch, head), the key tiles its rows see, and which of those every
  // row sees whole.
  struct Work {
    QueryBlockOfCta cta;
    int tiles;                 // key tiles the block's rows may see
    int full_begin, full_end;  // tiles [full_begin, full_end) are visible to every row: no per-element mask there
    bool straddles;            // some tile straddles a row's range edge (the NaN rerun's condition)
  };

  static __device__ __forceinline__ Work WorkOf(const ForwardArgs& args, int m_block, int head, int b) {
    return WorkOf(args, QueryBlockOf<kBlockM, kBlockN>(args.shape, args.q_seqlens, args.kv_seqlens, m_block, head, b));
  }
  static __device__ __forceinline__ Work WorkOf(const ForwardArgs& args, const QueryBlockOfCta& block) {
    const ShapeArgs& s = args.shape;
    Work w;
    w.cta = block;
    QueryBlockOfCta& cta = w.cta;
    if constexpr (kTokens) {
      // Only the key tiles the rows' tokens may meet: narrowed here, so the producer and the consumers walk the same.
      const BatchTokens tokens = BatchTokens::Of(args.tokens, s, cta.b);
      NarrowToTokenSpan(TokenTileSpan<kBlockN>(tokens.q_span, cta.m0, kBlockM, s.seqlen_q), cta.tile_begin,
                        cta.tile_end);
    }
    w.tiles = cta.tile_end > cta.tile_begin ? cta.tile_end - cta.tile_begin : 0;
    const KeySpan span = cta.span;
    w.full_begin = span.all_rows_valid ? (span.full_begin + kBlockN - 1) / kBlockN : cta.tile_end;
    w.full_end = span.all_rows_valid ? span.full_end / kBlockN : cta.tile_end;
    w.straddles =
        w.tiles > 0 && (!span.all_rows_valid || w.full_begin > cta.tile_begin || w.full_end < cta.tile_end);
    // With tokens any tile may be masked per element (the token test is not a range edge).
    if constexpr (kTokens) w.straddles = w.tiles > 0;
    return w;
  }

  // Calls f(work, n, careful) for the CTA's n-th item. One CTA per query block: the last query blocks see the most keys
  // under causal masks, so they start first and the tail of the grid is short. Persistent: the query blocks of all
  // (batch, head) pairs in that order (PersistentWork); a CTA's first is the one at its own index, and each next one it
  // takes from a counter as it starts the one before (TakeWork), so a CTA that drew long blocks takes fewer, and the
  // CTAs at work at one time share their K/V in L2; between them come the careful passes blocks ask for. The producer
  // thread stores each item beside its q buffer; the consumers read it once the q has landed (the q full barrier orders
  // the store before).
  // A block mask: a work's key tiles narrowed to those its blocks may show (KernelMods::NarrowTiles; a whole warp).
  static __device__ __forceinline__ void NarrowToBlockMask(const typename Variant::Mods& mods, Work& w) {
    QueryBlockOfCta& cta = w.cta;
    mods.template NarrowTiles<kBlockN, false>(mods.Batch(cta.b), cta.head, cta.head + 1, cta.m0, cta.m0 + kBlockM,
                                              cta.tile_begin, cta.tile_end);
    w.tiles = cta.tile_end > cta.tile_begin ? cta.tile_end - cta.tile_begin : 0;
  }

  // One CTA per block: the CTA's work, narrowed by a block mask (every thread, before the producer gives up its
  // registers).
  static __device__ __forceinline__ Work OwnWork(const ForwardArgs& args, const typename Variant::Mods& mods) {
    Work w = WorkOf(args, static_cast<int>(gridDim.x - 1 - blockIdx.x), blockIdx.y, blockIdx.z);
    if constexpr (Variant::kHasMaskMod) NarrowToBlockMask(mods, w);
    return w;
  }

  // own: the CTA's work where it has one (not persistent).
  template <typename F>
  static __device__ __forceinline__ void ForEachWork(const ForwardArgs& args, const Work& own, const Smem& sm,
                                                     bool producer, F&& f) {
    if constexpr (kPersistent) {
      const int works = PersistentWorks(args);
      for (int n = 0;; ++n) {
        const int buffer = n % kQBuffers;
        if (n > 0 && !producer) MbarrierWait(sm.QFull(buffer), (n / kQBuffers) & 1);
        const int item = sm.Item(buffer);
        if ((item & kItemIndex) >= works) break;
        f(PersistentWork(args, item & kItemIndex), n, (item & kCarefulItem) != 0);
      }
    } else {
      f(own, 0, false);
    }
  }

  // Persistent kernels: how many works there are, and the work at an index of their order. The document kernel's are
  // the document table's works (longest first) of each head in turn.
  static __device__ __forceinline__ int PersistentWorks(const ForwardArgs& args) {
    const ShapeArgs& s = args.shape;
    if constexpr (kDocuments) return args.tokens.documents[1] * s.num_heads;
    return (s.seqlen_q + kBlockM - 1) / kBlockM * s.num_heads * s.batch;
  }
  static __device__ __forceinline__ Work PersistentWork(const ForwardArgs& args, int index) {
    const ShapeArgs& s = args.shape;
    if constexpr (kDocuments) {
      const int blocks = args.tokens.documents[1];
      const int4* entries = reinterpret_cast<const int4*>(args.tokens.documents + kDocumentTableHeaderInts);
      return WorkOf(args, DocumentBlockOf<kBlockM, kBlockN>(s, args.tokens, entries[index % blocks], index / blocks));
    }
    const int blocks = (s.seqlen_q + kBlockM - 1) / kBlockM;
    const int head_of_batch = index / blocks;
    return WorkOf(args, blocks - 1 - index % blocks, head_of_batch % s.num_heads, head_of_batch / s.num_heads);
  }

  // Persistent kernels, the producer thread: the index of the CTA's next work, taken from the counter as it starts a
  // work, so the atomic's round trip runs under that work's copies. The first gridDim.x works went to the CTAs by their
  // index.
  static __device__ __forceinline__ int TakeWork(const TmaForwardArgs& a) {
    return static_cast<int>(atomicAdd(a.next_work, 1u) + gridDim.x);
  }

  // Persistent kernels, the producer thread once it has copied the tiles of the CTA's item n - 1: item n. That is the
  // careful pass of a work whose first pass asked for one, found once the consumers have released its q buffer (item
  // n - 2's; with no work left, item n - 1's too, which would otherwise end unchecked), else `next`, which it then
  // clears; past the last work the buffer's word alone says so. The item's word goes beside its q buffer, its q into
  // that buffer and its first k and v tiles into L2, so they land sooner once the rings take them. `next`'s rows and
  // key tiles are found before the waits, so their lengths' loads run under them.
  static __device__ __forceinline__ void PrefetchWork(const TmaForwardArgs& a, const Smem& sm, int n, int& next) {
    const int works = PersistentWorks(a.args);
    const int buffer = n % kQBuffers;
    QueryBlockOfCta cta = PersistentWork(a.args, min(next, works - 1)).cta;
    int item = next;
    auto rerun_of = [&](int earlier) {  // item `earlier`'s careful pass if it asked for one (and takes the request)
      const int at = earlier % kQBuffers;
      MbarrierWait(sm.QEmpty(at), (earlier / kQBuffers) & 1);
      const int word = sm.Item(at);
      if (!(word & kRerunAsked)) return false;
      sm.Item(at) = word & ~kRerunAsked;
      item = (word & kItemIndex) | kCarefulItem;
      return true;
    };
    if (!(n >= kQBuffers && rerun_of(n - kQBuffers)) && next >= works) rerun_of(n - 1);
    if (item == next) next = -1;
    sm.Item(buffer) = item;
    if ((item & kItemIndex) >= works) {
      MbarrierArrive(sm.QFull(buffer));
      return;
    }
    if (item & kCarefulItem) cta = PersistentWork(a.args, item & kItemIndex).cta;
    LoadQ(a, sm, cta, buffer);
    for (int tile = cta.tile_begin; tile < min(cta.tile_end, cta.tile_begin + kStages); ++tile) {
      PrefetchTileToL2<kBlockN, KTile>(&a.k, cta.kv_head, tile * kBlockN, cta.b);
      PrefetchTileToL2<kBlockN, VTile>(&a.v, cta.kv_head, tile * kBlockN, cta.b);
    }
  }

  static __device__ __forceinline__ void Run(const TmaForwardArgs& a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Smem sm{(SmemAddress(smem_raw) + 1023u) & ~1023u};
    const ForwardArgs& args = a.args;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, warpgroup = warp >> 2;
    // A packed row: the document kernel serves it where the table says the reading holds, else the token kernel.
    if constexpr (kDocuments) {
      if (!ReadAsDocuments(args.tokens)) return;
    } else if constexpr (kTokens) {
      if (ReadAsDocuments(args.tokens)) return;
    }
    if (tid == 0) {
      PrefetchTensorMap(&a.q);
      PrefetchTensorMap(&a.k);
      PrefetchTensorMap(&a.v);
      if constexpr (kBias) PrefetchTensorMap(&a.bias);
      for (int buffer = 0; buffer < kQBuffers; ++buffer) {
        MbarrierInit(sm.QFull(buffer), 1);
        if constexpr (kPersistent) MbarrierInit(sm.QEmpty(buffer), 4 * kConsumers);
      }
      for (int st = 0; st < kStages; ++st) {
        MbarrierInit(sm.KFull(st), 1);
        MbarrierInit(sm.VFull(st), 1);
        MbarrierInit(sm.KEmpty(st), 4 * kConsumers);  // a release per consumer warp
        MbarrierInit(sm.VEmpty(st), 4 * kConsumers);
        if constexpr (kBias) {
          MbarrierInit(sm.BiasFull(st), 1);
          MbarrierInit(sm.BiasEmpty(st), 4 * kConsumers);
        }
      }
      if constexpr (kPersistent) sm.Item(0) = static_cast<int>(blockIdx.x);  // the first work goes by the CTA's index
      FenceMbarrierInit();
    }
    __syncthreads();

    // Both sides count the ring positions a CTA's items take (a work's tiles, twice for a rerun) from 0.
    int ring = 0;
    typename Variant::Mods mods{};
    if constexpr (Variant::kHasMods) mods = Variant::Mods::Of(a);
    Work own{};
    if constexpr (!kPersistent) own = OwnWork(args, mods);
    if (warpgroup == 0) {
      DecreaseRegisters<ForwardProducerRegisters(kPersistent)>();
      if constexpr (kPersistent) {
        // One thread copies every tile, and no other has a vote to take part in.
        if (tid != 0) return;
        int next = -1;  // a work taken from the counter and not yet given a q buffer
        ForEachWork(args, own, sm, true, [&](const Work& w, int n, bool careful) {
          if (n == 0) LoadQ(a, sm, w.cta, 0);  // later items' q come with PrefetchWork
          if (next < 0) next = TakeWork(a);
          ProduceTiles(a, sm, w.cta, ring);
          if (careful) ProduceTiles(a, sm, w.cta, ring + w.tiles);  // the item's first pass, then its careful one
          PrefetchWork(a, sm, n + 1, next);
          ring += careful ? 2 * w.tiles : w.tiles;
        });
      } else {
        if (warp != 0) return;
        const bool producer = lane == 0;
        ForEachWork(args, own, sm, producer, [&](const Work& w, int, bool) {
          if (producer) {
            LoadQ(a, sm, w.cta, 0);
            ProduceTiles(a, sm, w.cta, 0);
          }
          const bool rerun = w.straddles && CtaAny<kVoters>(false);
          if (rerun && producer) ProduceTiles(a, sm, w.cta, w.tiles);
        });
      }
    } else {
      IncreaseRegisters<ForwardConsumerRegisters(kTile, kPersistent)>();
      ForEachWork(args, own, sm, false, [&](const Work& w, int n, bool careful) {
        ring += Consume(args, mods, sm, w, n, careful, ring, warpgroup - 1, warp & 3, lane);
      });
    }
  }

  // The consumers' side of the CTA's n-th item (`careful`: a persistent CTA's careful pass of w), its ring positions
  // from `first`; returns how many it took.
  static __device__ __forceinline__ int Consume(const ForwardArgs& args, const typename Variant::Mods& mods,
                                                const Smem& sm, const Work& w, int n, bool careful, int first, int wg,
                                                int warp_in_wg, int lane) {
    // The ring positions are the same in every thread, but the persistent kernel's sum of earlier works' positions
    // (reruns included) is not one the compiler can prove so; read from one lane, it is, and the stages' addresses
    // and parities stay in uniform registers, where the wgmma descriptors need them (computed per thread and moved
    // over, they cost the loop a sixth of its speed: H200, d 128).
    if constexpr (kPersistent) first = __shfl_sync(0xffffffffu, first, 0);
    const ShapeArgs& s = args.shape;
    const QueryBlockOfCta& cta = w.cta;
    const int tiles = w.tiles, full_begin = w.full_begin, full_end = w.full_end;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = __shfl_sync(0xffffffffu, 64 * wg, 0);  // the warpgroup's first row in the q tile
    const int local_row = row0 + 16 * warp_in_wg + g;  // this thread's rows: local_row and local_row + 8
    int2 keys[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const KeyRange k = cta.mask.Keys(cta.m0 + local_row + 8 * r);
      keys[r] = make_int2(static_cast<int>(k.begin), static_cast<int>(k.end));
    }
    // Tokens: row r's entry, and its flag of whether a tile showed it a key (set by any thread of its quad; read after
    // the passes). The flags start cleared: the quad's own warp orders the clearing before its other threads' sets.
    auto row_token = [&](int r) { return SharedPointer<const int4>(sm.RowTokens())[local_row + 8 * r]; };
    auto row_seen = [&](int r) -> int& { return SharedPointer<int>(sm.RowSeen())[local_row + 8 * r]; };
    if constexpr (kTokens) {
      if (t == 0) row_seen(0) = row_seen(1) = 0;
      __syncwarp();
    }
    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;
    if constexpr (Variant::kHasAlibi) variant.slope = args.alibi_slopes[cta.b * s.num_heads + cta.head];
    variant.mods = mods;
    [[maybe_unused]] int mod_b = 0;
    if constexpr (Variant::kHasMods) mod_b = mods.Batch(cta.b);
    const int diag = static_cast<int>(cta.mask.diag_offset);
    // FP8: q's and k's descales scale every logit: folded into the scale (raw scores: where their product is positive
    // and finite, so the softmax's max is unchanged; else they multiply each score before the mask, as the dequantized
    // product's are), and v's scales the output.
    [[maybe_unused]] float qk_descale = 1.0f, out_scale = 1.0f;
    bool scores_times_descale = false;
    if constexpr (kFp8) {
      const float* descales = args.fp8_descales;  // [3, H]: q's, k's and v's (of the head's kv head), per query head
      qk_descale = descales[cta.head] * descales[s.num_heads + cta.head];
      out_scale = descales[2 * s.num_heads + cta.head] / kPScale;
      scores_times_descale = kRawScores && !(qk_descale > 0.0f && qk_descale <= 3.402823466e38f);
      if (!kRawScores) variant.scale *= qk_descale;
    }
    const float scores_scale = kRawScores && !scores_times_descale ? s.scale * qk_descale : s.scale;
    const float log2_scale = kRawScores ? scores_scale * kLog2e : kLog2e;
    [[maybe_unused]] const float alibi_step = kRawAlibi ? variant.slope / scores_scale : 0.0f;
    // A bias: the rows of its stages the thread reads (a query-broadcast bias's one-row boxes: row 0).
    [[maybe_unused]] int bias_rows[2];
    if constexpr (kBias) {
#pragma unroll
      for (int r = 0; r < 2; ++r) bias_rows[r] = args.bias.query_stride == 0 ? 0 : local_row + 8 * r;
    }
    // The row position the variant sees: the token's with packed sequences, else the diagonal's.
    auto row_position = [&](int r) -> typename Variant::Position {
      if constexpr (kTokens) {
        return row_token(r).w;
      } else {
        return cta.m0 + local_row + 8 * r + diag;
      }
    };

    float o[kDvP / 8][4];
    OnlineSoftmax<kBlockN / 8> softmax;
    uint32_t p[kPvSteps][4];
    float sc[kBlockN / 8][4];

    // Hands a stage back to the producer once every warp of the consumer warpgroups is done with it.
    auto release = [&](uint32_t bar) { ReleaseStage(bar, lane); };
    // Tokens: whether tile `tile` (ring position `at`, its k landed) is interior, every row seeing every key of it by
    // the index range and by the tokens' summaries. Asked before q k^T, where no logits are live: held through the
    // logits, the summaries made the d = 128 kernel spill.
    auto tokens_interior = [&](int tile, int at) {
      if (tile < full_begin || tile >= full_end) return false;
      const TokenSummary cta_rows =
          TokenSummaryOf(SharedPointer<const int32_t>(sm.RowSummaries()), 0, kBlockM, s.seqlen_q - cta.m0);
      const TokenSummary tile_keys = TokenSummaryOf(SharedPointer<const int32_t>(sm.KeySummaries(TokenStageOf(at))), 0,
                                                    kBlockN, s.seqlen_kv - tile * kBlockN);
      return TokensAllSee(cta_rows, tile_keys);
    };
    // The mask and variant on a tile of raw products (ring position `at`), then the online softmax: sc becomes p
    // (unnormalised, float). With tokens, `interior` is tokens_interior's answer; in the careful pass, the p of a key a
    // row does not see becomes -0 (CarefulPV).
    auto logits_to_probabilities = [&](int tile, int at, bool interior, float (&rescale)[2], auto careful) {
      constexpr bool kMarkUnseen = kTokens && decltype(careful)::kValue;
      const int n0 = tile * kBlockN;
      if constexpr (kFp8) {
        if (scores_times_descale) {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[j][e] *= qk_descale;
        }
      }
      // Tokens: pairs[4 j + t] holds the entries of the thread's two keys of n8 tile j (columns 8 j + 2 t, + 1).
      [[maybe_unused]] const int4* pairs = nullptr;
      if constexpr (kTokens) pairs = SharedPointer<const int4>(sm.KeyEntries(TokenStageOf(at)));
      // Element e of n8 tile j: its key's entry (tokens) and the key position the variant sees.
      auto key_token = [&](int j, int e) {
        const int4 pair = pairs[4 * j + t];
        return e & 1 ? make_int2(pair.z, pair.w) : make_int2(pair.x, pair.y);
      };
      // A mask_mod: a tile is interior, and spared the mask_mod, only where the block mask's blocks all keep every pair.
      bool blocks_visible = true;
      if constexpr (Variant::kHasMaskMod) {
        blocks_visible = variant.mods.AllVisible(mod_b, cta.head, cta.m0, cta.m0 + kBlockM, n0, n0 + kBlockN);
      }
      // Element e of n8 tile j as the mods see it.
      [[maybe_unused]] auto mod_at = [&](int j, int e) {
        return ModIndex{mod_b, cta.head, cta.m0 + local_row + 8 * (e >> 1), n0 + 8 * j + 2 * t + (e & 1)};
      };
      auto key_position = [&](int j, int e) -> typename Variant::Position {
        if constexpr (kTokens) {
          return key_token(j, e).y;
        } else {
          return n0 + 8 * j + 2 * t + (e & 1);
        }
      };
      // Tokens: whether the thread's row of element e of n8 tile j (entry rows[e / 2]) sees its key, by the index range
      // and the tokens. No short cut: a load behind one is predicated and not shared between elements.
      auto sees = [&](int j, int e, const int4 (&rows)[2]) {
        const int r = e >> 1, col = n0 + 8 * j + 2 * t + (e & 1);
        return (col >= keys[r].x) & (col < keys[r].y) & TokenSees(rows[r], key_token(j, e));
      };
      // A bias: every element's logit, the variant's plus the bias, once the tile's bias stage has landed; the stage
      // goes back to the producer right after.
      auto biased_logits = [&]() {
        if constexpr (kBias) {
          const BiasStage bias = sm.Bias(StageOf(at));
          MbarrierWait(sm.BiasFull(StageOf(at)), ParityOf(at));
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const float2 b = bias.Pair(bias_rows[r], 8 * j + 2 * t);
              sc[j][2 * r] = variant.Logit(sc[j][2 * r], row_position(r), key_position(j, 2 * r)) + b.x;
              sc[j][2 * r + 1] = variant.Logit(sc[j][2 * r + 1], row_position(r), key_position(j, 2 * r + 1)) + b.y;
            }
          release(sm.BiasEmpty(StageOf(at)));
        }
      };
      // ALiBi on raw scores: row r's term from the thread's first column of the tile.
      [[maybe_unused]] AlibiOverScale alibi[2];
      if constexpr (kRawAlibi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) alibi[r] = AlibiOverScale::At(alibi_step, n0 + 2 * t - row_position(r));
      }
      // A tile every row fully sees: the variant alone (raw scores need nothing but ALiBi's term).
      auto interior_tile = [&]() {
        if constexpr (kTokens) row_seen(0) = row_seen(1) = 1;
        if constexpr (kBias) {
          biased_logits();
        } else if constexpr (kRawAlibi) {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[j][e] += alibi[e >> 1].Term(8 * j + (e & 1));
        } else if constexpr (!kRawScores) {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[j][e] = variant.Logit(sc[j][e], row_position(e >> 1), key_position(j, e));
        }
        if constexpr (kScoreMod) {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[j][e] = variant.mods.Score(sc[j][e], mod_at(j, e));
        }
      };
      // Any other tile: the per-element mask, -inf where a row does not see a key.
      auto masked_tile = [&]() {
        [[maybe_unused]] bool seen[2] = {false, false};
        [[maybe_unused]] int4 rows[2];
        if constexpr (kTokens) {
          rows[0] = row_token(0);
          rows[1] = row_token(1);
        }
        biased_logits();
        // Without tokens a row sees the keys of its index range. Where no row of the warp has its range begin after
        // the tile's first key (causal masks; windows away from their left edge), one test per element suffices: the
        // element's column offset (a constant) against the range's end, taken from the thread's first column.
        [[maybe_unused]] int end_from_first[2];
        if constexpr (!kTokens) {
#pragma unroll
          for (int r = 0; r < 2; ++r) end_from_first[r] = keys[r].y - (n0 + 2 * t);
        }
        auto mask_elements = [&](auto ends_only) {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int r = e >> 1, col = n0 + 8 * j + 2 * t + (e & 1);
              float logit = sc[j][e];
              if constexpr (!kRawScores && !kBias) logit = variant.Logit(logit, row_position(r), key_position(j, e));
              if constexpr (kRawAlibi) logit += alibi[r].Term(8 * j + (e & 1));
              if constexpr (kScoreMod) logit = variant.mods.Score(logit, mod_at(j, e));
              bool visible;
              if constexpr (kTokens) {
                visible = sees(j, e, rows);
                seen[r] |= visible;
              } else if constexpr (decltype(ends_only)::kValue) {
                visible = 8 * j + (e & 1) < end_from_first[r];
              } else {
                visible = col >= keys[r].x && col < keys[r].y;
              }
              if constexpr (Variant::kHasMaskMod) {
                if (!blocks_visible) visible = visible && variant.mods.Mask(mod_at(j, e));
              }
              sc[j][e] = visible ? logit : -__int_as_float(0x7f800000);
            }
        };
        // Mods keep one copy of the element loop: their code per element outweighs the test saved, and a copy more
        // of it adds seconds to the first compile of a new mod.
        if constexpr (Variant::kHasMods) {
          mask_elements(BoolConstant<false>{});
        } else if (!kTokens && __all_sync(0xffffffffu, keys[0].x <= n0 && keys[1].x <= n0)) {
          mask_elements(BoolConstant<true>{});
        } else {
          mask_elements(BoolConstant<false>{});
        }
        if constexpr (kTokens) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (seen[r]) row_seen(r) = 1;
          }
        }
      };
      // The test written twice: without tokens, the kernels keep the exact code they had before tokens existed.
      if constexpr (kTokens) {
        interior = interior && blocks_visible;
        if (interior) {
          interior_tile();
        } else {
          masked_tile();
        }
        softmax.Update(sc, log2_scale, rescale);
        if constexpr (kMarkUnseen) {
          if (!interior) {
            const int4 rows[2] = {row_token(0), row_token(1)};
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) sc[j][e] = sees(j, e, rows) ? sc[j][e] : -0.0f;
          }
        }
      } else {
        if (tile >= full_begin && tile < full_end && blocks_visible) {
          interior_tile();
        } else {
          masked_tile();
        }
        softmax.Update(sc, log2_scale, rescale);
      }
    };
    // Dropout: the keep bits of the thread's two rows over a tile's keys, 64 keys a word (dropout.h's TileBits), and
    // p scaled by them.
    [[maybe_unused]] KernelDropout dropout;
    [[maybe_unused]] uint32_t keep_bits[kBlockN / 64];
    if constexpr (kDropout) dropout = KernelDropout::Of(args.dropout);
    auto draw_keep_bits = [&](int tile) {
      if constexpr (kDropout) {
#pragma unroll
        for (int h = 0; h < kBlockN / 64; ++h) {
          const int col0 = tile * kBlockN + 64 * h + 2 * t;
          keep_bits[h] = dropout.TileBits<8, false>(cta.b, cta.head, cta.m0 + local_row, col0);
        }
      }
    };
    auto to_operand = [&]() {
      if constexpr (kDropout) {
#pragma unroll
        for (int h = 0; h < kBlockN / 64; ++h)
#pragma unroll
          for (int j = 0; j < 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              sc[8 * h + j][e] *= dropout.Factor(keep_bits[h], 2 * ((e >> 1) * 8 + j) + (e & 1));
            }
      }
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        if constexpr (kFp8) {
          PackFp8AFragment<E4M3>(sc, kk, kPScale, p[kk]);
        } else {
          PackAFragment<Element>(sc, kk, p[kk]);
        }
      }
    };

    // Every register the products touch, pinned before a WgmmaFence (wgmma.h).
    auto fence_registers = [&]() {
      FenceOperands(reinterpret_cast<float(&)[kBlockN / 2]>(sc));
      FenceOperands(reinterpret_cast<float(&)[kDvP / 2]>(o));
      FenceOperands(p);
      WgmmaFence();
    };

    // The work's q buffer (persistent kernels alternate two).
    const int buffer = n % kQBuffers;
    const QTile q = sm.Q(buffer);
    MbarrierWait(sm.QFull(buffer), (n / kQBuffers) & 1);
    // The first warpgroup takes the first turn. All issue the same number of product groups per pass, so the one
    // extra hand-over (the last's last) is the next work's first turn.
    if (n == 0 && wg == kConsumers - 1) PassTurn<kConsumers>(wg);

    // One pass over the CTA's tiles; ring positions count on from `first` (the second pass follows the first).
    auto pass = [&](auto careful, int first) {
      constexpr bool kCareful = decltype(careful)::kValue;
      softmax.Reset();
#pragma unroll
      for (int j = 0; j < kDvP / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
      if (tiles == 0) return;
      // o += p v of the tile in ring position i (its v has landed): on the tensor cores, or key by key in the careful
      // pass. The careful pass takes the slow product for every tile, not only the straddling ones: a wgmma behind a
      // run-time branch makes ptxas serialise every wgmma of the kernel.
      auto product = [&](int tile, int i) {
        if constexpr (kCareful) {
          CarefulPV(o, p, sm, StageOf(i), tile * kBlockN, keys, lane);
          WgmmaCommit();  // an empty group, so the wait counts below hold
        } else {
          IssuePV(o, p, sm, StageOf(i));
        }
      };

      int i = first;
      MbarrierWait(sm.KFull(StageOf(i)), ParityOf(i));
      bool interior = kTokens && tokens_interior(cta.tile_begin, i);
      WaitTurn(wg);
      fence_registers();
      IssueQKt(sc, q, sm, row0, StageOf(i));
      PassTurn<kConsumers>(wg);
      draw_keep_bits(cta.tile_begin);
      WgmmaWait<0>();
      FenceOperands(reinterpret_cast<float(&)[kBlockN / 2]>(sc));
      release(sm.KEmpty(StageOf(i)));
      {
        float rescale[2];
        logits_to_probabilities(cta.tile_begin, i, interior, rescale, careful);
      }
      to_operand();
      for (int tile = cta.tile_begin + 1; tile < cta.tile_end; ++tile, ++i) {
        const int next = StageOf(i + 1);
        MbarrierWait(sm.KFull(next), ParityOf(i + 1));
        interior = kTokens && tokens_interior(tile, i + 1);
        MbarrierWait(sm.VFull(StageOf(i)), ParityOf(i));
        WaitTurn(wg);
        fence_registers();
        IssueQKt(sc, q, sm, row0, next);
        product(tile - 1, i);
        PassTurn<kConsumers>(wg);
        draw_keep_bits(tile);
        WgmmaWait<1>();  // q k^T of this tile is done; p v of the previous one may still run
        FenceOperands(reinterpret_cast<float(&)[kBlockN / 2]>(sc));
        release(sm.KEmpty(next));
        float rescale[2];
        logits_to_probabilities(tile, i + 1, interior, rescale, careful);
        WgmmaWait<0>();
        FenceOperands(reinterpret_cast<float(&)[kDvP / 2]>(o));
        release(sm.VEmpty(StageOf(i)));
#pragma unroll
        for (int j = 0; j < kDvP / 8; ++j) {
          o[j][0] *= rescale[0];
          o[j][1] *= rescale[0];
          o[j][2] *= rescale[1];
          o[j][3] *= rescale[1];
        }
        to_operand();
      }
      MbarrierWait(sm.VFull(StageOf(i)), ParityOf(i));
      WaitTurn(wg);
      fence_registers();
      product(cta.tile_end - 1, i);
      PassTurn<kConsumers>(wg);
      WgmmaWait<0>();
      FenceOperands(reinterpret_cast<float(&)[kDvP / 2]>(o));
      release(sm.VEmpty(StageOf(i)));
    };

    // Only a work whose tiles straddle a range edge may rerun. One CTA per block votes and reruns at once; a persistent
    // CTA's warps ask for the careful pass as a later item, and go on to the next item without waiting for one another.
    // That item takes the first pass too (a rare item's waste; a first pass behind a branch made the loop rebuild its
    // q descriptors each iteration).
    pass(BoolConstant<false>{}, first);
    bool rerun;
    if constexpr (kPersistent) {
      if (!careful && w.straddles && __any_sync(0xffffffffu, AnyNaN(o) || softmax.AnyNaN()) && lane == 0) {
        atomicOr(&sm.Item(buffer), kRerunAsked);
      }
      rerun = careful;
    } else {
      rerun = w.straddles && CtaAny<kVoters>(AnyNaN(o) || softmax.AnyNaN());
    }
    if (rerun) pass(BoolConstant<true>{}, first + tiles);
    if constexpr (kPersistent) release(sm.QEmpty(buffer));  // after the request: read once the buffer is released

    const int64_t o_stride = static_cast<int64_t>(s.num_heads) * kDv;
    uint16_t* out = static_cast<uint16_t*>(args.out) + static_cast<int64_t>(cta.b) * s.seqlen_q * o_stride + cta.head * kDv;
    bool sees_keys[2] = {keys[0].x < keys[0].y, keys[1].x < keys[1].y};
    if constexpr (kTokens) {
      __syncwarp();  // the quad's flags are set
#pragma unroll
      for (int r = 0; r < 2; ++r) sees_keys[r] = row_seen(r) != 0;
    }
    float inv_sum[2], lse[2];
    if constexpr (kBias || Variant::kHasMods) {  // a -inf bias, score or hidden key can leave a row no probability
      softmax.FinishWithBias(sees_keys, inv_sum, lse);
    } else {
      softmax.Finish(sees_keys, inv_sum, lse);
    }
    MergeRowSinks(args.sinks, static_cast<int64_t>(cta.b) * s.num_heads + cta.head, inv_sum, lse);
    // A document work's rows end with its document (the rows past it are the next one's).
    const int row_end = kDocuments ? static_cast<int>(cta.mask.q_len) : s.seqlen_q;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = cta.m0 + local_row + 8 * r;
      if (row >= row_end) continue;
      uint16_t* out_row = out + row * o_stride;
#pragma unroll
      for (int j = 0; j < kDvP / 8; ++j) {
        const int col = 8 * j + 2 * t;
        if (col < kDv) {
          const uint32_t packed = cta.len.invalid ? kPackedNaN
                                  : sees_keys[r]  ? Element::Pack(o[j][2 * r] * (inv_sum[r] * out_scale),
                                                                  o[j][2 * r + 1] * (inv_sum[r] * out_scale))
                                                  : 0u;
          *reinterpret_cast<uint32_t*>(out_row + col) = packed;
        }
      }
      if (t == 0) {
        args.lse[(static_cast<int64_t>(cta.b) * s.num_heads + cta.head) * s.seqlen_q + row] =
            cta.len.invalid ? __int_as_float(0x7fffffff) : lse[r];
      }
    }
    return rerun ? 2 * tiles : tiles;
  }
};

}  // namespace te_jax::cuda::sm90
