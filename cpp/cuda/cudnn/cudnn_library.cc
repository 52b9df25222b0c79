#include "cpp/cuda/cudnn/cudnn_library.h"

#include <cudnn.h>
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>

#include "cpp/cuda/dynamic_libs.h"

#if CUDNN_MAJOR != 9
#error "te_jax's cuDNN engine is written against the cuDNN 9 headers"
#endif

// The frontend's dynamic-loading shim declares this handle and resolves every cuDNN call with dlsym on it; the
// application defines it and sets it before the first call (each shim call caches its symbol on first use).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace te_jax::cuda::cudnn {
namespace {

// 9.10.2: from 9.10 the frontend masks with -inf rather than the lowest float, so a row with no visible key does not
// turn into a uniform average of masked keys; 9.10.0 and 9.10.1 have a backward bug the frontend refuses.
constexpr int64_t kMinVersion = 91002;

struct Library {
  cudnnStatus_t (*create)(cudnnHandle_t*) = nullptr;
  cudnnStatus_t (*set_stream)(cudnnHandle_t, cudaStream_t) = nullptr;
  const char* (*error_string)(cudnnStatus_t) = nullptr;
  std::atomic<int64_t> version{0};  // nonzero once loaded
};

Library& Lib() {
  static Library lib;
  return lib;
}

std::mutex& LoadMutex() {
  static std::mutex mu;
  return mu;
}

struct SearchPaths {
  std::vector<std::string> cudnn;
  std::vector<std::string> cudart;
};

SearchPaths& Paths() {
  static SearchPaths paths;
  return paths;
}

std::string ErrorString(cudnnStatus_t status) {
  const char* s = Lib().error_string != nullptr ? Lib().error_string(status) : nullptr;
  return s != nullptr ? s : "cudnnStatus_t " + std::to_string(static_cast<int>(status));
}

// The frontend calls a few CUDA runtime functions (error strings, the workspace memsets some plans need before they
// run) through its own dlopen of "libcudart.so.12" / "libcudart.so.13" by soname. A library already loaded under
// that soname is what such a dlopen returns, so loading the pip wheel's copy by full path here makes it findable
// without LD_LIBRARY_PATH. Best effort, unless $TE_JAX_CUDART_PATH names one: a process that already has a CUDA
// runtime (JAX's plugin) needs none.
Status PreloadCudart(const std::vector<std::string>& paths) {
  std::string tried;
  for (const std::string& path : LibraryCandidates("TE_JAX_CUDART_PATH", paths)) {
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) != nullptr) return Status::Ok();
    const char* err = dlerror();
    tried += "\n  " + path + ": " + (err ? err : "not found");
  }
  const char* named = std::getenv("TE_JAX_CUDART_PATH");
  return named != nullptr && *named != '\0' ? LibraryNotLoaded("TE_JAX_CUDART_PATH", "", tried) : Status::Ok();
}

Status LoadLocked() {
  Library& lib = Lib();
  TE_JAX_RETURN_IF_ERROR(PreloadCudart(Paths().cudart));
  // cuDNN's runtime-compiled engines dlopen NVRTC by soname; te_jax's own NVRTC (the pip wheel's, loaded by full
  // path) answers that dlopen once loaded. Best effort: without it cuDNN only loses those engines.
  const NvrtcApi* nvrtc = nullptr;
  (void)GetNvrtc(&nvrtc);

  std::vector<std::string> defaults = Paths().cudnn;
  defaults.push_back("libcudnn.so.9");
  const std::vector<std::string> candidates = LibraryCandidates("TE_JAX_CUDNN_PATH", std::move(defaults));
  std::string tried;
  void* handle = nullptr;
  std::string path;
  for (const std::string& candidate : candidates) {
    handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle != nullptr) {
      path = candidate;
      break;
    }
    const char* err = dlerror();
    tried += "\n  " + candidate + ": " + (err ? err : "not found");
  }
  if (handle == nullptr) {
    return LibraryNotLoaded("TE_JAX_CUDNN_PATH",
                            "libcudnn.so.9 not found (install nvidia-cudnn-cu13, or set TE_JAX_CUDNN_PATH to "
                            "libcudnn.so.9).",
                            tried);
  }
  auto get_version = reinterpret_cast<size_t (*)()>(dlsym(handle, "cudnnGetVersion"));
  lib.create = reinterpret_cast<decltype(lib.create)>(dlsym(handle, "cudnnCreate"));
  lib.set_stream = reinterpret_cast<decltype(lib.set_stream)>(dlsym(handle, "cudnnSetStream"));
  lib.error_string = reinterpret_cast<decltype(lib.error_string)>(dlsym(handle, "cudnnGetErrorString"));
  if (get_version == nullptr || lib.create == nullptr || lib.set_stream == nullptr || lib.error_string == nullptr) {
    return Status::Unavailable(path + " lacks cudnnGetVersion, cudnnCreate, cudnnSetStream or cudnnGetErrorString");
  }
  const int64_t version = static_cast<int64_t>(get_version());
  if (version / 10000 != 9 || version < kMinVersion) {
    return Status::Unavailable(path + " is cuDNN " + CudnnVersionString(version) +
                               "; te_jax's cuDNN engine needs cuDNN 9, 9.10.2 or newer");
  }
  cudnn_frontend::cudnn_dlhandle = handle;
  lib.version.store(version, std::memory_order_release);
  return Status::Ok();
}

struct DeviceHandles {
  std::mutex mu[2];
  cudnnHandle_t handle[2] = {nullptr, nullptr};
};

DeviceHandles& HandlesOf(CUdevice device) {
  static std::mutex mu;
  static std::map<CUdevice, std::unique_ptr<DeviceHandles>> devices;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<DeviceHandles>& slot = devices[device];
  if (slot == nullptr) slot = std::make_unique<DeviceHandles>();
  return *slot;
}

}  // namespace

void SetCudnnSearchPaths(std::vector<std::string> cudnn_paths, std::vector<std::string> cudart_paths) {
  std::lock_guard<std::mutex> lock(LoadMutex());
  Paths() = SearchPaths{std::move(cudnn_paths), std::move(cudart_paths)};
}

Status LoadCudnn() {
  if (Lib().version.load(std::memory_order_acquire) != 0) return Status::Ok();
  std::lock_guard<std::mutex> lock(LoadMutex());
  if (Lib().version.load(std::memory_order_acquire) != 0) return Status::Ok();
  return LoadLocked();
}

int64_t LoadedCudnnVersion() { return Lib().version.load(std::memory_order_acquire); }

std::string CudnnVersionString(int64_t version) {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

Status LeaseHandle(CUdevice device, HandleUse use, HandleLease* lease) {
  TE_JAX_RETURN_IF_ERROR(LoadCudnn());
  DeviceHandles& handles = HandlesOf(device);
  const int slot = use == HandleUse::kBuild ? 0 : 1;
  std::unique_lock<std::mutex> lock(handles.mu[slot]);
  if (handles.handle[slot] == nullptr) {
    // Kept for the life of the process, like the graphs that run on it: destroying a handle at exit could run after
    // the driver has torn the context down.
    const cudnnStatus_t status = Lib().create(&handles.handle[slot]);
    if (status != CUDNN_STATUS_SUCCESS) {
      handles.handle[slot] = nullptr;
      return Status::Internal("cudnnCreate failed on device " + std::to_string(device) + ": " + ErrorString(status));
    }
  }
  lease->lock_ = std::move(lock);
  lease->handle_ = handles.handle[slot];
  return Status::Ok();
}

Status SetStream(const HandleLease& lease, CUstream stream) {
  const cudnnStatus_t status = Lib().set_stream(lease.get(), stream);
  if (status != CUDNN_STATUS_SUCCESS) return Status::Internal("cudnnSetStream failed: " + ErrorString(status));
  return Status::Ok();
}

}  // namespace te_jax::cuda::cudnn
