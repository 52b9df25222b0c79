#include "cpp/cuda/dynamic_libs.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

namespace te_jax::cuda {
namespace {

template <typename Fn>
bool Bind(void* lib, const char* name, Fn* fn, std::string* missing) {
  *fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (*fn == nullptr) *missing += std::string(missing->empty() ? "" : ", ") + name;
  return *fn != nullptr;
}

std::mutex& NvrtcMutex() {
  static std::mutex mu;
  return mu;
}

std::vector<std::string>& NvrtcPaths() {
  static std::vector<std::string> paths;
  return paths;
}

}  // namespace

std::string DriverApi::ErrorString(CUresult r) const {
  const char* s = nullptr;
  if (cuGetErrorString != nullptr && cuGetErrorString(r, &s) == CUDA_SUCCESS && s != nullptr) return s;
  return "CUresult " + std::to_string(static_cast<int>(r));
}

Status GetDriver(const DriverApi** api) {
  static DriverApi driver;
  static Status status = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      return Status::Unavailable(std::string("te_jax's CUDA backend needs the NVIDIA driver library libcuda.so.1, "
                                             "which could not be loaded: ") + (err ? err : "unknown error"));
    }
    std::string missing;
    Bind(lib, "cuInit", &driver.cuInit, &missing);
    Bind(lib, "cuGetErrorString", &driver.cuGetErrorString, &missing);
    Bind(lib, "cuDriverGetVersion", &driver.cuDriverGetVersion, &missing);
    Bind(lib, "cuDeviceGet", &driver.cuDeviceGet, &missing);
    Bind(lib, "cuDeviceGetAttribute", &driver.cuDeviceGetAttribute, &missing);
    Bind(lib, "cuCtxGetDevice", &driver.cuCtxGetDevice, &missing);
    Bind(lib, "cuLibraryLoadData", &driver.cuLibraryLoadData, &missing);
    Bind(lib, "cuLibraryGetKernel", &driver.cuLibraryGetKernel, &missing);
    Bind(lib, "cuKernelSetAttribute", &driver.cuKernelSetAttribute, &missing);
    Bind(lib, "cuKernelGetAttribute", &driver.cuKernelGetAttribute, &missing);
    Bind(lib, "cuLaunchKernel", &driver.cuLaunchKernel, &missing);
    Bind(lib, "cuLaunchKernelEx", &driver.cuLaunchKernelEx, &missing);
    Bind(lib, "cuMemsetD8Async", &driver.cuMemsetD8Async, &missing);
    // The _v2 symbols are the 64-bit-size versions cuda.h's macros name (the plain ones are the CUDA 3 ABI).
    Bind(lib, "cuDeviceGetName", &driver.cuDeviceGetName, &missing);
    Bind(lib, "cuDevicePrimaryCtxRetain", &driver.cuDevicePrimaryCtxRetain, &missing);
    Bind(lib, "cuDevicePrimaryCtxRelease_v2", &driver.cuDevicePrimaryCtxRelease, &missing);
    Bind(lib, "cuCtxPushCurrent_v2", &driver.cuCtxPushCurrent, &missing);
    Bind(lib, "cuCtxPopCurrent_v2", &driver.cuCtxPopCurrent, &missing);
    Bind(lib, "cuMemAlloc_v2", &driver.cuMemAlloc, &missing);
    Bind(lib, "cuMemFree_v2", &driver.cuMemFree, &missing);
    Bind(lib, "cuMemsetD16Async", &driver.cuMemsetD16Async, &missing);
    Bind(lib, "cuMemsetD32Async", &driver.cuMemsetD32Async, &missing);
    Bind(lib, "cuStreamCreate", &driver.cuStreamCreate, &missing);
    Bind(lib, "cuStreamDestroy_v2", &driver.cuStreamDestroy, &missing);
    Bind(lib, "cuStreamSynchronize", &driver.cuStreamSynchronize, &missing);
    Bind(lib, "cuEventCreate", &driver.cuEventCreate, &missing);
    Bind(lib, "cuEventDestroy_v2", &driver.cuEventDestroy, &missing);
    Bind(lib, "cuEventRecord", &driver.cuEventRecord, &missing);
    Bind(lib, "cuEventElapsedTime", &driver.cuEventElapsedTime, &missing);  // v1: also in CUDA 12 drivers
    Bind(lib, "cuTensorMapEncodeTiled", &driver.cuTensorMapEncodeTiled, &missing);
    if (!missing.empty()) {
      return Status::Unavailable("libcuda.so.1 lacks " + missing + " (te_jax needs a CUDA 12.0 or newer driver)");
    }
    const CUresult r = driver.cuInit(0);
    if (r != CUDA_SUCCESS) return Status::Unavailable("cuInit failed: " + driver.ErrorString(r));
    return Status::Ok();
  }();
  *api = &driver;
  return status;
}

std::vector<std::string> LibraryCandidates(const char* env_var, std::vector<std::string> defaults) {
  const char* value = std::getenv(env_var);
  if (value != nullptr && *value != '\0') return {value};
  return defaults;
}

Status LibraryNotLoaded(const char* env_var, const std::string& what, const std::string& tried) {
  const char* value = std::getenv(env_var);
  if (value != nullptr && *value != '\0') {
    return Status::Unavailable(std::string(env_var) + " is set to " + value + ", which could not be loaded (unset it to "
                               "search the default places):" + tried);
  }
  return Status::Unavailable(what + " Tried:" + tried);
}

void SetNvrtcSearchPaths(std::vector<std::string> paths) {
  std::lock_guard<std::mutex> lock(NvrtcMutex());
  NvrtcPaths() = std::move(paths);
}

Status GetNvrtc(const NvrtcApi** api) {
  static NvrtcApi nvrtc;
  static bool loaded = false;
  std::lock_guard<std::mutex> lock(NvrtcMutex());
  *api = &nvrtc;
  if (loaded) return Status::Ok();
  std::vector<std::string> defaults = NvrtcPaths();
  defaults.push_back("libnvrtc.so.13");
  defaults.push_back("libnvrtc.so.12");
  const std::vector<std::string> candidates = LibraryCandidates("TE_JAX_NVRTC_PATH", std::move(defaults));
  std::string tried;
  void* lib = nullptr;
  for (const std::string& path : candidates) {
    if (path.find('/') != std::string::npos) {
      // NVRTC dlopens its builtins library by soname; the pip wheel keeps it beside libnvrtc without an rpath entry
      // that finds it, so load it first from the same folder.
      const std::filesystem::path dir = std::filesystem::path(path).parent_path();
      std::error_code ec;
      for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("libnvrtc-builtins.so.", 0) == 0 && name.find("alt") == std::string::npos) {
          dlopen(entry.path().c_str(), RTLD_NOW | RTLD_GLOBAL);
        }
      }
    }
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      nvrtc.path = path;
      break;
    }
    const char* err = dlerror();
    tried += "\n  " + path + ": " + (err ? err : "not found");
  }
  if (lib == nullptr) {
    return LibraryNotLoaded("TE_JAX_NVRTC_PATH",
                            "te_jax's CUDA backend compiles its kernels with NVRTC, which could not be loaded. "
                            "Install it with `pip install \"te_jax[cuda]\"` (nvidia-cuda-nvrtc) or set "
                            "TE_JAX_NVRTC_PATH to libnvrtc.so.",
                            tried);
  }
  std::string missing;
  Bind(lib, "nvrtcVersion", &nvrtc.nvrtcVersion, &missing);
  Bind(lib, "nvrtcGetErrorString", &nvrtc.nvrtcGetErrorString, &missing);
  Bind(lib, "nvrtcCreateProgram", &nvrtc.nvrtcCreateProgram, &missing);
  Bind(lib, "nvrtcDestroyProgram", &nvrtc.nvrtcDestroyProgram, &missing);
  Bind(lib, "nvrtcCompileProgram", &nvrtc.nvrtcCompileProgram, &missing);
  Bind(lib, "nvrtcGetProgramLogSize", &nvrtc.nvrtcGetProgramLogSize, &missing);
  Bind(lib, "nvrtcGetProgramLog", &nvrtc.nvrtcGetProgramLog, &missing);
  Bind(lib, "nvrtcGetCUBINSize", &nvrtc.nvrtcGetCUBINSize, &missing);
  Bind(lib, "nvrtcGetCUBIN", &nvrtc.nvrtcGetCUBIN, &missing);
  if (!missing.empty()) return Status::Unavailable(nvrtc.path + " lacks " + missing);
  nvrtc.nvrtcVersion(&nvrtc.major, &nvrtc.minor);
  loaded = true;
  return Status::Ok();
}

}  // namespace te_jax::cuda
