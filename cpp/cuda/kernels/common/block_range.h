// Which tiles a CTA visits. Every mask leaves each query row a contiguous key range (cpp/core/visible_keys.h) whose ends
// never decrease with the row, so the keys any row of a query tile sees form one range, and so do the queries that see
// any key of a key tile. Tiles outside are skipped entirely (causal and window masks); tiles inside every row's range
// need no per-element mask; only tiles that straddle a range edge are masked element by element.
#pragma once

#include "cpp/core/visible_keys.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

// The batch's lengths: the operands' with a padding mask, else Sq and Skv (the operands are then one-element
// placeholders). Out-of-range values (outside [0, S]) are clamped, so nothing reads out of bounds, and flagged: the
// kernels then write NaN to every output of that batch (the CPU backend raises instead; the Python layer checks
// concrete lengths before the call).
struct BatchLengths {
  int q_len;
  int kv_len;
  bool invalid;
};

__device__ __forceinline__ BatchLengths ReadLengths(const ShapeArgs& s, const int32_t* q_seqlens,
                                                    const int32_t* kv_seqlens, int b) {
  if (!IsPadding(static_cast<MaskType>(s.mask_type))) return {s.seqlen_q, s.seqlen_kv, false};
  const int q = q_seqlens != nullptr ? q_seqlens[b] : s.seqlen_q;  // nullptr: QuerySeqlensRead
  const int kv = kv_seqlens[b];
  BatchLengths r;
  r.invalid = q < 0 || q > s.seqlen_q || kv < 0 || kv > s.seqlen_kv;
  r.q_len = q < 0 ? 0 : (q > s.seqlen_q ? s.seqlen_q : q);
  r.kv_len = kv < 0 ? 0 : (kv > s.seqlen_kv ? s.seqlen_kv : kv);
  return r;
}

__device__ __forceinline__ RowMask MakeMask(const ShapeArgs& s, const BatchLengths& len) {
  return MakeRowMask(static_cast<MaskType>(s.mask_type), len.q_len, len.kv_len, s.window_left, s.window_right);
}

// Query rows [m0, m0 + rows): the union of their key ranges, and the keys every one of them sees.
struct KeySpan {
  int begin, end;            // union; empty when end <= begin
  int full_begin, full_end;  // intersection over the rows (only meaningful when all rows are valid)
  bool all_rows_valid;

  __device__ __forceinline__ int FirstTile(int tile) const { return begin / tile; }
  __device__ __forceinline__ int EndTile(int tile) const { return end > begin ? (end + tile - 1) / tile : begin / tile; }
  // Whether keys [n0, n0 + n) are visible to every row, so the tile needs no per-element mask.
  __device__ __forceinline__ bool Unmasked(int n0, int n) const {
    return all_rows_valid && n0 >= full_begin && n0 + n <= full_end;
  }
};

__device__ __forceinline__ KeySpan KeysOfRows(const RowMask& mask, int m0, int rows) {
  KeySpan span{0, 0, 0, 0, false};
  const int valid = static_cast<int>(mask.q_len) - m0 < rows ? static_cast<int>(mask.q_len) - m0 : rows;
  if (valid <= 0) return span;
  const KeyRange first = mask.Keys(m0);
  const KeyRange last = mask.Keys(m0 + valid - 1);
  span.begin = static_cast<int>(first.begin);
  span.end = static_cast<int>(last.end);
  span.full_begin = static_cast<int>(last.begin);
  span.full_end = static_cast<int>(first.end);
  span.all_rows_valid = valid == rows;
  return span;
}

// What a CTA that owns a block of query rows (forward, dq; blockIdx x = query block, y = head, z = batch) starts from:
// its coordinates, its batch's lengths and mask, and the key tiles [tile_begin, tile_end) its rows see.
struct QueryBlockOfCta {
  int m0, head, b, kv_head;
  BatchLengths len;
  RowMask mask;
  KeySpan span;
  int tile_begin, tile_end;
};

// The query block, head and batch entry are the CTA's grid position unless the kernel orders its work otherwise (sm90:
// the longest first, or persistent CTAs).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ QueryBlockOfCta QueryBlockOf(const ShapeArgs& s, const int32_t* q_seqlens,
                                                        const int32_t* kv_seqlens, int m_block = blockIdx.x,
                                                        int head = blockIdx.y, int b = blockIdx.z) {
  QueryBlockOfCta c;
  c.m0 = m_block * kBlockM;
  c.head = head;
  c.b = b;
  c.kv_head = c.head / (s.num_heads / s.num_kv_heads);
  c.len = ReadLengths(s, q_seqlens, kv_seqlens, c.b);
  c.mask = MakeMask(s, c.len);
  c.span = KeysOfRows(c.mask, c.m0, kBlockM);
  c.tile_begin = c.span.FirstTile(kBlockN);
  c.tile_end = c.span.EndTile(kBlockN);
  return c;
}

// A work of the document table (packed rows read as documents, kernels/common/document_tables.cuh): entry {b, m0,
// first, end}'s query rows of the document [first, end) under the call's mask, which with positions acts on them (the
// table holds only where they count up by one within each document, so their differences are the indices'). The
// block's rows past `end` belong to the next document and are never written, so the block counts as whole: the tiles
// every row of the document's sees take no per-element mask.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ QueryBlockOfCta DocumentBlockOf(const ShapeArgs& s, const TokenArgs& t, int4 entry,
                                                           int head) {
  QueryBlockOfCta c;
  c.m0 = entry.y;
  c.head = head;
  c.b = entry.x;
  c.kv_head = head / (s.num_heads / s.num_kv_heads);
  c.len = BatchLengths{entry.w, entry.w, false};
  const bool positions = t.q_pos != nullptr;
  const MaskType mask = positions ? (t.causal ? MaskType::kCausal : MaskType::kNoMask)
                                  : static_cast<MaskType>(s.mask_type);
  c.mask = MakeRowMask(mask, entry.w, entry.w, positions ? t.window_left : s.window_left,
                       positions ? t.window_right : s.window_right);
  c.mask.first = entry.z;
  c.span = KeysOfRows(c.mask, c.m0, kBlockM);
  c.span.all_rows_valid = true;
  c.tile_begin = c.span.FirstTile(kBlockN);
  c.tile_end = c.span.EndTile(kBlockN);
  return c;
}

// Keys [n0, n1): the query rows [begin, end) that may see any of them (a superset is harmless: masked per element).
struct RowSpan {
  int begin, end;
};

__device__ __forceinline__ RowSpan RowsOfKeys(const RowMask& mask, int n0, int n1) {
  const int q_len = static_cast<int>(mask.q_len);
  const int off = static_cast<int>(mask.diag_offset);
  RowSpan r{static_cast<int>(mask.first), q_len};  // a document's rows only (RowMask::first)
  if (n0 >= mask.kv_len) return RowSpan{0, 0};
  if (mask.causal && n0 - off > r.begin) r.begin = n0 - off;                      // end_i = p + 1 > n0
  if (mask.window_right >= 0 && n0 - off - mask.window_right > r.begin) {         // end_i = p + wr + 1 > n0
    r.begin = n0 - off - static_cast<int>(mask.window_right);
  }
  if (mask.window_left >= 0 && n1 - off + mask.window_left < r.end) {             // begin_i = p - wl < n1
    r.end = n1 - off + static_cast<int>(mask.window_left);
  }
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

__device__ __forceinline__ bool Visible(const KeyRange& keys, int j) { return j >= keys.begin && j < keys.end; }

// A row's visible range (of keys, or of the rows that see a key) as offsets from a thread's first column, clamped to
// [-1, limit]: the thread's elements sit at constant offsets from that column, so each element's test is two compares
// with no arithmetic (testing each element against the range itself, in 64-bit, was most of a masked step's work).
struct ColumnRange {
  int lo, hi;
  __device__ __forceinline__ bool Contains(int offset) const { return offset >= lo && offset < hi; }
};

__device__ __forceinline__ ColumnRange ColumnsFrom(const KeyRange& range, int64_t first, int limit) {
  auto offset = [&](int64_t at) { return static_cast<int>(min(max(at - first, int64_t{-1}), int64_t{limit})); };
  return {offset(range.begin), offset(range.end)};
}

}  // namespace te_jax::cuda
