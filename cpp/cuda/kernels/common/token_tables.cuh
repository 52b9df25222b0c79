// The token tables of a packed-sequence call (layout in cpp/cuda/kernel_args.h's TokenArgs), built before
// the attention kernels of either direction run, by two small kernels on the same stream:
//   TokenTablesKernel: a warp per granule of either side writes its tokens' entries (ids, position bounds; the
//     lengths folded in as id 0) and the granule's summary;
//   TokenSpansKernel: a warp per granule compares its summary with every granule of the other side and writes the
//     range of those it may meet, so an attention CTA visits only the tiles of that range.
// The second pass is O(Gq x Gkv) summary comparisons per batch entry (64-token granules): 65k for 16k tokens, far below
// the attention's own cost. A call whose rows are read as documents (its document table, built first, holds) needs
// neither: both step aside.
#pragma once

#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/token_mask.h"

namespace te_jax::cuda {

// Clamped to int32, so a window of up to 2^31 - 1 around any position stays a plain comparison.
__device__ __forceinline__ int ClampToInt32(int64_t x) {
  return static_cast<int>(x < kTokenMin ? kTokenMin : (x > kTokenMax ? kTokenMax : x));
}

// Query row i of batch b (i < Sq): {id, lo, hi, position}; a row that sees nothing has id 0 and empty bounds.
__device__ __forceinline__ int4 QueryTokenRow(const TokenArgs& t, const BatchLengths& len, int64_t at, int i) {
  const int id = t.q_ids != nullptr ? t.q_ids[at] : 1;
  const int pos = t.q_pos != nullptr ? t.q_pos[at] : i;
  if (i >= len.q_len || id == 0) return make_int4(0, kTokenMax, kTokenMin, pos);
  int lo = kTokenMin, hi = kTokenMax;
  if (t.q_pos != nullptr) {
    if (t.window_left >= 0) lo = ClampToInt32(static_cast<int64_t>(pos) - t.window_left);
    if (t.window_right >= 0) hi = ClampToInt32(static_cast<int64_t>(pos) + t.window_right);
    if (t.causal && pos < hi) hi = pos;
  }
  return make_int4(id, lo, hi, pos);
}

// Key j of batch b (j < Skv): {id, position}; id 0 for a key no row sees.
__device__ __forceinline__ int2 KeyToken(const TokenArgs& t, const BatchLengths& len, int64_t at, int j) {
  const int id = t.kv_ids != nullptr ? t.kv_ids[at] : 1;
  const int pos = t.kv_pos != nullptr ? t.kv_pos[at] : j;
  return make_int2(j < len.kv_len ? id : 0, pos);
}

__device__ __forceinline__ void StoreTokenSummary(int32_t* summaries, int granule, const TokenSummary& s) {
  int4* p = reinterpret_cast<int4*>(summaries + granule * kTokenSummaryInts);
  p[0] = make_int4(s.id_min, s.id_max, s.lo_min, s.lo_max);
  p[1] = make_int4(s.hi_min, s.hi_max, s.dead, 0);
}

// blockIdx.x: groups of 4 granules over both sides (the query granules first), y: batch.
template <typename Args>
struct TokenTablesKernel {
  static constexpr int kThreads = kTokenTableThreads;
  static __device__ __forceinline__ void Run(const Args& args) {
    const ShapeArgs& s = args.shape;
    const TokenArgs& t = args.tokens;
    const int lane = threadIdx.x & 31, b = blockIdx.y;
    const int gq = (s.seqlen_q + kTokenGranule - 1) / kTokenGranule;
    const int gkv = (s.seqlen_kv + kTokenGranule - 1) / kTokenGranule;
    const int granule = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
    if (granule >= gq + gkv || ReadAsDocuments(t)) return;
    const BatchLengths len = ReadLengths(s, args.q_seqlens, args.kv_seqlens, b);
    const bool query = granule < gq;
    const int g = query ? granule : granule - gq;
    const int n = query ? s.seqlen_q : s.seqlen_kv;
    // The keys table holds whole granules per batch entry (BatchTokens); its padding is keys no row sees, left out of
    // the summary.
    int2* const keys = const_cast<int2*>(BatchTokens::Of(t, s, b).keys);
    TokenSummary sum = TokenSummary::Empty();
#pragma unroll
    for (int e = 0; e < kTokenGranule / 32; ++e) {
      const int i = g * kTokenGranule + 32 * e + lane;
      const int64_t at = static_cast<int64_t>(b) * n + i;  // in the operands
      if (query) {
        if (i >= n) continue;
        const int4 row = QueryTokenRow(t, len, at, i);
        reinterpret_cast<int4*>(t.q_rows)[at] = row;
        sum.Add(row.x, row.y, row.z);
      } else {
        if (i >= n) {
          keys[i] = make_int2(0, 0);
          continue;
        }
        const int2 key = KeyToken(t, len, at, i);
        keys[i] = key;
        sum.Add(key.x, key.y, key.y);
      }
    }
    sum.WarpMerge();
    if (lane == 0) {
      StoreTokenSummary(query ? t.q_summary + static_cast<int64_t>(b) * gq * kTokenSummaryInts
                              : t.kv_summary + static_cast<int64_t>(b) * gkv * kTokenSummaryInts,
                        g, sum);
    }
  }
};

// Same grid as TokenTablesKernel; runs after it.
template <typename Args>
struct TokenSpansKernel {
  static constexpr int kThreads = kTokenTableThreads;
  static __device__ __forceinline__ void Run(const Args& args) {
    const ShapeArgs& s = args.shape;
    const int lane = threadIdx.x & 31, b = blockIdx.y;
    const int gq = (s.seqlen_q + kTokenGranule - 1) / kTokenGranule;
    const int gkv = (s.seqlen_kv + kTokenGranule - 1) / kTokenGranule;
    const int granule = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
    if (granule >= gq + gkv || ReadAsDocuments(args.tokens)) return;
    const BatchTokens bt = BatchTokens::Of(args.tokens, s, b);
    const bool query = granule < gq;
    const int g = query ? granule : granule - gq;
    const TokenSummary mine = LoadTokenSummary(query ? bt.q_summary : bt.kv_summary, g);
    const int32_t* others = query ? bt.kv_summary : bt.q_summary;
    int first = kTokenMax, last = -1;
    for (int o = lane; o < (query ? gkv : gq); o += 32) {
      const TokenSummary other = LoadTokenSummary(others, o);
      if (!(query ? TokensDisjoint(mine, other) : TokensDisjoint(other, mine))) {
        first = min(first, o);
        last = max(last, o);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      first = min(first, __shfl_xor_sync(0xffffffffu, first, off));
      last = max(last, __shfl_xor_sync(0xffffffffu, last, off));
    }
    if (lane == 0) {
      int2* spans = reinterpret_cast<int2*>(const_cast<int32_t*>(query ? bt.q_span : bt.kv_span));
      spans[g] = last >= 0 ? make_int2(first, last + 1) : make_int2(0, 0);
    }
  }
};

}  // namespace te_jax::cuda
