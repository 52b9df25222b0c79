// The packed-sequence mask in the attention kernels, from the token tables of TokenArgs
// (cpp/cuda/kernel_args.h, written by kernels/common/token_tables.cuh). Per element, a row sees a key when their ids
// match and the key's position lies in the row's bounds (ANDed with the index-based range of visible_keys.h). Per
// tile, a granule summary (ids and bounds as ranges) says whether no pair can meet (the tile is never loaded when it
// lies outside the block's span) or every pair meets (the tile skips the per-element test).
#pragma once

#include "cpp/core/host_device.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

inline constexpr int32_t kTokenMin = -2147483647 - 1;
inline constexpr int32_t kTokenMax = 2147483647;

// Whether a packed call's rows are read as documents (the table built and holding): its token tables and token kernel
// then step aside.
__device__ __forceinline__ bool ReadAsDocuments(const TokenArgs& t) {
  return t.documents != nullptr && t.documents[0] != 0;
}

// A query row's entry of q_rows: x = id, y = lo, z = hi, w = position. A key's entry of keys: x = id, y = position.
__device__ __forceinline__ bool TokenSees(const int4& row, const int2& key) {
  return key.x == row.x && key.y >= row.y && key.y <= row.z;
}

// The tokens of one or more granules. Ids, and the bounds of the rows (query side) or the positions (lo = hi = the
// key's position; key side) of the live tokens, as ranges; dead: some token (below S) is not live (a row with id 0 or
// past its length, a key with id 0 or past its length).
struct TokenSummary {
  int id_min, id_max;
  int lo_min, lo_max;
  int hi_min, hi_max;
  int dead;
  int unused;

  static __device__ __forceinline__ TokenSummary Empty() {
    return {kTokenMax, kTokenMin, kTokenMax, kTokenMin, kTokenMax, kTokenMin, 0, 0};
  }
  __device__ __forceinline__ bool AnyLive() const { return id_min <= id_max; }

  __device__ __forceinline__ void Add(int id, int lo, int hi) {
    if (id == 0) {
      dead = 1;
      return;
    }
    id_min = min(id_min, id);
    id_max = max(id_max, id);
    lo_min = min(lo_min, lo);
    lo_max = max(lo_max, lo);
    hi_min = min(hi_min, hi);
    hi_max = max(hi_max, hi);
  }

  __device__ __forceinline__ void Merge(const TokenSummary& o) {
    id_min = min(id_min, o.id_min);
    id_max = max(id_max, o.id_max);
    lo_min = min(lo_min, o.lo_min);
    lo_max = max(lo_max, o.lo_max);
    hi_min = min(hi_min, o.hi_min);
    hi_max = max(hi_max, o.hi_max);
    dead |= o.dead;
  }

  // Summaries of the 32 lanes merged; every lane gets the result.
  __device__ __forceinline__ void WarpMerge() {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      TokenSummary o;
      o.id_min = __shfl_xor_sync(0xffffffffu, id_min, off);
      o.id_max = __shfl_xor_sync(0xffffffffu, id_max, off);
      o.lo_min = __shfl_xor_sync(0xffffffffu, lo_min, off);
      o.lo_max = __shfl_xor_sync(0xffffffffu, lo_max, off);
      o.hi_min = __shfl_xor_sync(0xffffffffu, hi_min, off);
      o.hi_max = __shfl_xor_sync(0xffffffffu, hi_max, off);
      o.dead = __shfl_xor_sync(0xffffffffu, dead, off);
      Merge(o);
    }
  }
};

__device__ __forceinline__ TokenSummary LoadTokenSummary(const int32_t* summaries, int granule) {
  const int4* p = reinterpret_cast<const int4*>(summaries + granule * kTokenSummaryInts);
  const int4 a = p[0], c = p[1];
  return {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
}

// Tokens [first, first + count) of a side of `total` tokens (granule-aligned `first`): the end of their granules,
// which start at first / kTokenGranule; granules past `total` left out.
__device__ __forceinline__ int TokenGranuleEnd(int first, int count, int total) {
  return min((first + count + kTokenGranule - 1) / kTokenGranule, (total + kTokenGranule - 1) / kTokenGranule);
}

// The merged summary of tokens [first, first + count) (granule-aligned `first`), granules past `total` left out.
__device__ __forceinline__ TokenSummary TokenSummaryOf(const int32_t* summaries, int first, int count, int total) {
  TokenSummary sum = TokenSummary::Empty();
  const int g_end = TokenGranuleEnd(first, count, total);
  for (int g = first / kTokenGranule; g < g_end; ++g) sum.Merge(LoadTokenSummary(summaries, g));
  return sum;
}

// No row of `rows` can see a key of `keys`.
__device__ __forceinline__ bool TokensDisjoint(const TokenSummary& rows, const TokenSummary& keys) {
  return !rows.AnyLive() || !keys.AnyLive() || rows.id_max < keys.id_min || keys.id_max < rows.id_min ||
         keys.hi_max < rows.lo_min || keys.lo_min > rows.hi_max;
}

// Every row of `rows` sees every key of `keys` (as far as the tokens go).
__device__ __forceinline__ bool TokensAllSee(const TokenSummary& rows, const TokenSummary& keys) {
  return !rows.dead && !keys.dead && rows.AnyLive() && keys.AnyLive() && rows.id_min == rows.id_max &&
         keys.id_min == keys.id_max && rows.id_min == keys.id_min && keys.lo_min >= rows.lo_max &&
         keys.hi_max <= rows.hi_min;
}

// Items [first, first + count) of one side: the union of their granules' spans on the other side, in tiles of kTile
// items of the other side: [x, y), empty when y <= x.
template <int kTile>
__device__ __forceinline__ int2 TokenTileSpan(const int32_t* spans, int first, int count, int total) {
  int begin = kTokenMax, end = 0;
  const int g_end = TokenGranuleEnd(first, count, total);
  for (int g = first / kTokenGranule; g < g_end; ++g) {
    const int2 span = reinterpret_cast<const int2*>(spans)[g];
    if (span.x < span.y) {
      begin = min(begin, span.x);
      end = max(end, span.y);
    }
  }
  if (begin >= end) return make_int2(0, 0);
  static_assert(kTile % kTokenGranule == 0 || kTokenGranule % kTile == 0, "tiles and granules nest");
  return make_int2(begin * kTokenGranule / kTile, (end * kTokenGranule + kTile - 1) / kTile);
}

// Tiles [begin, end) cut to the tiles of a token span.
__device__ __forceinline__ void NarrowToTokenSpan(int2 span, int& begin, int& end) {
  begin = max(begin, span.x);
  end = min(end, span.y);
  if (end < begin) end = begin;
}

// Batch entry b's tables. The keys table pads each batch entry's keys to whole granules with keys no row sees
// ({0, 0}), so a granule's entries are one aligned block (the sm90 kernels copy them with bulk copies, which need
// 16-byte aligned addresses and sizes).
struct BatchTokens {
  const int4* q_rows;
  const int2* keys;
  const int32_t* q_summary;
  const int32_t* kv_summary;
  const int32_t* q_span;
  const int32_t* kv_span;

  static __device__ __forceinline__ BatchTokens Of(const TokenArgs& t, const ShapeArgs& s, int b) {
    const int gq = (s.seqlen_q + kTokenGranule - 1) / kTokenGranule;
    const int gkv = (s.seqlen_kv + kTokenGranule - 1) / kTokenGranule;
    return {reinterpret_cast<const int4*>(t.q_rows) + static_cast<int64_t>(b) * s.seqlen_q,
            reinterpret_cast<const int2*>(t.keys) + static_cast<int64_t>(b) * gkv * kTokenGranule,
            t.q_summary + static_cast<int64_t>(b) * gq * kTokenSummaryInts,
            t.kv_summary + static_cast<int64_t>(b) * gkv * kTokenSummaryInts,
            t.q_span + static_cast<int64_t>(b) * gq * 2,
            t.kv_span + static_cast<int64_t>(b) * gkv * 2};
  }
};

}  // namespace te_jax::cuda
