// Backward flash attention, sm80 family. Three kernels, launched in this order on one stream:
//   1. Preprocess: delta_i - dlse_i (delta_i = rowsum(dout * out)) into a float scratch that aliases dq.
//   2. DkDv: a CTA owns 16 * kWarps keys of one kv head, visits every query tile (of every head of its GQA group) that
//      sees them and accumulates dk, dv in registers: s^T = k q^T, p^T = exp(s^T - lse), dp^T = v dout^T,
//      ds^T = p^T (dp^T - delta + dlse) dlogit, dv += p^T dout, dk += ds^T q. No atomics: GQA sums stay in registers.
//   3. Dq: a CTA owns 16 * kWarps queries and visits their key tiles: dq += ds k (recomputing s and dp), then writes dq
//      over the scratch (kernel 2 has finished with it by stream order; each CTA recomputes its own rows' delta).
// Deterministic: every output element is written once by one thread, in a fixed summation order.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/sm80/block_range.h"
#include "cpp/cuda/kernels/sm80/online_softmax.h"
#include "cpp/cuda/kernels/sm80/smem_tile.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"

namespace te_jax::cuda::sm80 {

// The per-element logit/probability/dS algebra shared by the dk/dv and dq kernels.
template <typename Variant>
struct ProbabilityGrad {
  // p = exp(logit - lse) where visible, else 0; ds = p * (dp - delta') * dlogit/ddot. delta' = delta - dlse.
  static __device__ __forceinline__ void Apply(const Variant& variant, float& x_to_p, float& dp_to_ds, int64_t pos,
                                               int key, bool visible, float lse, float delta) {
    const float x = x_to_p;
    float p;
    if constexpr (!Variant::kHasSoftcap && !Variant::kHasAlibi) {
      // The plain scaled dot product: scale * log2 e folds into the one FMA (both factors are loop invariant).
      p = visible ? Exp2(fmaf(x, variant.scale * kLog2e, -lse * kLog2e)) : 0.0f;
    } else {
      p = visible ? Exp2(fmaf(variant.Logit(x, pos, key), kLog2e, -lse * kLog2e)) : 0.0f;
    }
    x_to_p = p;
    dp_to_ds = p * (dp_to_ds - delta) * variant.DLogitDDot(x);
  }
};

template <typename Element, int kDv>
struct BackwardPreprocessKernel {
  static constexpr int kThreads = kPreprocessThreads;
  // One warp per (b, i, h) row of out/dout; writes scratch[(b * H + h) * Sq + i] = rowsum(dout * out) - dlse.
  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    const ShapeArgs& s = args.shape;
    const int lane = threadIdx.x & 31;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * (kThreads / 32) + (threadIdx.x >> 5);
    const int64_t rows = static_cast<int64_t>(s.batch) * s.seqlen_q * s.num_heads;
    if (row >= rows) return;
    const uint32_t* o = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(args.out) + row * kDv);
    const uint32_t* d = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(args.dout) + row * kDv);
    float acc = 0.0f;
    for (int c = lane; c < kDv / 2; c += 32) {
      const uint32_t a = o[c], bb = d[c];
      acc += Element::ToFloat(static_cast<uint16_t>(a & 0xffff)) * Element::ToFloat(static_cast<uint16_t>(bb & 0xffff));
      acc += Element::ToFloat(static_cast<uint16_t>(a >> 16)) * Element::ToFloat(static_cast<uint16_t>(bb >> 16));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
      const int h = static_cast<int>(row % s.num_heads);
      const int64_t bi = row / s.num_heads;
      const int i = static_cast<int>(bi % s.seqlen_q);
      const int b = static_cast<int>(bi / s.seqlen_q);
      const int64_t at = (static_cast<int64_t>(b) * s.num_heads + h) * s.seqlen_q + i;
      args.delta_scratch[at] = acc - args.dlse[at];
    }
  }
};

template <typename Element, int kD, int kDv, typename Variant>
struct BackwardDkDvKernel {
  static constexpr TileSize kTile = BackwardDkDvTileSize(kD, kDv);
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kTile.block_m;  // keys
  static constexpr int kBlockN = kTile.block_n;  // queries per visited tile
  static constexpr int kSlices = kTile.slices;
  static constexpr int kDP = PadHeadDim(kD);
  static constexpr int kDvP = PadHeadDim(kDv);
  // Columns of dk / dv this CTA accumulates: slice * kDkCols .. (clipped to the padded head dim).
  static constexpr int kDkCols = (kDP / 16 + kSlices - 1) / kSlices * 16;
  static constexpr int kDvCols = (kDvP / 16 + kSlices - 1) / kSlices * 16;
  using KTile = SmemTile<kBlockM, kDP>;
  using VTile = SmemTile<kBlockM, kDvP>;
  using QTile = SmemTile<kBlockN, kDP>;
  using OTile = SmemTile<kBlockN, kDvP>;
  static constexpr int kStageBytes = QTile::kBytes + OTile::kBytes + 2 * 4 * kBlockN;
  static constexpr int kSmemBytes = KTile::kBytes + VTile::kBytes + 2 * kStageBytes;
  static_assert(kBlockM == 16 * kWarps, "a warp owns 16 keys");
  static_assert(kSmemBytes == BackwardDkDvSmemBytes(kD, kDv), "tile_size.h and the kernel disagree on shared memory");

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
    const int tile_begin = rows.begin / kBlockN;
    const int tile_end = rows.end > rows.begin ? (rows.end + kBlockN - 1) / kBlockN : tile_begin;
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
    auto q_tile = [&](int st) { return QTile{reinterpret_cast<uint16_t*>(stage_base + st * kStageBytes)}; };
    auto o_tile = [&](int st) { return OTile{reinterpret_cast<uint16_t*>(stage_base + st * kStageBytes + QTile::kBytes)}; };
    auto lse_s = [&](int st) {
      return reinterpret_cast<float*>(stage_base + st * kStageBytes + QTile::kBytes + OTile::kBytes);
    };
    auto delta_s = [&](int st) { return lse_s(st) + kBlockN; };

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
      }
    };

    k_tile.template AsyncLoad<kThreads>(k, k_stride, n0, len.kv_len, kD, tid);
    v_tile.template AsyncLoad<kThreads>(v, v_stride, n0, len.kv_len, kDv, tid);
    if (steps > 0) load_step(0, 0);
    CpAsyncCommit();

    const int key[2] = {n0 + warp * 16 + g, n0 + warp * 16 + g + 8};
    float dk[kDkCols / 8][4], dv[kDvCols / 8][4];
#pragma unroll
    for (int j = 0; j < kDkCols / 8; ++j) dk[j][0] = dk[j][1] = dk[j][2] = dk[j][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < kDvCols / 8; ++j) dv[j][0] = dv[j][1] = dv[j][2] = dv[j][3] = 0.0f;

    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;

    for (int step = 0; step < steps; ++step) {
      const int st = step & 1;
      const int head = kv_head * group + step / tiles;
      const int m0 = (tile_begin + step % tiles) * kBlockN;
      CpAsyncWait<0>();
      __syncthreads();
      if (step + 1 < steps) load_step(step + 1, st ^ 1);
      CpAsyncCommit();
      if constexpr (Variant::kHasAlibi) variant.slope = args.alibi_slopes[b * s.num_heads + head];
      const QTile qt = q_tile(st);
      const OTile ot = o_tile(st);
      const float* lse = lse_s(st);
      const float* delta = delta_s(st);

      // s^T = k q^T and dp^T = v dout^T: this warp's 16 keys x kBlockN queries.
      float sc[kBlockN / 8][4], dp[kBlockN / 8][4];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < kDP / 16; ++kk) {
        uint32_t a[4];
        k_tile.LoadA(warp * 16, kk * 16, lane, a);
#pragma unroll
        for (int nn = 0; nn < kBlockN / 16; ++nn) {
          uint32_t bb[4];
          qt.LoadBNK(nn * 16, kk * 16, lane, bb);
          Mma16816<Element>(sc[2 * nn], a, bb[0], bb[1]);
          Mma16816<Element>(sc[2 * nn + 1], a, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < kDvP / 16; ++kk) {
        uint32_t a[4];
        v_tile.LoadA(warp * 16, kk * 16, lane, a);
#pragma unroll
        for (int nn = 0; nn < kBlockN / 16; ++nn) {
          uint32_t bb[4];
          ot.LoadBNK(nn * 16, kk * 16, lane, bb);
          Mma16816<Element>(dp[2 * nn], a, bb[0], bb[1]);
          Mma16816<Element>(dp[2 * nn + 1], a, bb[2], bb[3]);
        }
      }

      // Interior steps (every query sees every key of the CTA) skip the per-element mask.
      if (!KeysOfRows(mask, m0, kBlockN).Unmasked(n0, kBlockM)) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = j * 8 + 2 * t + (e & 1);  // query within the tile
            const int row = m0 + qi;
            const int kj = key[e >> 1];
            ProbabilityGrad<Variant>::Apply(variant, sc[j][e], dp[j][e], row + mask.diag_offset, kj,
                                            Visible(mask.Keys(row), kj), lse[qi], delta[qi]);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int qi = j * 8 + 2 * t + (e & 1);
            const int row = m0 + qi;
            ProbabilityGrad<Variant>::Apply(variant, sc[j][e], dp[j][e], row + mask.diag_offset, key[e >> 1], true,
                                            lse[qi], delta[qi]);
          }
        }
      }

      // dv += p^T dout and dk += ds^T q over this step's queries (the k extent of both products).
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t pa[4] = {Element::Pack(sc[2 * kk][0], sc[2 * kk][1]), Element::Pack(sc[2 * kk][2], sc[2 * kk][3]),
                                Element::Pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                Element::Pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
        const uint32_t da[4] = {Element::Pack(dp[2 * kk][0], dp[2 * kk][1]), Element::Pack(dp[2 * kk][2], dp[2 * kk][3]),
                                Element::Pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                Element::Pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int nn = 0; nn < kDvCols / 16; ++nn) {
          if (dv0 + nn * 16 < kDvP) {
            uint32_t bb[4];
            ot.LoadBKN(kk * 16, dv0 + nn * 16, lane, bb);
            Mma16816<Element>(dv[2 * nn], pa, bb[0], bb[1]);
            Mma16816<Element>(dv[2 * nn + 1], pa, bb[2], bb[3]);
          }
        }
#pragma unroll
        for (int nn = 0; nn < kDkCols / 16; ++nn) {
          if (dk0 + nn * 16 < kDP) {
            uint32_t bb[4];
            qt.LoadBKN(kk * 16, dk0 + nn * 16, lane, bb);
            Mma16816<Element>(dk[2 * nn], da, bb[0], bb[1]);
            Mma16816<Element>(dk[2 * nn + 1], da, bb[2], bb[3]);
          }
        }
      }
    }
    CpAsyncWait<0>();

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
              len.invalid ? kPackedNaN : Element::Pack(dk[j][2 * r], dk[j][2 * r + 1]);
        }
      }
#pragma unroll
      for (int j = 0; j < kDvCols / 8; ++j) {
        const int col = dv0 + j * 8 + 2 * t;
        if (col < kDv) {
          *reinterpret_cast<uint32_t*>(dv_out + key[r] * v_stride + col) =
              len.invalid ? kPackedNaN : Element::Pack(dv[j][2 * r], dv[j][2 * r + 1]);
        }
      }
    }
  }
};

template <typename Element, int kD, int kDv, typename Variant>
struct BackwardDqKernel {
  static constexpr TileSize kTile = BackwardDqTileSize(kD, kDv);
  static constexpr int kWarps = kTile.warps;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kBlockM = kTile.block_m;  // queries
  static constexpr int kBlockN = kTile.block_n;  // keys per visited tile
  static constexpr int kDP = PadHeadDim(kD);
  static constexpr int kDvP = PadHeadDim(kDv);
  using QTile = SmemTile<kBlockM, kDP>;
  using OTile = SmemTile<kBlockM, kDvP>;
  using KTile = SmemTile<kBlockN, kDP>;
  using VTile = SmemTile<kBlockN, kDvP>;
  static constexpr int kSmemBytes = QTile::kBytes + OTile::kBytes + 2 * (KTile::kBytes + VTile::kBytes) + 4 * kBlockM;
  static_assert(kBlockM == 16 * kWarps, "a warp owns 16 query rows");
  static_assert(kSmemBytes == BackwardDqSmemBytes(kD, kDv), "tile_size.h and the kernel disagree on shared memory");

  static __device__ __forceinline__ void Run(const BackwardArgs& args) {
    extern __shared__ __align__(16) unsigned char smem[];
    const ShapeArgs& s = args.shape;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * kBlockM, head = blockIdx.y, b = blockIdx.z;
    const int kv_head = head / (s.num_heads / s.num_kv_heads);

    const BatchLengths len = ReadLengths(s, args.q_seqlens, args.kv_seqlens, b);
    const RowMask mask = MakeMask(s, len);
    const KeySpan span = KeysOfRows(mask, m0, kBlockM);
    const int tile_begin = span.FirstTile(kBlockN), tile_end = span.EndTile(kBlockN);

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
    float* delta_s = reinterpret_cast<float*>(kv_base + 2 * (KTile::kBytes + VTile::kBytes));

    q_tile.template AsyncLoad<kThreads>(q, q_stride, m0, len.q_len, kD, tid);
    o_tile.template AsyncLoad<kThreads>(dout, o_stride, m0, len.q_len, kDv, tid);
    if (tile_begin < tile_end) {
      k_tile[0].template AsyncLoad<kThreads>(k, k_stride, tile_begin * kBlockN, len.kv_len, kD, tid);
      v_tile[0].template AsyncLoad<kThreads>(v, v_stride, tile_begin * kBlockN, len.kv_len, kDv, tid);
    }
    CpAsyncCommit();

    // delta' = rowsum(dout * out) - dlse for this warp's 16 rows (the scratch of kernel 1 aliases dq, which this
    // kernel overwrites, so it is not read here).
    const int64_t lse_base = (static_cast<int64_t>(b) * s.num_heads + head) * s.seqlen_q;
    for (int r = 0; r < 16; ++r) {
      const int row = m0 + warp * 16 + r;
      float acc = 0.0f;
      if (row < s.seqlen_q) {
        const uint32_t* o2 = reinterpret_cast<const uint32_t*>(out + row * o_stride);
        const uint32_t* d2 = reinterpret_cast<const uint32_t*>(dout + row * o_stride);
        for (int c = lane; c < kDv / 2; c += 32) {
          const uint32_t a = o2[c], bb = d2[c];
          acc += Element::ToFloat(static_cast<uint16_t>(a & 0xffff)) * Element::ToFloat(static_cast<uint16_t>(bb & 0xffff));
          acc += Element::ToFloat(static_cast<uint16_t>(a >> 16)) * Element::ToFloat(static_cast<uint16_t>(bb >> 16));
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
      if (lane == 0) delta_s[warp * 16 + r] = row < s.seqlen_q ? acc - args.dlse[lse_base + row] : 0.0f;
    }
    __syncwarp();

    const int row[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
    const KeyRange keys[2] = {mask.Keys(row[0]), mask.Keys(row[1])};
    const int64_t pos[2] = {row[0] + mask.diag_offset, row[1] + mask.diag_offset};
    const float row_lse[2] = {row[0] < s.seqlen_q ? args.lse[lse_base + row[0]] : 0.0f,
                              row[1] < s.seqlen_q ? args.lse[lse_base + row[1]] : 0.0f};
    const float row_delta[2] = {delta_s[warp * 16 + g], delta_s[warp * 16 + g + 8]};

    Variant variant;
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;
    if constexpr (Variant::kHasAlibi) variant.slope = args.alibi_slopes[b * s.num_heads + head];

    float dq[kDP / 8][4];
#pragma unroll
    for (int j = 0; j < kDP / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.0f;

    for (int tile = tile_begin; tile < tile_end; ++tile) {
      const int stage = (tile - tile_begin) & 1;
      CpAsyncWait<0>();
      __syncthreads();
      if (tile + 1 < tile_end) {
        k_tile[stage ^ 1].template AsyncLoad<kThreads>(k, k_stride, (tile + 1) * kBlockN, len.kv_len, kD, tid);
        v_tile[stage ^ 1].template AsyncLoad<kThreads>(v, v_stride, (tile + 1) * kBlockN, len.kv_len, kDv, tid);
      }
      CpAsyncCommit();

      float sc[kBlockN / 8][4], dp[kBlockN / 8][4];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < kDP / 16; ++kk) {
        uint32_t a[4];
        q_tile.LoadA(warp * 16, kk * 16, lane, a);
#pragma unroll
        for (int nn = 0; nn < kBlockN / 16; ++nn) {
          uint32_t bb[4];
          k_tile[stage].LoadBNK(nn * 16, kk * 16, lane, bb);
          Mma16816<Element>(sc[2 * nn], a, bb[0], bb[1]);
          Mma16816<Element>(sc[2 * nn + 1], a, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int kk = 0; kk < kDvP / 16; ++kk) {
        uint32_t a[4];
        o_tile.LoadA(warp * 16, kk * 16, lane, a);
#pragma unroll
        for (int nn = 0; nn < kBlockN / 16; ++nn) {
          uint32_t bb[4];
          v_tile[stage].LoadBNK(nn * 16, kk * 16, lane, bb);
          Mma16816<Element>(dp[2 * nn], a, bb[0], bb[1]);
          Mma16816<Element>(dp[2 * nn + 1], a, bb[2], bb[3]);
        }
      }

      const int n0 = tile * kBlockN;
      if (!span.Unmasked(n0, kBlockN)) {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int col = n0 + j * 8 + 2 * t + (e & 1);
            ProbabilityGrad<Variant>::Apply(variant, sc[j][e], dp[j][e], pos[r], col, Visible(keys[r], col), row_lse[r],
                                            row_delta[r]);
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int col = n0 + j * 8 + 2 * t + (e & 1);
            ProbabilityGrad<Variant>::Apply(variant, sc[j][e], dp[j][e], pos[r], col, true, row_lse[r], row_delta[r]);
          }
        }
      }

      // dq += ds k: ds in the A layout, k stored [key][d] is B stored [k][n].
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t da[4] = {Element::Pack(dp[2 * kk][0], dp[2 * kk][1]), Element::Pack(dp[2 * kk][2], dp[2 * kk][3]),
                                Element::Pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]),
                                Element::Pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3])};
#pragma unroll
        for (int nn = 0; nn < kDP / 16; ++nn) {
          uint32_t bb[4];
          k_tile[stage].LoadBKN(kk * 16, nn * 16, lane, bb);
          Mma16816<Element>(dq[2 * nn], da, bb[0], bb[1]);
          Mma16816<Element>(dq[2 * nn + 1], da, bb[2], bb[3]);
        }
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
              len.invalid ? kPackedNaN : Element::Pack(dq[j][2 * r], dq[j][2 * r + 1]);
        }
      }
    }
  }
};

}  // namespace te_jax::cuda::sm80
