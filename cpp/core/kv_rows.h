// Where the rows of k and v live: one definition of the key -> row mapping for contiguous K/V and for a paged KV cache
// for the CPU kernels and, compiled by NVRTC, the CUDA kernels. A kernel asks for the address of key j of
// batch entry b and kv head h and never needs to know which layout it reads.
#pragma once

#include "cpp/core/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cstdint>

#include "cpp/core/attention_params.h"
#endif

namespace te_jax {

// The rows of k (head_dim D) or v (head_dim Dv), cpp/core/attention_params.h's layout comment:
//   contiguous (page_size 0): [B, seqlen_kv, Hkv, dim], key j of batch b is row b * seqlen_kv + j;
//   paged: the pool [num_pages, page_size, Hkv, dim], key j of batch b is row page * page_size + j % page_size with
//   page = page_table[b * pages_per_seq + j / page_size].
// The page id is clamped to [0, num_pages - 1], so no id ever addresses memory outside the pool; a sequence that uses
// an id that needed the clamp is the caller's to report (PageInPool: the CPU refuses the call, ValidatePageTable; the
// decode kernels make the sequence's every output NaN), so the page read in its place never reaches a result.
struct KvRows {
  int64_t seqlen_kv;          // keys per batch entry (the logical capacity when paged)
  int64_t row_stride;         // elements from one key to the next within a sequence or a page: Hkv * dim
  int64_t head_dim;           // dim: elements from one kv head to the next within a row
  int64_t page_size;          // 0: contiguous
  int64_t num_pages;          // read only when page_size > 0, like the two below
  int64_t pages_per_seq;      // seqlen_kv / page_size: the page table's row length
  const int32_t* page_table;  // [B, pages_per_seq]

  TE_JAX_HOST_DEVICE bool paged() const { return page_size > 0; }

  // The row of key j of batch entry b in the [B * seqlen_kv] or [num_pages * page_size] row axis.
  TE_JAX_HOST_DEVICE int64_t Row(int64_t b, int64_t j) const {
    return page_size == 0 ? b * seqlen_kv + j : RowInPage(PageEntry(b, j), j);
  }

  // A paged Row in its two steps, for a kernel that also checks the entry it reads: key j's entry of batch entry b's
  // row of the page table, then the row that entry gives key j (the id clamped to the pool). A key and a page size are
  // int32 (keys below an int32 kv length, pages of at most 256), so the page of a key is a 32-bit division: on the GPU a
  // short instruction sequence, not the 64-bit division routine, for every copied row.
  TE_JAX_HOST_DEVICE int32_t PageEntry(int64_t b, int64_t j) const {
    return page_table[b * pages_per_seq + static_cast<int32_t>(j) / static_cast<int32_t>(page_size)];
  }
  TE_JAX_HOST_DEVICE int64_t RowInPage(int32_t entry, int64_t j) const {
    const int64_t page = entry < 0 ? 0 : (entry >= num_pages ? num_pages - 1 : entry);
    return page * page_size + static_cast<int32_t>(j) % static_cast<int32_t>(page_size);
  }

  // The pages the first kv_len keys of a sequence occupy: its entries of the page table that are read.
  TE_JAX_HOST_DEVICE int64_t PagesOf(int64_t kv_len) const {
    const int32_t keys = static_cast<int32_t>(kv_len), size = static_cast<int32_t>(page_size);  // 32-bit, as in Row
    return keys / size + (keys % size != 0);
  }

  // Whether entry j of batch entry b's row of the page table names a page of the pool (Row clamps one that does not).
  TE_JAX_HOST_DEVICE bool PageInPool(int64_t b, int64_t j) const { return EntryInPool(page_table[b * pages_per_seq + j]); }
  TE_JAX_HOST_DEVICE bool EntryInPool(int32_t entry) const { return entry >= 0 && entry < num_pages; }

  // The element offset of key j of batch entry b, kv head h (the first of its dim elements).
  TE_JAX_HOST_DEVICE int64_t Offset(int64_t b, int64_t j, int64_t h) const {
    return Row(b, j) * row_stride + h * head_dim;
  }

  // How many keys from j on are consecutive rows (row_stride apart): the rest of j's page, or every key after j.
  TE_JAX_HOST_DEVICE int64_t ContiguousKeys(int64_t j) const {
    return page_size == 0 ? seqlen_kv - j : page_size - j % page_size;
  }
};

#if !defined(__CUDACC_RTC__)
// The rows of k (dim = head_dim) or v (dim = head_dim_v) of a call.
inline KvRows MakeKvRows(const AttentionParams& p, const int32_t* page_table, int64_t dim) {
  return KvRows{p.seqlen_kv, p.num_kv_heads * dim, dim, p.page_size, p.num_pages,
                p.page_size > 0 ? p.seqlen_kv / p.page_size : 0, page_table};
}
#endif

}  // namespace te_jax
