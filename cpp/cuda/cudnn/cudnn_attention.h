// The cuDNN engine of the CUDA backend: te_jax's forward and backward run as cuDNN's fused SDPA graphs, built with the
// cuDNN C++ frontend (header-only) over a libcudnn.so.9 that is loaded with dlopen on first use, never linked. A build
// without the cuDNN headers compiles cudnn_unavailable.cc instead, whose functions all report why.
//
// The engine serves a call only where cuDNN meets te_jax's contract exactly (README "Semantics"); Supports() says why
// not otherwise. Graphs and their execution plans are built once per device and configuration (at lowering, by
// Prepare) and kept for the life of the process, so an execution only looks its graph up and enqueues it.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "cpp/cuda/kernel_config.h"

namespace te_jax::cuda::cudnn {

// Whether this build compiled the engine (it found cuDNN's and the frontend's headers).
bool Built();
// Whether this build has the engine and libcudnn loads (>= 9.x that supports what we need); the reason otherwise
// (e.g. "te_jax was built without the cuDNN headers ..." or "libcudnn.so.9 not found ...").
Status Available();
std::string Version();  // e.g. "9.19.0" or "" when unavailable
// OK if the engine serves this call with te_jax's exact contract; InvalidArgument with a message saying WHY not
// otherwise (e.g. "cuDNN has no soft-cap"); Unavailable (Available()'s status) without a usable cuDNN.
// Static: depends only on params (+ the device's arch / cuDNN version), never on data.
Status Supports(const AttentionParams& params, Direction direction);
// Bytes of ForwardBuffers/BackwardBuffers::workspace the call needs (builds the graph on the current device if no
// call has; 0 when it cannot be built: Prepare or Supports report why).
int64_t ForwardWorkspaceBytes(const AttentionParams& params);
int64_t BackwardWorkspaceBytes(const AttentionParams& params);
// Lowering time: builds (and caches in memory, per device + params) the graph and its execution plan so that
// execute time does no graph building. Uses the calling thread's current CUDA context (else device 0's primary one).
Status Prepare(const AttentionParams& params, Direction direction);
// Execute time: on `stream`, no host sync, no allocation (workspace comes in the buffers), command-buffer compatible.
Status Forward(const AttentionParams& params, const ForwardBuffers& buffers, CUstream stream);
Status Backward(const AttentionParams& params, const BackwardBuffers& buffers, CUstream stream);

// Where libcudnn.so.9 is looked for before the loader's default search when $TE_JAX_CUDNN_PATH is not set (the Python
// layer passes the pip wheel's nvidia/cudnn/lib/libcudnn.so.9), and where the CUDA runtime the cuDNN frontend calls is
// preloaded from (the pip wheel's nvidia/cu13/lib/libcudart.so.13). Takes effect at the next load attempt.
void SetLibrarySearchPaths(std::vector<std::string> cudnn_paths, std::vector<std::string> cudart_paths);

}  // namespace te_jax::cuda::cudnn
