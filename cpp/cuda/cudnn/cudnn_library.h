// libcudnn.so.9, loaded with dlopen on first use, and the cuDNN handles of each device. The frontend's
// dynamic-loading shim (NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING) resolves every backend call with dlsym on the global
// cudnn_frontend::cudnn_dlhandle, which LoadCudnn() sets to the library it opened by full path; the shim never
// dlopens libcudnn itself. libcudnn then loads its sub-libraries (libcudnn_graph, libcudnn_engines_*) from its own
// folder.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cpp/core/status.h"

struct cudnnContext;  // cudnn.h: typedef struct cudnnContext* cudnnHandle_t

namespace te_jax::cuda::cudnn {

void SetCudnnSearchPaths(std::vector<std::string> cudnn_paths, std::vector<std::string> cudart_paths);

// Loads libcudnn once per process (a failed attempt is retried at the next call, so search paths set later count).
// OK, or Unavailable naming what was searched, or a version too old for te_jax's contract.
Status LoadCudnn();
// cudnnGetVersion() of the loaded library (e.g. 91900); 0 before a successful LoadCudnn().
int64_t LoadedCudnnVersion();
// 91900 -> "9.19.0".
std::string CudnnVersionString(int64_t version);

// A handle of one device, held exclusively while the lease lives: cuDNN handles are not safe for concurrent use, and
// set-stream + enqueue must not interleave with another thread's. Graph building and execution take separate handles
// of the device so a long build (lowering) does not block executions.
enum class HandleUse { kBuild, kExecute };

class HandleLease {
 public:
  HandleLease() = default;
  HandleLease(const HandleLease&) = delete;
  HandleLease& operator=(const HandleLease&) = delete;
  cudnnContext* get() const { return handle_; }

 private:
  friend Status LeaseHandle(CUdevice device, HandleUse use, HandleLease* lease);
  std::unique_lock<std::mutex> lock_;
  cudnnContext* handle_ = nullptr;
};

// Creates the handle on first use, on the calling thread's current context (which must be `device`'s).
Status LeaseHandle(CUdevice device, HandleUse use, HandleLease* lease);
// cudnnSetStream on a leased handle.
Status SetStream(const HandleLease& lease, CUstream stream);

}  // namespace te_jax::cuda::cudnn
