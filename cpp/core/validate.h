// The one validation of an AttentionParams, run by both entry paths before any work is done, so the FFI and the
// legacy path accept and refuse exactly the same calls with the same messages.
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"
#include "cpp/core/limits.h"
#include "cpp/core/status.h"

namespace te_jax {

enum class Backend : uint8_t { kCpu = 0, kCuda = 1 };

// Whether a backend's kernels read a paged KV cache in place (cpp/core/kv_rows.h) for a call of seqlen_q query positions:
// the CPU backend's always, the CUDA backend's in its decode kernels (at most kMaxDecodeSeqlenQ positions). For the
// other calls te_jax.paged_attention gathers the pages into contiguous K/V (its _IN_PLACE_MAX_SEQLEN_Q).
inline constexpr bool BackendServesPagesInPlace(Backend backend, int64_t seqlen_q) {
  return backend == Backend::kCpu || seqlen_q <= kMaxDecodeSeqlenQ;
}

Status ValidateAttentionParams(const AttentionParams& params, Backend backend);

// What only the backward refuses (on top of ValidateAttentionParams): a paged KV cache, whose gradient
// te_jax.paged_attention takes through the gathered pages instead; on the CUDA backend deterministic=True with a bias
// whose gradient sums over a dim (float atomics, in no fixed order).
Status ValidateBackwardParams(const AttentionParams& params, Backend backend);

// Runtime check of the per-batch lengths (they are data, so only a handler that can read them can check them).
Status ValidateSeqlens(const AttentionParams& params, const int32_t* q_seqlens, const int32_t* kv_seqlens);

// Runtime check of a paged call's page table (data too): the ids of the pages each sequence uses (those holding its
// first kv_seqlens[b] keys) must lie in [0, num_pages). Run after ValidateSeqlens; nothing without paging.
Status ValidatePageTable(const AttentionParams& params, const int32_t* page_table, const int32_t* kv_seqlens);

}  // namespace te_jax
