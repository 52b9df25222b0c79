// te_jax's attention as cuDNN SDPA graphs: the layouts (te_jax's row-major [B, S, H, D] expressed as cuDNN's
// [B, H, S, D] dims with strides), the mask (cudnn_mask.h) and scale, the build of one forward or backward graph with
// its execution plan, and its execution. The only file that uses the frontend's graph API.
#pragma once

#include <cstdint>
#include <memory>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "cpp/cuda/kernel_config.h"

namespace cudnn_frontend::graph {
class Graph;
}  // namespace cudnn_frontend::graph
struct cudnnContext;

namespace te_jax::cuda::cudnn {

struct SdpaGraph {
  std::shared_ptr<const cudnn_frontend::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

// Builds the graph of `params` (which must pass CheckCudnnContract) for a device of compute capability `sm_version`
// (e.g. 90) with a handle of that device. InvalidArgument with cuDNN's reason when cuDNN has no plan for it; Internal
// when a CUDA or cuDNN call failed on the way.
Status BuildSdpaGraph(const AttentionParams& params, Direction direction, int sm_version, cudnnContext* handle,
                      SdpaGraph* out);

// Enqueue on the handle's stream. The buffers' workspace must hold graph.workspace_bytes (the caller checks).
Status ExecuteSdpaForward(const SdpaGraph& graph, const AttentionParams& params, const ForwardBuffers& buffers,
                          cudnnContext* handle);
// dlse is not an input: cuDNN's backward computes dS = P * (dP - rowsum(dO * O)) with no lse cotangent, so the
// caller routes a backward here only when dlse is known to be zero (only `out` is differentiated).
Status ExecuteSdpaBackward(const SdpaGraph& graph, const AttentionParams& params, const BackwardBuffers& buffers,
                           cudnnContext* handle);

}  // namespace te_jax::cuda::cudnn
