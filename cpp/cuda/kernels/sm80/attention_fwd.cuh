// Forward flash attention, sm80 family (mma.sync m16n8k16, ldmatrix, cp.async double buffering); runs on sm_80+.
// A CTA owns 16 * kWarps * kMT query rows of one (batch, head); each warp 16 * kMT of them. The q tile stays in shared memory, the
// k/v tiles of the visible key range stream through two stages: tile t+1 is in flight while tile t is multiplied.
// The logits come from the Variant (cpp/core/variants.h), so every variant shares this body; masks are run-time key ranges,
// and with the variant's tokens (packed sequences) also per-element id/position tests (kernels/common/token_mask.h).
// With the variant's bias, a bias tile (kernels/sm80/bias_tile.h) streams through two stages beside k/v and is added
// to each logit.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/dropout.h"
#include "cpp/cuda/kernels/common/nonfinite_tile.h"
#include "cpp/cuda/kernels/common/online_softmax.h"
#include "cpp/cuda/kernels/common/token_mask.h"
#include "cpp/cuda/kernels/primitives/padded_tile.h"
#include "cpp/cuda/kernels/primitives/warp_gemm.h"
#include "cpp/cuda/kernels/sm80/bias_tile.h"
#include "cpp/cuda/kernels/sm80/key_token_stage.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"

namespace te_jax::cuda::sm80 {

template <typename Element, int kD, int kDv, typename Variant>
struct ForwardKernel {
  static constexpr bool kBias = Variant::kHasBias;
  static constexpr TileSize kTile = ForwardTileSize(kD, kDv, kBias);
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kTile.block_m;
  static constexpr int kBlockN = kTile.block_n;
  static constexpr int kMT = kTile.m_tiles;  // 16-row m tiles per warp
  static constexpr int kDP = PadHeadDim(kD);
  static constexpr int kDvP = PadHeadDim(kDv);
  using QTile = PaddedTile<kBlockM, kDP>;
  using KTile = PaddedTile<kBlockN, kDP>;
  using VTile = PaddedTile<kBlockN, kDvP>;
  static constexpr bool kTokens = Variant::kHasTokens;
  static constexpr bool kDropout = Variant::kHasDropout;
  // After the key ranges: the rows' token entries, each stage's keys' entries, the rows' "sees a key" flags.
  static constexpr int kRangesOffset = QTile::kBytes + 2 * (KTile::kBytes + VTile::kBytes);
  static constexpr int kRowTokensOffset = kRangesOffset + 8 * kBlockM;
  static constexpr int kKeyTokensOffset = kRowTokensOffset + 16 * kBlockM;
  static constexpr int kSeenOffset = kKeyTokensOffset + 2 * 8 * kBlockN;
  // Then, with a bias, its two stages.
  using BiasStage = BiasTile<typename Variant::Bias, kBlockM, kBlockN>;
  static constexpr int kBiasOffset = kTokens ? kSeenOffset + 4 * kBlockM : kRowTokensOffset;
  static constexpr int kSmemBytes = kBiasOffset + (kBias ? 2 * BiasStage::kBytes : 0);
  static_assert(kBlockM == 16 * kWarps * kMT, "a warp owns 16 * kMT query rows");
  static_assert(kBiasOffset % 16 == 0, "cp.async needs 16-byte aligned bias stages");
  static_assert(kSmemBytes == ForwardSmemBytes(kD, kDv, kTokens, kBias ? Variant::Bias::kBytes : 0),
                "tile_size.h and the kernel disagree on shared memory");

  // Whether a row's range holds a key. Read with a volatile load so the compiler keeps it here, after the main loop:
  // hoisted above it, the two flags held through the loop made the d = 128 kernel spill.
  static __device__ __forceinline__ bool RowSeesKeys(const int2* range) {
    int begin, end;
    asm volatile("ld.shared.v2.s32 {%0, %1}, [%2];" : "=r"(begin), "=r"(end) : "r"(SmemAddress(range)));
    return begin < end;
  }

  static __device__ __forceinline__ void Run(const ForwardArgs& args) {
    extern __shared__ __align__(16) unsigned char smem[];
    const ShapeArgs& s = args.shape;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    // Plain locals, not a structured binding: the tile pass below is a lambda, and C++17 cannot capture bindings.
    const QueryBlockOfCta cta = QueryBlockOf<kBlockM, kBlockN>(s, args.q_seqlens, args.kv_seqlens);
    const int m0 = cta.m0, head = cta.head, b = cta.b, kv_head = cta.kv_head;
    const BatchLengths len = cta.len;
    const RowMask mask = cta.mask;
    const KeySpan span = cta.span;
    int tile_begin = cta.tile_begin, tile_end = cta.tile_end;
    BatchTokens tokens{};
    if constexpr (kTokens) {
      tokens = BatchTokens::Of(args.tokens, s, b);
      NarrowToTokenSpan(TokenTileSpan<kBlockN>(tokens.q_span, m0, kBlockM, s.seqlen_q), tile_begin, tile_end);
    }

    const int64_t q_stride = static_cast<int64_t>(s.num_heads) * kD;
    const int64_t k_stride = static_cast<int64_t>(s.num_kv_heads) * kD;
    const int64_t v_stride = static_cast<int64_t>(s.num_kv_heads) * kDv;
    const uint16_t* q = static_cast<const uint16_t*>(args.q) + static_cast<int64_t>(b) * s.seqlen_q * q_stride + head * kD;
    const uint16_t* k = static_cast<const uint16_t*>(args.k) + static_cast<int64_t>(b) * s.seqlen_kv * k_stride + kv_head * kD;
    const uint16_t* v = static_cast<const uint16_t*>(args.v) + static_cast<int64_t>(b) * s.seqlen_kv * v_stride + kv_head * kDv;

    QTile q_tile{reinterpret_cast<uint16_t*>(smem)};
    KTile k_tile[2] = {{reinterpret_cast<uint16_t*>(smem + QTile::kBytes)},
                       {reinterpret_cast<uint16_t*>(smem + QTile::kBytes + KTile::kBytes)}};
    VTile v_tile[2] = {{reinterpret_cast<uint16_t*>(smem + QTile::kBytes + 2 * KTile::kBytes)},
                       {reinterpret_cast<uint16_t*>(smem + QTile::kBytes + 2 * KTile::kBytes + VTile::kBytes)}};

    q_tile.template AsyncLoad<kThreads>(q, q_stride, m0, len.q_len, kD, tid);
    CpAsyncCommit();

    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;
    if constexpr (Variant::kHasAlibi) variant.slope = args.alibi_slopes[b * s.num_heads + head];

    // Each row's visible key range, for the tiles that straddle a range edge: one row per thread, kept in shared memory
    // so the main loop holds no per-row mask state in registers (block_m == threads * kRangeRowsPerThread).
    int2* ranges = reinterpret_cast<int2*>(smem + kRangesOffset);
    for (int i = tid; i < kBlockM; i += kThreads) {
      const KeyRange keys = mask.Keys(m0 + i);
      ranges[i] = make_int2(static_cast<int>(keys.begin), static_cast<int>(keys.end));
    }
    // The token tables: the rows' entries (a row past Sq sees nothing), each stage's keys' (loaded with the stage),
    // and per row whether a masked tile showed it a key (a tile every row sees shows every row one: saw_full_tile).
    int4* row_tokens = reinterpret_cast<int4*>(smem + kRowTokensOffset);
    int2* key_tokens = reinterpret_cast<int2*>(smem + kKeyTokensOffset);
    int* row_seen = reinterpret_cast<int*>(smem + kSeenOffset);
    if constexpr (kTokens) {
      for (int i = tid; i < kBlockM; i += kThreads) {
        row_tokens[i] = m0 + i < s.seqlen_q ? tokens.q_rows[m0 + i] : make_int4(0, kTokenMax, kTokenMin, 0);
        row_seen[i] = 0;
      }
    }
    auto load_key_tokens = [&](int tile, int stage) {
      if constexpr (kTokens) {
        LoadKeyTokens<kBlockN, kThreads>(key_tokens + stage * kBlockN, tokens.keys, tile, s.seqlen_kv, tid);
      }
    };
    bool saw_full_tile = false;
    // The bias of this (batch, head), staged per key tile with k and v.
    BiasRows bias{};
    if constexpr (kBias) bias = BiasRows::Of(args.bias, b, head);
    auto bias_tile = [&](int stage) { return BiasStage{SmemAddress(smem + kBiasOffset) + stage * BiasStage::kBytes}; };
    auto load_bias = [&](int tile, int stage) {
      if constexpr (kBias) bias_tile(stage).template Load<kThreads>(bias, m0, tile * kBlockN, s.seqlen_q, tid);
    };
    const int diag = static_cast<int>(mask.diag_offset);
    // Tiles [full_begin, full_end) are visible to every row of the CTA: no per-element mask there.
    const int full_begin = span.all_rows_valid ? (span.full_begin + kBlockN - 1) / kBlockN : tile_end;
    const int full_end = span.all_rows_valid ? span.full_end / kBlockN : tile_end;
    // The softmax takes the max on unscaled scores and folds the factor to log2 units into its exp2 FMA: the plain scaled
    // dot product keeps raw q.k (the factor is scale * log2 e; scale > 0 is validated on the host), the other variants
    // keep natural-unit logits (factor log2 e), as does a bias.
    constexpr bool kRawScores = !Variant::kHasSoftcap && !Variant::kHasAlibi && !kBias;
    constexpr bool kSkipSteadyRescale = kMT == 2 && kDvP == 128;
    const float log2_scale = kRawScores ? s.scale * kLog2e : kLog2e;

    float o[kMT][kDvP / 8][4];
    OnlineSoftmax<kBlockN / 8> softmax[kMT];

    // The CTA's pass over its key tiles. kCareful adds the handling of inf and NaN in v (nonfinite_tile.h): a tile that
    // straddles a row's range edge holds keys some rows must not see, and the product o += p v would add 0 * NaN = NaN
    // to those rows. The plain pass carries no trace of it (in the loop, even an untaken branch with barriers cost the
    // d = 128 forward 8-11% on an H200); a CTA whose plain pass ended with NaN while it had straddling tiles (only
    // non-finite inputs do that) runs the careful pass again from the start.
    auto pass = [&](auto careful) {
      constexpr bool kCareful = decltype(careful)::kValue;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        softmax[mt].Reset();
#pragma unroll
        for (int j = 0; j < kDvP / 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.0f;
      }
      if (tile_begin < tile_end) {
        k_tile[0].template AsyncLoad<kThreads>(k, k_stride, tile_begin * kBlockN, len.kv_len, kD, tid);
        v_tile[0].template AsyncLoad<kThreads>(v, v_stride, tile_begin * kBlockN, len.kv_len, kDv, tid);
        load_key_tokens(tile_begin, 0);
        load_bias(tile_begin, 0);
      }
      CpAsyncCommit();
    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int stage = (tile - tile_begin) & 1;
      CpAsyncWait<0>();
      __syncthreads();  // tile's k/v (and the range table) landed for everyone, and everyone is done with the other stage
      if (tile + 1 < tile_end) {
        k_tile[stage ^ 1].template AsyncLoad<kThreads>(k, k_stride, (tile + 1) * kBlockN, len.kv_len, kD, tid);
        v_tile[stage ^ 1].template AsyncLoad<kThreads>(v, v_stride, (tile + 1) * kBlockN, len.kv_len, kDv, tid);
        load_key_tokens(tile + 1, stage ^ 1);
        load_bias(tile + 1, stage ^ 1);
      }
      CpAsyncCommit();
      const int n0 = tile * kBlockN;
      bool interior = tile >= full_begin && tile < full_end;
      if constexpr (kTokens) {
        // Summaries re-read per tile (cached loads) rather than held: the d = 128 kernel has no registers to spare.
        interior = interior && TokensAllSee(TokenSummaryOf(tokens.q_summary, m0, kBlockM, s.seqlen_q),
                                            TokenSummaryOf(tokens.kv_summary, n0, kBlockN, s.seqlen_kv));
        saw_full_tile |= interior;
      }
      const int2* stage_keys = key_tokens + stage * kBlockN;
      // The positions the variant sees: the tokens' with packed sequences, else the diagonal's and the key's index.
      auto row_position = [&](int local) -> typename Variant::Position {
        return kTokens ? row_tokens[local].w : m0 + local + diag;
      };
      auto key_position = [&](int col) -> typename Variant::Position { return kTokens ? stage_keys[col - n0].y : col; };
      // The bias of row `local`'s key col, added after the variant's logit.
      auto bias_at = [&](int local, int col) {
        if constexpr (kBias) return BiasStage::Value(bias_tile(stage).Row(bias, m0, local), col - n0);
        return 0.0f;
      };
      // Poisoning o before this tile's rescale and product is the same as after: NaN stays NaN.
      if constexpr (kCareful) {
        if (!interior && __syncthreads_or(ThreadSeesNonFinite<Element, kThreads>(v_tile[stage], tid))) {
          PoisonColumnsOfNonFiniteValues<Element>(o, ranges + warp * kMT * 16, v_tile[stage], n0, n0, n0 + kBlockN, g, t,
                                                  [&](int row, int key) {
                                                    return !kTokens || TokenSees(row_tokens[warp * kMT * 16 + row],
                                                                                 stage_keys[key - n0]);
                                                  });
          __syncthreads();  // every warp has read the values before they are zeroed
          ZeroNonFinite<Element, kThreads>(v_tile[stage], tid);
          __syncthreads();
        }
      }

      // s = q k^T for this warp's 16 * kMT rows and the tile's kBlockN keys; each k fragment feeds kMT mma pairs.
      float sc[kMT][kBlockN / 8][4];
      ZeroFragments(sc);
      WarpGemmABt<Element, kMT, kDP, kBlockN>(sc, q_tile, warp * kMT * 16, k_tile[stage], lane);

      // Interior tiles (every row sees every key) skip the per-element mask; raw scores need no per-element work there.
      if (interior) {
        if constexpr (!kRawScores) {
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int r = (warp * kMT + mt) * 16 + g + 8 * (e >> 1);
                sc[mt][j][e] = variant.Logit(sc[mt][j][e], row_position(r), key_position(n0 + j * 8 + 2 * t + (e & 1)));
                if constexpr (kBias) sc[mt][j][e] += bias_at(r, n0 + j * 8 + 2 * t + (e & 1));
              }
        }
      } else {
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int local = (warp * kMT + mt) * 16 + g + 8 * r;
            const int2 keys = ranges[local];
            [[maybe_unused]] int4 row_token{};
            if constexpr (kTokens) row_token = row_tokens[local];
            bool seen = false;
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int col = n0 + j * 8 + 2 * t + c;
                float logit = sc[mt][j][2 * r + c];
                if constexpr (!kRawScores) logit = variant.Logit(logit, row_position(local), key_position(col));
                if constexpr (kBias) logit += bias_at(local, col);
                bool visible = col >= keys.x && col < keys.y;
                if constexpr (kTokens) {
                  visible = visible && TokenSees(row_token, stage_keys[col - n0]);
                  seen |= visible;
                }
                sc[mt][j][2 * r + c] = visible ? logit : -__int_as_float(0x7f800000);
              }
            if (kTokens && seen) row_seen[local] = 1;
          }
        }
      }
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        float rescale[2];
        softmax[mt].Update(sc[mt], log2_scale, rescale);
        // Once the row maxima settle, most tiles move none of the warp's (rescale is exactly 2^0 = 1): skipping that
        // multiply is bitwise identical. Measured on an H200 it pays only for the 2-m-tile dv = 128 kernel (forward
        // +3.5-5%, and ptxas stops spilling); at d = 64 (-5-7%) and d = 256 (-8%) the vote and branch cost
        // more.
        if (!kSkipSteadyRescale || __any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
          for (int j = 0; j < kDvP / 8; ++j) {
            o[mt][j][0] *= rescale[0];
            o[mt][j][1] *= rescale[0];
            o[mt][j][2] *= rescale[1];
            o[mt][j][3] *= rescale[1];
          }
        }
      }

      // Dropout scales the probabilities P.V takes, after the row sums (lse is dropout's not) have them.
      if constexpr (kDropout) {
        const KernelDropout dropout = KernelDropout::Of(args.dropout);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const uint32_t bits =
              dropout.TileBits<kBlockN / 8, false>(b, head, m0 + (warp * kMT + mt) * 16 + g, n0 + 2 * t);
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
              for (int c = 0; c < 2; ++c) sc[mt][j][2 * r + c] *= dropout.Factor(bits, 2 * (r * (kBlockN / 8) + j) + c);
        }
      }

      // o += p v: p's accumulator layout is already the A fragment layout; each v fragment feeds kMT mma pairs.
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[kMT][4];
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) PackAFragment<Element>(sc[mt], kk, a[mt]);
        WarpMmaRegA<Element, kMT, kDvP>(o, a, v_tile[stage], kk * 16, 0, kDvP, lane);
      }
    }
      CpAsyncWait<0>();
    };

    pass(BoolConstant<false>{});
    // With tokens any tile may be masked per element (the token test is not a range edge).
    const bool straddles = !span.all_rows_valid || full_begin > tile_begin || full_end < tile_end ||
                           (kTokens && tile_begin < tile_end);
    // The barrier also keeps the careful pass's first loads from overwriting a stage another warp still reads.
    if (straddles && __syncthreads_or(AnyNaN(o) || softmax[0].AnyNaN() || softmax[kMT - 1].AnyNaN())) {
      pass(BoolConstant<true>{});
    }

    if constexpr (kTokens) __syncthreads();  // every warp's "seen" flags are written
    const int64_t o_stride = static_cast<int64_t>(s.num_heads) * kDv;
    uint16_t* out = static_cast<uint16_t*>(args.out) + static_cast<int64_t>(b) * s.seqlen_q * o_stride + head * kDv;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      const int local_row = (warp * kMT + mt) * 16 + g;
      bool sees_keys[2] = {RowSeesKeys(ranges + local_row), RowSeesKeys(ranges + local_row + 8)};
      if constexpr (kTokens) {
        sees_keys[0] = saw_full_tile || row_seen[local_row] != 0;
        sees_keys[1] = saw_full_tile || row_seen[local_row + 8] != 0;
      }
      float inv_sum[2], lse[2];
      if constexpr (kBias) {
        softmax[mt].FinishWithBias(sees_keys, inv_sum, lse);
      } else {
        softmax[mt].Finish(sees_keys, inv_sum, lse);
      }
      MergeRowSinks(args.sinks, static_cast<int64_t>(b) * s.num_heads + head, inv_sum, lse);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = m0 + local_row + 8 * r;
        if (row >= s.seqlen_q) continue;
        uint16_t* out_row = out + row * o_stride;
#pragma unroll
        for (int j = 0; j < kDvP / 8; ++j) {
          const int col = j * 8 + 2 * t;
          if (col < kDv) {
            const uint32_t packed =
                len.invalid ? kPackedNaN
                : sees_keys[r] ? Element::Pack(o[mt][j][2 * r] * inv_sum[r], o[mt][j][2 * r + 1] * inv_sum[r])
                               : 0u;
            *reinterpret_cast<uint32_t*>(out_row + col) = packed;
          }
        }
        if (t == 0) {
          args.lse[(static_cast<int64_t>(b) * s.num_heads + head) * s.seqlen_q + row] =
              len.invalid ? __int_as_float(0x7fffffff) : lse[r];
        }
      }
    }
  }
};

}  // namespace te_jax::cuda::sm80
