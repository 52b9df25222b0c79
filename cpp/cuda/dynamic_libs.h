// The CUDA driver and NVRTC, loaded at run time with dlopen so te_jax links against neither: the extension imports on
// machines without a GPU or NVRTC, and a missing library becomes a Status naming what is missing and where it looked.
// cuda.h is included for its types only; NVRTC's few types are declared here, so nvrtc.h is not needed to build.
#pragma once

#include <cuda.h>

#include <string>
#include <vector>

#include "cpp/core/status.h"

namespace te_jax::cuda {

struct DriverApi {
  CUresult (*cuInit)(unsigned int);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*cuCtxGetDevice)(CUdevice*);
  CUresult (*cuLibraryLoadData)(CUlibrary*, const void*, CUjit_option*, void**, unsigned int, CUlibraryOption*, void**,
                                unsigned int);
  CUresult (*cuLibraryGetKernel)(CUkernel*, CUlibrary, const char*);
  CUresult (*cuKernelSetAttribute)(CUfunction_attribute, int, CUkernel, CUdevice);
  CUresult (*cuKernelGetAttribute)(int*, CUfunction_attribute, CUkernel, CUdevice);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int, unsigned int,
                             unsigned int, unsigned int, CUstream, void**, void**);
  CUresult (*cuLaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);  // a dependent launch
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
  // Lowering-time measurement of the engines (engine_timing.h): scratch buffers, a stream and events.
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuMemsetD16Async)(CUdeviceptr, unsigned short, size_t, CUstream);
  CUresult (*cuMemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream);
  CUresult (*cuStreamCreate)(CUstream*, unsigned int);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuEventCreate)(CUevent*, unsigned int);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent);
  // The sm90 family's TMA descriptors (tensor_maps.h).
  CUresult (*cuTensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

  std::string ErrorString(CUresult r) const;
};

// nvrtc.h's types, ABI-identical: nvrtcResult is a C enum (int), nvrtcProgram an opaque pointer.
using nvrtcResult = int;
using nvrtcProgram = struct _nvrtcProgram*;
inline constexpr nvrtcResult NVRTC_SUCCESS = 0;

struct NvrtcApi {
  nvrtcResult (*nvrtcVersion)(int*, int*);
  const char* (*nvrtcGetErrorString)(nvrtcResult);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                                    const char* const*);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram*);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char*);
  int major = 0;
  int minor = 0;
  std::string path;  // the library that was loaded
};

// The driver (libcuda.so.1), loaded and cuInit'ed once per process. Returns Unavailable with the dlopen error when the
// library is missing (no NVIDIA driver on this machine).
Status GetDriver(const DriverApi** api);

// Paths NVRTC is looked for at, in order, before the loader's default search ("libnvrtc.so.13", "libnvrtc.so.12").
// The Python layer sets them to the pip wheel's copy (nvidia/cu13/lib/libnvrtc.so.13).
void SetNvrtcSearchPaths(std::vector<std::string> paths);
// NVRTC from $TE_JAX_NVRTC_PATH when it is set (LibraryCandidates), else from the search paths.
Status GetNvrtc(const NvrtcApi** api);

// The libraries to try, in order: the one the environment variable `env_var` names when it is set, alone (a library
// the user names is never silently replaced by another), else `defaults`.
std::vector<std::string> LibraryCandidates(const char* env_var, std::vector<std::string> defaults);

// Why none of the candidates loaded: `tried` lists each with the loader's reason. When `env_var` is set, the message
// names it (the candidate was its value); otherwise it is `what`, followed by the list.
Status LibraryNotLoaded(const char* env_var, const std::string& what, const std::string& tried);

}  // namespace te_jax::cuda
