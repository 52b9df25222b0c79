// Which calls the cuDNN engine can serve with te_jax's exact contract (README "Semantics"), decided from the params
// alone, before cuDNN is asked. What depends on the GPU and the cuDNN version (head dims per arch, D != Dv, the
// deterministic backward, s_q = s_kv = 1 in the backward, ...) is left to the graph build, whose refusal carries
// cuDNN's own reason (cudnn_sdpa_graph.h).
#pragma once

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"

namespace te_jax::cuda::cudnn {

// OK, or InvalidArgument saying which part of the contract cuDNN does not meet.
Status CheckCudnnContract(const AttentionParams& params);

}  // namespace te_jax::cuda::cudnn
