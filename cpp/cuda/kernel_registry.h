// Where compiled kernels live in a process. A configuration's cubin is found in memory, else in the disk cache
// (jit_cache.h), else compiled with NVRTC and written there; it is then loaded once with the driver's
// context-independent library API (cuLibraryLoadData) and its entry points looked up. Lowering (prepare) does all of
// this so the first execution does not compile; the execute-time handler only looks the module up, and loads it from
// disk if this process has not (e.g. after a persistent compilation-cache hit). Thread-safe: different configurations
// compile in parallel (te_jax.aot), the same one once.
#pragma once

#include <cuda.h>

#include <string>
#include <vector>

#include "cpp/core/status.h"
#include "cpp/cuda/kernel_config.h"

namespace te_jax::cuda {

struct JitReport {
  std::string name;
  std::string path;    // the cache file
  std::string origin;  // "memory", "disk" or "compiled"
  double seconds = 0;  // time to produce the cubin (compile, or read and verify)
  std::string note;    // what the module's kernels decide per call on the device, for the log line ("" if nothing)
};

// Makes sure the cubin exists (memory, disk, or a fresh compile). Needs NVRTC only on a miss, and no GPU.
Status EnsureCubin(const KernelConfig& config, JitReport* report);

struct LoadedModule {
  // The module's entries (kernel_module.h), in its order: the kernels and the dynamic shared memory each needs.
  std::vector<CUkernel> kernels;
  std::vector<int> smem_bytes;
  // The registers a thread of each kernel takes (read on the first device that loads the module), which with the
  // shared memory bound how many CTAs an SM holds (decode_geometry.h).
  std::vector<int> registers;
  int count() const { return static_cast<int>(kernels.size()); }
  bool dependent_launch = false;  // DependentLaunch(its arch)
  bool tma = false;  // HasTma(its arch)
};

// The loaded module for `config` with its shared-memory limits raised on `device`.
Status GetLoadedModule(const KernelConfig& config, CUdevice device, const LoadedModule** module, JitReport* report);

// The device (and its NVRTC arch) of the calling thread's current context, else device 0.
Status CurrentDeviceArch(CUdevice* device, std::string* arch);

}  // namespace te_jax::cuda
