// Compiles a rendered translation unit to a cubin for one exact arch with NVRTC (straight to SASS: PTX from a newer
// NVRTC would not JIT on an older driver). The kernel headers are handed to NVRTC in memory, read once from the
// package's kernel folder, so the cache key can hash exactly the text that is compiled.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "cpp/core/status.h"

namespace te_jax::cuda {

// The folder that holds cpp/... (the repository root, or te_jax/kernels in an installed package).
void SetKernelRoot(const std::string& root);

struct KernelSources {
  std::vector<std::pair<std::string, std::string>> headers;  // include name ("cpp/core/variants.h") -> text, sorted
  std::string digest;                                        // sha256 over every name and text
};
Status GetKernelSources(const KernelSources** sources);

std::vector<std::string> NvrtcOptions(const std::string& arch);

// A string naming the NVRTC in use ("nvrtc 13.0"), part of the cache key.
Status NvrtcVersionString(std::string* version);

Status CompileToCubin(const std::string& name, const std::string& source, const std::string& arch, std::string* cubin);

}  // namespace te_jax::cuda
