// Backward flash attention, sm80 family. Launched in order on one stream, either
//   deterministic: 1. Preprocess: delta_i - dlse_i (delta_i = rowsum(dout * out)) into a float scratch that aliases dq.
//     2. DkDv: a CTA owns 16 * kWarps keys of one kv head, visits every query tile (of every head of its GQA group) that
//        sees them and accumulates dk, dv in registers: s^T = k q^T, p^T = exp(s^T - lse), dp^T = v dout^T,
//        ds^T = p^T (dp^T - delta + dlse) dlogit, dv += p^T dout, dk += ds^T q. No atomics: GQA sums stay in registers.
//     3. Dq: a CTA owns 16 * kWarps queries and visits their key tiles: dq += ds k (recomputing s and dp), then writes
//        dq over the scratch (kernel 2 has finished with it by stream order; each CTA recomputes its own rows' delta).
//     Every output element is written once by one thread, in a fixed summation order.
//   or fast (the default): 1. Preprocess as above, which also zeroes a float dq accumulator (the call's workspace).
//     2. DkDv with kAccumulateDq: as above, and each step stages ds^T in shared memory and adds its ds k to the
//        accumulator with float atomics (FlashAttention-2's scheme): s and dp are computed once, not twice, at the
//        price of an addition order, and so dq's last bits, that vary between runs.
//     3. DqConvert: the accumulator to dq's element type.
//   With an additive bias (the variant's Bias) both add it to each recomputed logit, and the DkDv kernel turns each
//   step's dS before the logit's derivative into dbias (kernels/sm80/bias_tile.h): written directly when no dim of the
//   bias is broadcast, else added to a float accumulator of the bias's shape that the preprocess zeroes and a last
//   kernel (BiasGradConvert) converts.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/backward_row_kernels.cuh"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/dq_accum.h"
#include "cpp/cuda/kernels/common/dropout.h"
#include "cpp/cuda/kernels/common/online_softmax.h"
#include "cpp/cuda/kernels/common/probability_grad.h"
#include "cpp/cuda/kernels/common/token_mask.h"
#include "cpp/cuda/kernels/primitives/bulk_reduce.h"
#include "cpp/cuda/kernels/primitives/padded_tile.h"
#include "cpp/cuda/kernels/primitives/warp_gemm.h"
#include "cpp/cuda/kernels/sm80/bias_tile.h"
#include "cpp/cuda/kernels/sm80/key_token_stage.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"

namespace te_jax::cuda::sm80 {

// Adds (lo, hi) to two adjacent floats in global memory without reading them back (sm90: one vector reduction).
__device__ __forceinline__ void RedAddPair(float* p, float lo, float hi) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(lo), "f"(hi) : "memory");
#else
  atomicAdd(p, lo);
  atomicAdd(p + 1, hi);
#endif
}

template <typename Element, int kD, int kDv, typename Variant, bool kAccumulateDq>
struct BackwardDkDvKernel {
  static constexpr bool kBias = Variant::kHasBias;
  static constexpr TileSize kTile = BackwardDkDvTileSize(kD, kDv, kAccumulateDq, kBias);
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kTile.block_m;  // keys
  static constexpr int kBlockN = kTile.block_n;  // queries per visited tile
  static constexpr int kSlices = kTile.slices;
  static constexpr int kDP = PadHeadDim(kD);
  static constexpr int kDvP = PadHeadDim(kDv);
  // Columns of dk / dv this CTA accumulates: slice * kDkCols .. (clipped to the padded head dim). The slice's dq
  // columns are dk's.
  static constexpr int kDkCols = (kDP / 16 + kSlices - 1) / kSlices * 16;
  static constexpr int kDvCols = (kDvP / 16 + kSlices - 1) / kSlices * 16;
  using KTile = PaddedTile<kBlockM, kDP>;
  using VTile = PaddedTile<kBlockM, kDvP>;
  using QTile = PaddedTile<kBlockN, kDP>;
  using OTile = PaddedTile<kBlockN, kDvP>;
  using DsTile = PaddedTile<kBlockM, kBlockN>;  // ds^T of the step, [key][query]
  static constexpr bool kTokens = Variant::kHasTokens;
  // The step's bias tile [queries][keys], and its dS for dbias (kernels/sm80/bias_tile.h).
  using BiasStage = BiasTile<typename Variant::Bias, kBlockN, kBlockM>;
  using BiasGrad = BiasGradTile<typename Variant::Bias, kBlockN, kBlockM, kThreads>;
  // A stage: q, dout, the rows' lse and delta', with tokens the rows' token entries (kernels/common/token_mask.h), with
  // a bias its tile.
  static constexpr int kStageBytes = QTile::kBytes + OTile::kBytes + 2 * 4 * kBlockN + (kTokens ? 16 * kBlockN : 0) +
                                     (kBias ? BiasStage::kBytes : 0);
  static constexpr int kSmemBytes = KTile::kBytes + VTile::kBytes + 2 * kStageBytes +
                                    (kAccumulateDq ? DsTile::kBytes : 0) + (kBias ? BiasGrad::kBytes : 0);
  static_assert(kBlockM == 16 * kWarps, "a warp owns 16 keys");
  static_assert(kSmemBytes == BackwardDkDvSmemBytes(kD, kDv, kAccumulateDq, kTokens, kBias ? Variant::Bias::kBytes : 0),
                "tile_size.h and the kernel disagree on shared memory");

  // The step's dq product [kBlockN queries x kDkCols] = ds [kBlockN x kBlockM keys] k [kBlockM x kDkCols] is split
  // over kDqWarpsM x kDqWarpsN warps of 32 queries (two m tiles, so each k fragment feeds two mma pairs) x kDqCols
  // columns. With small head dims some warps get no columns.
  static constexpr int kDqWarpsM = kBlockN / 32;
  static constexpr int kDqWarpsN = kWarps / kDqWarpsM;
  static constexpr int kDqCols = (kDkCols / 16 + kDqWarpsN - 1) / kDqWarpsN * 16;
  static_assert(kBlockN % 32 == 0 && kWarps % kDqWarpsM == 0, "dq warp layout");
  using Accum = DqAccum<kD, kDv>;
  static_assert(!kAccumulateDq || (Accum::kLayout.slices == kSlices && Accum::kLayout.cols == kDkCols &&
                                   Accum::kLayout.row_block % kBlockN == 0),
                "tile_size.h's dq accumulator layout and the kernel disagree");
  // Each step's dq block goes through shared memory (the step's q/dout space, free by then) to one bulk reduction where
  // the GPU has it and the block fits; otherwise every thread adds its fragments with atomics.
  static constexpr bool kBulkDq =
      kAccumulateDq && kHasBulkReduce && kBlockN * kDkCols * 4 <= QTile::kBytes + OTile::kBytes;

  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    extern __shared__ __align__(16) unsigned char smem[];
    const ShapeArgs& s = args.shape;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * kBlockM, kv_head = blockIdx.y;
    const int b = blockIdx.z / kSlices, slice = blockIdx.z % kSlices;
    const int group = s.num_heads / s.num_kv_heads;
    const int dk0 = slice * kDkCols, dv0 = slice * kDvCols;

    const BatchLengths len = ReadLengths(s, args.q_seqlens, args.kv_seqlens, b);
    const RowMask mask = MakeMask(s, len);
    const RowSpan rows = RowsOfKeys(mask, n0, n0 + kBlockM);
    const int tile_begin0 = rows.begin / kBlockN;
    int tile_begin = tile_begin0;
    int tile_end = rows.end > rows.begin ? (rows.end + kBlockN - 1) / kBlockN : tile_begin0;
    BatchTokens tokens{};
    // The CTA's keys' token entries (past Skv: a key no row sees).
    int2 key_token[2] = {};
    if constexpr (kTokens) {
      tokens = BatchTokens::Of(args.tokens, s, b);
      NarrowToTokenSpan(TokenTileSpan<kBlockN>(tokens.kv_span, n0, kBlockM, s.seqlen_kv), tile_begin, tile_end);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = n0 + warp * 16 + g + 8 * r;
        key_token[r] = j < s.seqlen_kv ? tokens.keys[j] : make_int2(0, 0);
      }
    }
    const int tiles = tile_end - tile_begin;
    const int steps = tiles * group;  // (head, query tile) pairs, head-major

    const int64_t q_stride = static_cast<int64_t>(s.num_heads) * kD;
    const int64_t o_stride = static_cast<int64_t>(s.num_heads) * kDv;
    const int64_t k_stride = static_cast<int64_t>(s.num_kv_heads) * kD;
    const int64_t v_stride = static_cast<int64_t>(s.num_kv_heads) * kDv;
    const uint16_t* k = static_cast<const uint16_t*>(args.k) + static_cast<int64_t>(b) * s.seqlen_kv * k_stride + kv_head * kD;
    const uint16_t* v = static_cast<const uint16_t*>(args.v) + static_cast<int64_t>(b) * s.seqlen_kv * v_stride + kv_head * kDv;
    const uint16_t* q_batch = static_cast<const uint16_t*>(args.q) + static_cast<int64_t>(b) * s.seqlen_q * q_stride;
    const uint16_t* do_batch = static_cast<const uint16_t*>(args.dout) + static_cast<int64_t>(b) * s.seqlen_q * o_stride;

    KTile k_tile{reinterpret_cast<uint16_t*>(smem)};
    VTile v_tile{reinterpret_cast<uint16_t*>(smem + KTile::kBytes)};
    unsigned char* stage_base = smem + KTile::kBytes + VTile::kBytes;
    const DsTile ds_tile{reinterpret_cast<uint16_t*>(stage_base + 2 * kStageBytes)};
    auto q_tile = [&](int st) { return QTile{reinterpret_cast<uint16_t*>(stage_base + st * kStageBytes)}; };
    auto o_tile = [&](int st) { return OTile{reinterpret_cast<uint16_t*>(stage_base + st * kStageBytes + QTile::kBytes)}; };
    auto lse_s = [&](int st) {
      return reinterpret_cast<float*>(stage_base + st * kStageBytes + QTile::kBytes + OTile::kBytes);
    };
    auto delta_s = [&](int st) { return lse_s(st) + kBlockN; };
    auto row_tokens_s = [&](int st) { return reinterpret_cast<int4*>(delta_s(st) + kBlockN); };
    auto bias_s = [&](int st) { return BiasStage{SmemAddress(row_tokens_s(st) + (kTokens ? kBlockN : 0))}; };
    const BiasGrad bias_grad{SmemAddress(stage_base + 2 * kStageBytes + (kAccumulateDq ? DsTile::kBytes : 0))};

    // Loads the q, dout, lse and delta' of step `step` into stage `st`.
    auto load_step = [&](int step, int st) {
      const int head = kv_head * group + step / tiles;
      const int m0 = (tile_begin + step % tiles) * kBlockN;
      q_tile(st).template AsyncLoad<kThreads>(q_batch + head * kD, q_stride, m0, len.q_len, kD, tid);
      o_tile(st).template AsyncLoad<kThreads>(do_batch + head * kDv, o_stride, m0, len.q_len, kDv, tid);
      const int64_t row_base = (static_cast<int64_t>(b) * s.num_heads + head) * s.seqlen_q;
      for (int i = tid; i < kBlockN; i += kThreads) {
        const bool valid = m0 + i < len.q_len;
        CpAsync4(SmemAddress(lse_s(st) + i), args.lse + (valid ? row_base + m0 + i : 0), valid);
        CpAsync4(SmemAddress(delta_s(st) + i), args.delta_scratch + (valid ? row_base + m0 + i : 0), valid);
        // A row past Sq is zero-filled; the index range already hides every key from it.
        if constexpr (kTokens) CpAsync16(SmemAddress(row_tokens_s(st) + i), tokens.q_rows + (valid ? m0 + i : 0), valid);
      }
      if constexpr (kBias) bias_s(st).template Load<kThreads>(BiasRows::Of(args.bias, b, head), m0, n0, s.seqlen_q, tid);
    };

    k_tile.template AsyncLoad<kThreads>(k, k_stride, n0, len.kv_len, kD, tid);
    v_tile.template AsyncLoad<kThreads>(v, v_stride, n0, len.kv_len, kDv, tid);
    if (steps > 0) load_step(0, 0);
    CpAsyncCommit();

    const int key[2] = {n0 + warp * 16 + g, n0 + warp * 16 + g + 8};
    const int key_local[2] = {warp * 16 + g, warp * 16 + g + 8};
    float dk[1][kDkCols / 8][4], dv[1][kDvCols / 8][4];
    ZeroFragments(dk);
    ZeroFragments(dv);

    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;

    for (int step = 0; step < steps; ++step) {
      const int st = step & 1;
      const int head = kv_head * group + step / tiles;
      const int m0 = (tile_begin + step % tiles) * kBlockN;
      CpAsyncWait<0>();
      // The previous step's bulk reduction must have read its block before step + 1's loads land there.
      if constexpr (kBulkDq) {
        if (tid == 0) BulkWaitSharedRead();
      }
      __syncthreads();
      if (step + 1 < steps) load_step(step + 1, st ^ 1);
      CpAsyncCommit();
      if constexpr (Variant::kHasAlibi) variant.slope = args.alibi_slopes[b * s.num_heads + head];
      const QTile qt = q_tile(st);
      const OTile ot = o_tile(st);
      const float* lse = lse_s(st);
      const float* delta = delta_s(st);
      const int4* row_tokens = row_tokens_s(st);
      BiasRows bias{};
      if constexpr (kBias) bias = BiasRows::Of(args.bias, b, head);
      const BiasStage bias_tile = bias_s(st);

      // s^T = k q^T and dp^T = v dout^T: this warp's 16 keys x kBlockN queries.
      float sc[1][kBlockN / 8][4], dp[1][kBlockN / 8][4];
      ZeroFragments(sc);
      ZeroFragments(dp);
      WarpGemmABt<Element, 1, kDP, kBlockN>(sc, k_tile, warp * 16, qt, lane);
      WarpGemmABt<Element, 1, kDvP, kBlockN>(dp, v_tile, warp * 16, ot, lane);

      // Dropout's keep bits of this warp's keys x the step's queries (the tile is transposed: keys along its rows).
      [[maybe_unused]] KernelDropout dropout;
      [[maybe_unused]] uint32_t keep_bits = 0;
      if constexpr (Variant::kHasDropout) {
        dropout = KernelDropout::Of(args.dropout);
        keep_bits = dropout.TileBits<kBlockN / 8, true>(b, head, key[0], m0 + 2 * t);
      }
      // Interior steps (every query sees every key of the CTA) skip the per-element mask.
      auto apply = [&](auto masked) {
        // The step's queries that see each of the thread's two keys, from its first query (m0 + 2 t).
        [[maybe_unused]] ColumnRange seen[2];
        if constexpr (decltype(masked)::value) {
#pragma unroll
          for (int r = 0; r < 2; ++r) seen[r] = ColumnsFrom(mask.Rows(key[r]), m0 + 2 * t, kBlockN);
        }
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = j * 8 + 2 * t + (e & 1);  // query within the tile
            const int row = m0 + qi;
            const int kj = key[e >> 1];
            bool visible = decltype(masked)::value ? seen[e >> 1].Contains(8 * j + (e & 1)) : true;
            int64_t row_pos = row + mask.diag_offset;
            int key_pos = kj;
            if constexpr (kTokens) {
              const int4 row_token = row_tokens[qi];
              if constexpr (decltype(masked)::value) visible = visible && TokenSees(row_token, key_token[e >> 1]);
              row_pos = row_token.w;
              key_pos = key_token[e >> 1].y;
            }
            float keep = 1.0f;
            if constexpr (Variant::kHasDropout) keep = dropout.Factor(keep_bits, 2 * ((e >> 1) * (kBlockN / 8) + j) + (e & 1));
            float bias_value = 0.0f;
            if constexpr (kBias) bias_value = BiasStage::Value(bias_tile.Row(bias, m0, qi), key_local[e >> 1]);
            const float dlogit = ProbabilityGrad<Variant>::Apply(variant, sc[0][j][e], dp[0][j][e], row_pos, key_pos,
                                                                 visible, lse[qi], delta[qi], bias_value, keep);
            if constexpr (kBias) bias_grad.Store(qi, key_local[e >> 1], dlogit);
          }
        }
      };
      bool unmasked = KeysOfRows(mask, m0, kBlockN).Unmasked(n0, kBlockM);
      if constexpr (kTokens) {
        unmasked = unmasked && TokensAllSee(TokenSummaryOf(tokens.q_summary, m0, kBlockN, s.seqlen_q),
                                            TokenSummaryOf(tokens.kv_summary, n0, kBlockM, s.seqlen_kv));
      }
      if (!unmasked) {
        apply(Masked<true>{});
      } else {
        apply(Masked<false>{});
      }

      // dv += p^T dout and dk += ds^T q over this step's queries (the k extent of both products).
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t pa[1][4], da[1][4];
        PackAFragment<Element>(sc[0], kk, pa[0]);
        PackAFragment<Element>(dp[0], kk, da[0]);
        if constexpr (kAccumulateDq) {
          // ds^T to shared memory for the dq product, which sums over every warp's keys.
          ds_tile.StorePair(warp * 16 + g, kk * 16 + 2 * t, da[0][0]);
          ds_tile.StorePair(warp * 16 + g + 8, kk * 16 + 2 * t, da[0][1]);
          ds_tile.StorePair(warp * 16 + g, kk * 16 + 8 + 2 * t, da[0][2]);
          ds_tile.StorePair(warp * 16 + g + 8, kk * 16 + 8 + 2 * t, da[0][3]);
        }
        WarpMmaRegA<Element, 1, kDvCols>(dv, pa, ot, kk * 16, dv0, kDvP, lane);
        WarpMmaRegA<Element, 1, kDkCols>(dk, da, qt, kk * 16, dk0, kDP, lane);
      }

      if constexpr (kAccumulateDq) {
        __syncthreads();  // ds^T is complete, and this stage's q and dout have been read
        AddStepDq(ds_tile, k_tile, reinterpret_cast<float*>(stage_base + st * kStageBytes),
                  args.dq_accum + Accum::Offset(s, b, head, slice, m0), len.q_len - m0, dk0, tid);
      } else if constexpr (kBias) {
        __syncthreads();  // the step's dS for dbias is complete
      }
      // The next step's first barrier keeps its stores from overwriting the tile before this flush has read it. Column
      // slices recompute the same dS: the first one adds it.
      if constexpr (kBias) {
        if (slice == 0) bias_grad.Flush(BiasGradTarget<typename Variant::Bias>::Of(args, b, head), m0, n0, s.seqlen_q,
                                        s.seqlen_kv, len.invalid, tid);
      }
    }
    if constexpr (kBias) {
      if (slice == 0 && args.dbias_accum == nullptr) {
        for (int i = 0; i < group; ++i) {
          ZeroUnvisitedBiasGrad<typename Variant::Bias, kBlockM, kThreads>(
              BiasGradTarget<typename Variant::Bias>::Of(args, b, kv_head * group + i), tile_begin * kBlockN,
              tile_end * kBlockN, n0, s.seqlen_q, s.seqlen_kv, len.invalid, tid);
        }
      }
    }
    CpAsyncWait<0>();
    if constexpr (kBulkDq) {
      if (tid == 0) BulkWaitComplete();
    }

    uint16_t* dk_out = static_cast<uint16_t*>(args.dk) + static_cast<int64_t>(b) * s.seqlen_kv * k_stride + kv_head * kD;
    uint16_t* dv_out = static_cast<uint16_t*>(args.dv) + static_cast<int64_t>(b) * s.seqlen_kv * v_stride + kv_head * kDv;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (key[r] >= s.seqlen_kv) continue;
#pragma unroll
      for (int j = 0; j < kDkCols / 8; ++j) {
        const int col = dk0 + j * 8 + 2 * t;
        if (col < kD) {
          *reinterpret_cast<uint32_t*>(dk_out + key[r] * k_stride + col) =
              len.invalid ? kPackedNaN : Element::Pack(dk[0][j][2 * r], dk[0][j][2 * r + 1]);
        }
      }
#pragma unroll
      for (int j = 0; j < kDvCols / 8; ++j) {
        const int col = dv0 + j * 8 + 2 * t;
        if (col < kDv) {
          *reinterpret_cast<uint32_t*>(dv_out + key[r] * v_stride + col) =
              len.invalid ? kPackedNaN : Element::Pack(dv[0][j][2 * r], dv[0][j][2 * r + 1]);
        }
      }
    }
  }

  // Adds the step's dq block, ds k over this CTA's keys and this slice's columns [dk0, dk0 + kDkCols), to the
  // accumulator block of its kBlockN queries (`block`; rows [valid_rows, kBlockN) get zeros or nothing). `staging`:
  // this step's q/dout space in shared memory.
  static __device__ __forceinline__ void AddStepDq(const DsTile& ds_tile, const KTile& k_tile, float* staging,
                                                   float* block, int valid_rows, int dk0, int tid) {
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp % kDqWarpsM, wn = warp / kDqWarpsM;
    const int c0 = wn * kDqCols;  // within the slice
    const int col_end = dk0 + kDkCols < kDP ? dk0 + kDkCols : kDP;
    float acc[2][kDqCols / 8][4];
    ZeroFragments(acc);
    if (c0 < kDkCols) {
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        uint32_t a[2][4];
        ds_tile.LoadATrans(wm * 32, kk * 16, lane, a[0]);
        ds_tile.LoadATrans(wm * 32 + 16, kk * 16, lane, a[1]);
        WarpMmaRegA<Element, 2, kDqCols>(acc, a, k_tile, kk * 16, dk0 + c0, col_end, lane);
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int q = wm * 32 + mt * 16 + g + 8 * r;
#pragma unroll
        for (int j = 0; j < kDqCols / 8; ++j) {
          const int col = c0 + j * 8 + 2 * t;
          float* at = (kBulkDq ? staging : block) + q * kDkCols + Accum::Column(q, col);
          if constexpr (kBulkDq) {
            if (col < kDkCols) *reinterpret_cast<float2*>(at) = make_float2(acc[mt][j][2 * r], acc[mt][j][2 * r + 1]);
          } else {
            if (col < kDkCols && dk0 + col < kD && q < valid_rows) {
              RedAddPair(at, acc[mt][j][2 * r], acc[mt][j][2 * r + 1]);
            }
          }
        }
      }
    }
    if constexpr (kBulkDq) {
      FenceSharedForAsyncProxy();
      __syncthreads();
      if (tid == 0) BulkReduceAddF32(block, SmemAddress(staging), kBlockN * kDkCols * 4);
    }
  }
};

template <typename Element, int kD, int kDv, typename Variant>
struct BackwardDqKernel {
  static constexpr bool kBias = Variant::kHasBias;
  static constexpr TileSize kTile = BackwardDqTileSize(kD, kDv, kBias);
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kTile.block_m;  // queries
  static constexpr int kBlockN = kTile.block_n;  // keys per visited tile
  static constexpr int kDP = PadHeadDim(kD);
  static constexpr int kDvP = PadHeadDim(kDv);
  using QTile = PaddedTile<kBlockM, kDP>;
  using OTile = PaddedTile<kBlockM, kDvP>;
  using KTile = PaddedTile<kBlockN, kDP>;
  using VTile = PaddedTile<kBlockN, kDvP>;
  static constexpr bool kTokens = Variant::kHasTokens;
  using BiasStage = BiasTile<typename Variant::Bias, kBlockM, kBlockN>;
  // After the k/v stages: each stage's keys' token entries (with tokens), each stage's bias tile (with a bias), then
  // the rows' delta'.
  static constexpr int kKeyTokensOffset = QTile::kBytes + OTile::kBytes + 2 * (KTile::kBytes + VTile::kBytes);
  static constexpr int kBiasOffset = kKeyTokensOffset + (kTokens ? 2 * 8 * kBlockN : 0);
  static constexpr int kDeltaOffset = kBiasOffset + (kBias ? 2 * BiasStage::kBytes : 0);
  static constexpr int kSmemBytes = kDeltaOffset + 4 * kBlockM;
  static_assert(kBlockM == 16 * kWarps, "a warp owns 16 query rows");
  static_assert(kBiasOffset % 16 == 0, "cp.async needs 16-byte aligned bias stages");
  static_assert(kSmemBytes == BackwardDqSmemBytes(kD, kDv, kTokens, kBias ? Variant::Bias::kBytes : 0),
                "tile_size.h and the kernel disagree on shared memory");

  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    extern __shared__ __align__(16) unsigned char smem[];
    const ShapeArgs& s = args.shape;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const auto [m0, head, b, kv_head, len, mask, span, index_tile_begin, index_tile_end] =
        QueryBlockOf<kBlockM, kBlockN>(s, args.q_seqlens, args.kv_seqlens);
    int tile_begin = index_tile_begin, tile_end = index_tile_end;
    BatchTokens tokens{};
    if constexpr (kTokens) {
      tokens = BatchTokens::Of(args.tokens, s, b);
      NarrowToTokenSpan(TokenTileSpan<kBlockN>(tokens.q_span, m0, kBlockM, s.seqlen_q), tile_begin, tile_end);
    }

    const int64_t q_stride = static_cast<int64_t>(s.num_heads) * kD;
    const int64_t o_stride = static_cast<int64_t>(s.num_heads) * kDv;
    const int64_t k_stride = static_cast<int64_t>(s.num_kv_heads) * kD;
    const int64_t v_stride = static_cast<int64_t>(s.num_kv_heads) * kDv;
    const int64_t q_off = static_cast<int64_t>(b) * s.seqlen_q * q_stride + head * kD;
    const int64_t o_off = static_cast<int64_t>(b) * s.seqlen_q * o_stride + head * kDv;
    const uint16_t* q = static_cast<const uint16_t*>(args.q) + q_off;
    const uint16_t* dout = static_cast<const uint16_t*>(args.dout) + o_off;
    const uint16_t* out = static_cast<const uint16_t*>(args.out) + o_off;
    const uint16_t* k = static_cast<const uint16_t*>(args.k) + static_cast<int64_t>(b) * s.seqlen_kv * k_stride + kv_head * kD;
    const uint16_t* v = static_cast<const uint16_t*>(args.v) + static_cast<int64_t>(b) * s.seqlen_kv * v_stride + kv_head * kDv;

    QTile q_tile{reinterpret_cast<uint16_t*>(smem)};
    OTile o_tile{reinterpret_cast<uint16_t*>(smem + QTile::kBytes)};
    unsigned char* kv_base = smem + QTile::kBytes + OTile::kBytes;
    KTile k_tile[2] = {{reinterpret_cast<uint16_t*>(kv_base)}, {reinterpret_cast<uint16_t*>(kv_base + KTile::kBytes)}};
    VTile v_tile[2] = {{reinterpret_cast<uint16_t*>(kv_base + 2 * KTile::kBytes)},
                       {reinterpret_cast<uint16_t*>(kv_base + 2 * KTile::kBytes + VTile::kBytes)}};
    int2* key_tokens = reinterpret_cast<int2*>(smem + kKeyTokensOffset);
    float* delta_s = reinterpret_cast<float*>(smem + kDeltaOffset);
    BiasRows bias{};
    if constexpr (kBias) bias = BiasRows::Of(args.bias, b, head);
    const int bias_row0 = m0;  // the lambdas' copy (C++17 cannot capture a structured binding)
    auto bias_tile = [&](int stage) { return BiasStage{SmemAddress(smem + kBiasOffset) + stage * BiasStage::kBytes}; };
    auto load_bias = [&](int tile, int stage) {
      if constexpr (kBias) bias_tile(stage).template Load<kThreads>(bias, bias_row0, tile * kBlockN, s.seqlen_q, tid);
    };
    auto load_key_tokens = [&](int tile, int stage) {
      if constexpr (kTokens) {
        LoadKeyTokens<kBlockN, kThreads>(key_tokens + stage * kBlockN, tokens.keys, tile, s.seqlen_kv, tid);
      }
    };

    q_tile.template AsyncLoad<kThreads>(q, q_stride, m0, len.q_len, kD, tid);
    o_tile.template AsyncLoad<kThreads>(dout, o_stride, m0, len.q_len, kDv, tid);
    if (tile_begin < tile_end) {
      k_tile[0].template AsyncLoad<kThreads>(k, k_stride, tile_begin * kBlockN, len.kv_len, kD, tid);
      v_tile[0].template AsyncLoad<kThreads>(v, v_stride, tile_begin * kBlockN, len.kv_len, kDv, tid);
      load_key_tokens(tile_begin, 0);
      load_bias(tile_begin, 0);
    }
    CpAsyncCommit();

    // delta' = rowsum(dout * out) - dlse for this warp's 16 rows (the scratch of kernel 1 aliases dq, which this
    // kernel overwrites, so it is not read here).
    const int64_t lse_base = (static_cast<int64_t>(b) * s.num_heads + head) * s.seqlen_q;
    for (int r = 0; r < 16; ++r) {
      const int row = m0 + warp * 16 + r;
      const float acc =
          row < s.seqlen_q ? WarpRowDot<Element, kDv>(out + row * o_stride, dout + row * o_stride, lane) : 0.0f;
      if (lane == 0) delta_s[warp * 16 + r] = row < s.seqlen_q ? acc - args.dlse[lse_base + row] : 0.0f;
    }
    __syncwarp();

    const int row[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
    const KeyRange keys[2] = {mask.Keys(row[0]), mask.Keys(row[1])};
    const int64_t pos[2] = {row[0] + mask.diag_offset, row[1] + mask.diag_offset};
    const float row_lse[2] = {row[0] < s.seqlen_q ? args.lse[lse_base + row[0]] : 0.0f,
                              row[1] < s.seqlen_q ? args.lse[lse_base + row[1]] : 0.0f};
    const float row_delta[2] = {delta_s[warp * 16 + g], delta_s[warp * 16 + g + 8]};
    int4 row_token[2] = {};
    if constexpr (kTokens) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        row_token[r] = row[r] < s.seqlen_q ? tokens.q_rows[row[r]] : make_int4(0, kTokenMax, kTokenMin, 0);
      }
    }

    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;
    if constexpr (Variant::kHasAlibi) variant.slope = args.alibi_slopes[b * s.num_heads + head];

    float dq[1][kDP / 8][4];
    ZeroFragments(dq);

    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int stage = (tile - tile_begin) & 1;
      CpAsyncWait<0>();
      __syncthreads();
      if (tile + 1 < tile_end) {
        k_tile[stage ^ 1].template AsyncLoad<kThreads>(k, k_stride, (tile + 1) * kBlockN, len.kv_len, kD, tid);
        v_tile[stage ^ 1].template AsyncLoad<kThreads>(v, v_stride, (tile + 1) * kBlockN, len.kv_len, kDv, tid);
        load_key_tokens(tile + 1, stage ^ 1);
        load_bias(tile + 1, stage ^ 1);
      }
      CpAsyncCommit();

      float sc[1][kBlockN / 8][4], dp[1][kBlockN / 8][4];
      ZeroFragments(sc);
      ZeroFragments(dp);
      WarpGemmABt<Element, 1, kDP, kBlockN>(sc, q_tile, warp * 16, k_tile[stage], lane);
      WarpGemmABt<Element, 1, kDvP, kBlockN>(dp, o_tile, warp * 16, v_tile[stage], lane);

      const int n0 = tile * kBlockN;
      const int2* stage_keys = key_tokens + stage * kBlockN;
      // The bias of row r's (0: g, 1: g + 8) key col (0 without a bias).
      auto bias_at = [&](int r, int col) {
        if constexpr (kBias) {
          return BiasStage::Value(bias_tile(stage).Row(bias, bias_row0, warp * 16 + g + 8 * r), col - n0);
        }
        return 0.0f;
      };
      bool unmasked = span.Unmasked(n0, kBlockN);
      if constexpr (kTokens) {
        unmasked = unmasked && TokensAllSee(TokenSummaryOf(tokens.q_summary, m0, kBlockM, s.seqlen_q),
                                            TokenSummaryOf(tokens.kv_summary, n0, kBlockN, s.seqlen_kv));
      }
      // Dropout's factor of element (row r, key n0 + 8 j + 2 t + c): 1 without dropout.
      [[maybe_unused]] KernelDropout dropout;
      [[maybe_unused]] uint32_t keep_bits = 0;
      if constexpr (Variant::kHasDropout) {
        dropout = KernelDropout::Of(args.dropout);
        keep_bits = dropout.TileBits<kBlockN / 8, false>(b, head, row[0], n0 + 2 * t);
      }
      auto keep_of = [&](int r, int col) {
        if constexpr (Variant::kHasDropout) return dropout.Factor(keep_bits, 2 * (r * (kBlockN / 8) + (col - n0) / 8) + (col & 1));
        return 1.0f;
      };
      // The two loops are written out: the dk/dv kernel's Masked<> lambda compiles to a different d = 64 schedule here
      // (nvcc 13.0), which no GPU run has checked; in the dk/dv kernel it gives byte-identical cubins.
      if constexpr (kTokens) {
        // Packed sequences: the tokens' positions, and their test where the tile is masked.
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int col = n0 + j * 8 + 2 * t + (e & 1);
            const int2 key_token = stage_keys[col - n0];
            const bool visible = unmasked || (Visible(keys[r], col) && TokenSees(row_token[r], key_token));
            ProbabilityGrad<Variant>::Apply(variant, sc[0][j][e], dp[0][j][e], row_token[r].w, key_token.y, visible,
                                            row_lse[r], row_delta[r], bias_at(r, col), keep_of(r, col));
          }
        }
      } else if (!unmasked) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int col = n0 + j * 8 + 2 * t + (e & 1);
            ProbabilityGrad<Variant>::Apply(variant, sc[0][j][e], dp[0][j][e], pos[r], col, Visible(keys[r], col),
                                            row_lse[r], row_delta[r], bias_at(r, col), keep_of(r, col));
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int col = n0 + j * 8 + 2 * t + (e & 1);
            ProbabilityGrad<Variant>::Apply(variant, sc[0][j][e], dp[0][j][e], pos[r], col, true, row_lse[r],
                                            row_delta[r], bias_at(r, col), keep_of(r, col));
          }
        }
      }

      // dq += ds k: ds in the A layout, k stored [key][d] is B stored [k][n].
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t da[1][4];
        PackAFragment<Element>(dp[0], kk, da[0]);
        WarpMmaRegA<Element, 1, kDP>(dq, da, k_tile[stage], kk * 16, 0, kDP, lane);
      }
    }
    CpAsyncWait<0>();

    uint16_t* dq_out = static_cast<uint16_t*>(args.dq) + q_off;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (row[r] >= s.seqlen_q) continue;
#pragma unroll
      for (int j = 0; j < kDP / 8; ++j) {
        const int col = j * 8 + 2 * t;
        if (col < kD) {
          *reinterpret_cast<uint32_t*>(dq_out + row[r] * q_stride + col) =
              len.invalid ? kPackedNaN : Element::Pack(dq[0][j][2 * r], dq[0][j][2 * r + 1]);
        }
      }
    }
  }
};

}  // namespace te_jax::cuda::sm80
