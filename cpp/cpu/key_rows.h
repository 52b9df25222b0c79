// A K/V tile's rows as the CPU kernels' tile products take them: float32 rows, read where they lie or from a compact
// copy, contiguous K/V or the pages of a paged KV cache alike (cpp/core/kv_rows.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpp/core/kv_format.h"
#include "cpp/core/kv_rows.h"
#include "cpp/core/limits.h"
#include "cpp/cpu/element_types.h"
#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/row_as_float.h"
#include "cpp/cpu/tile_gemm.h"

namespace te_jax::cpu {

// rows x dim elements starting at `first` (row stride `stride`) copied as float32 into out [rows, dim].
template <typename T>
void CopyRowsAsFloat(const T* first, int64_t stride, int64_t rows, int64_t dim, float* out) {
  for (int64_t i = 0; i < rows; ++i) RowAsFloat(first + i * stride, dim, out + i * dim);
}

// Whether a tile product that reads a tile's rows `reads` times (tile_gemm.h) reads them where they lie rather than
// from a compact copy. With AVX2's products, rows a 4 KB page or more apart (each its own TLB entry and prefetch
// stream on every pass) ran 2-10% faster from a copy when read several times (8 KB apart; 4 KB a wash); rows that
// share pages ran 7-16% faster in place, where the copy is pure cost; a tile read once, 1.3-1.4x faster in place.
// AVX-512's products read each row fewer times (8 x 32 blocks) and ran faster in place at every stride measured, 4-8
// KB apart 1.02-1.11x, so there the copy is never made (2-core x86).
inline constexpr int64_t kPageBytes = 4096;
inline bool ReadInPlace(int64_t row_bytes, int64_t reads) {
  return reads == 1 || CpuIsa() == Isa::kAvx512 || row_bytes < kPageBytes;
}

// rows x dim elements starting at `first` (row stride `stride`) as float32 rows that a tile product reads `reads`
// times: where they lie (float32 inputs, ReadInPlace) or copied into scratch [rows, dim].
template <typename T>
MatrixB RowsAsFloat(const T* first, int64_t stride, int64_t rows, int64_t dim, int64_t reads, float* scratch) {
  if constexpr (std::is_same_v<T, float>) {
    if (ReadInPlace(stride * sizeof(T), reads)) return {first, stride};
  }
  CopyRowsAsFloat(first, stride, rows, dim, scratch);
  return {scratch, dim};
}

// Keys [first, first + count) of a tile, as float32 rows.
struct KeyRun {
  MatrixB rows;
  int64_t first, count;
};

// A tile of at most kMaxKeys keys as runs of rows: one run, or in place one per page the tile touches.
template <int64_t kMaxKeys>
struct KeyRuns {
  // A tile may start inside a page: its keys touch at most kMaxKeys / kPageSizeMultiple + 1 pages.
  KeyRun run[kMaxKeys / kPageSizeMultiple + 1];
  int count = 0;

  const KeyRun* begin() const { return run; }
  const KeyRun* end() const { return run + count; }
};

// An FP8 KV cache's descales of k (which 0) or v (1), cpp/core/kv_format.h: a copied run of rows, which lies within one
// page, is scaled by its block's and head's. Without one (data null) rows are taken as they are.
struct RowDescales {
  KvDescales descales;
  int which = 0;

  bool active() const { return descales.data != nullptr; }
  float Of(const KvRows& rows, int64_t b, int64_t key, int64_t h) const {
    const int64_t block = descales.Block(rows.paged(), rows.paged() ? rows.Row(b, key) / rows.page_size : 0, b);
    return which == 0 ? descales.K(block, h) : descales.V(block, h);
  }
};

// Keys key0 .. key0 + keys - 1 of k or v (batch b, kv head h), wherever `rows` says they live. In place (float32
// inputs and `in_place`): a run per stretch of consecutive rows (the rest of a page; the whole tile when contiguous),
// so a paged call reads its pages as a contiguous call reads its rows. Otherwise one run of `scratch`, the rows copied
// (converted, gathered from their pages) once. The same values in the same order either way, and TileGemm adds over
// its depth in order, so products run by run give the bits of one product over the whole tile. FP8 rows (never in
// place) come out dequantized by `descales`.
template <int64_t kMaxKeys, typename T>
KeyRuns<kMaxKeys> KeyRowsAsFloat(const T* tensor, const KvRows& rows, int64_t b, int64_t h, int64_t key0,
                                 int64_t keys, bool in_place, float* scratch, const RowDescales& descales = {}) {
  KeyRuns<kMaxKeys> runs;
  for (int64_t c = 0; c < keys;) {
    const int64_t run = std::min(keys - c, rows.ContiguousKeys(key0 + c));
    const T* first = tensor + rows.Offset(b, key0 + c, h);
    if constexpr (std::is_same_v<T, float>) {
      if (in_place) {
        runs.run[runs.count++] = {{first, rows.row_stride}, c, run};
        c += run;
        continue;
      }
    }
    float* copy = scratch + c * rows.head_dim;
    CopyRowsAsFloat(first, rows.row_stride, run, rows.head_dim, copy);
    if (descales.active()) {
      const float descale = descales.Of(rows, b, key0 + c, h);
      for (int64_t i = 0; i < run * rows.head_dim; ++i) copy[i] *= descale;
    }
    c += run;
  }
  if (runs.count == 0) runs.run[runs.count++] = {{scratch, rows.head_dim}, 0, keys};
  return runs;
}

// Asks the caches for keys key0 .. key0 + keys - 1 of k or v (batch b, kv head h) ahead of their use. A head's rows lie
// Hkv * dim elements apart, from 4 KB on each in its own page, and the hardware prefetchers follow no stream across a
// page: without this, a decode tile (its rows read once, a few products each) waits on memory for every row (rows
// requested one tile ahead: contiguous decode 1.3x, rows 4 KB apart 1.05x; 2-core x86).
template <typename T>
void PrefetchKeyRows(const T* tensor, const KvRows& rows, int64_t b, int64_t h, int64_t key0, int64_t keys) {
  constexpr int64_t kCacheLine = 64;
  const int64_t row_bytes = rows.head_dim * static_cast<int64_t>(sizeof(T));
  for (int64_t j = key0; j < key0 + keys; ++j) {
    const char* row = reinterpret_cast<const char*>(tensor + rows.Offset(b, j, h));
    for (int64_t byte = 0; byte < row_bytes; byte += kCacheLine) __builtin_prefetch(row + byte, 0, 3);
  }
}

}  // namespace te_jax::cpu
