// The CPU backend: flash-style tiled attention, forward and backward, over the shared AttentionParams. These are the
// entry points both CPU handlers (FFI and legacy) call: each validates the params and the seqlens first, so the two
// paths accept and refuse the same calls.
#pragma once

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "cpp/cpu/parallel_for.h"

namespace te_jax::cpu {

Status AttentionForward(const AttentionParams& params, const ForwardBuffers& buffers, TaskScheduler* scheduler);

// The CPU backward allocates its per-worker scratch itself on the host, so it needs no scratch from XLA.
inline int64_t BackwardWorkspaceBytes(const AttentionParams&) { return 0; }

Status AttentionBackward(const AttentionParams& params, const BackwardBuffers& buffers, TaskScheduler* scheduler);

}  // namespace te_jax::cpu
