// The token tables of a packed-sequence call (TokenArgs, cpp/cuda/kernel_args.h) live in the call's workspace, after
// the scratch the attention kernels take for themselves; the tokens kernels fill them first on the call's stream.
#pragma once

#include <cstdint>

#include "cpp/core/attention_params.h"
#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

// Whether a call reads segment ids or positions (and so runs the kernels built with tokens).
inline bool UsesTokens(const AttentionParams& p) { return p.has_segment_ids || p.has_positions; }

// Bytes of the tables (0 without tokens); `offset` bytes of other scratch before them are rounded up to 256.
int64_t TokenTablesBytes(const AttentionParams& p);
int64_t TokenTablesOffset(int64_t offset);

// Bytes of the sm90 forward's document table (kernel_args.h), where a forward may read its packed rows as documents:
// segment ids over keys that are the queries' tokens (Sq = Skv); else 0. It follows the token tables in the
// workspace.
int64_t DocumentTableBytes(const AttentionParams& p);

// The kernels' TokenArgs: the operands as given (null where the call has none) and the tables at `tables`.
TokenArgs MakeTokenArgs(const AttentionParams& p, const int32_t* q_ids, const int32_t* kv_ids, const int32_t* q_pos,
                        const int32_t* kv_pos, void* tables);

}  // namespace te_jax::cuda
