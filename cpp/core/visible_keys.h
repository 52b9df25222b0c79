// Every mask te_jax supports leaves each query row a contiguous range of visible keys: the padding length, the causal
// diagonal and the window each bound it from one side. Backends therefore never evaluate a mask element by element
// from scratch: they intersect a tile with this range, skip tiles outside it and clip the tiles that straddle it.
#pragma once

#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif

#include "cpp/core/host_device.h"
#include "cpp/core/mask_type.h"


namespace te_jax {

struct KeyRange {
  int64_t begin;  // first visible key
  int64_t end;    // one past the last visible key; end <= begin means none
};

// The mask of one (batch) row set: its lengths and the static mask parameters.
struct RowMask {
  int64_t q_len;         // sq_b: rows at or past it see nothing
  int64_t kv_len;        // skv_b: keys at or past it are invisible
  int64_t diag_offset;   // p_i = i + diag_offset (skv_b - sq_b for bottom-right masks, else 0)
  bool causal;
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded
  // A packed row's document (the sm90 forward's document works, kernels/common/document_tables.cuh): its rows and keys
  // start here and end at q_len = kv_len; rows and keys before it belong to other documents.
  int64_t first = 0;

  TE_JAX_HOST_DEVICE KeyRange Keys(int64_t i) const {
    if (i >= q_len || i < first) return {0, 0};
    const int64_t p = i + diag_offset;
    int64_t begin = first;
    int64_t end = kv_len;
    if (causal && p + 1 < end) end = p + 1;
    if (window_right >= 0 && p + window_right + 1 < end) end = p + window_right + 1;
    if (window_left >= 0 && p - window_left > begin) begin = p - window_left;
    if (end < begin) end = begin;
    return {begin, end};
  }

  // The rows that see key j, as a range [begin, end) of row indices: Keys read the other way, for kernels that hold
  // keys and step over rows. Row i sees j iff first <= j < kv_len, first <= i < q_len, j <= p_i (causal),
  // j <= p_i + window_right and j >= p_i - window_left, each a bound on i.
  TE_JAX_HOST_DEVICE KeyRange Rows(int64_t j) const {
    if (j >= kv_len || j < first) return {0, 0};
    int64_t begin = first;
    int64_t end = q_len;
    if (causal && j - diag_offset > begin) begin = j - diag_offset;
    if (window_right >= 0 && j - diag_offset - window_right > begin) begin = j - diag_offset - window_right;
    if (window_left >= 0 && j - diag_offset + window_left + 1 < end) end = j - diag_offset + window_left + 1;
    if (end < begin) end = begin;
    return {begin, end};
  }
};

TE_JAX_HOST_DEVICE RowMask MakeRowMask(MaskType mask_type, int64_t q_len, int64_t kv_len, int64_t window_left,
                                       int64_t window_right) {
  return RowMask{q_len, kv_len, IsBottomRight(mask_type) ? kv_len - q_len : 0, IsCausal(mask_type), window_left,
                 window_right, /*first=*/0};
}

}  // namespace te_jax
