#include "cpp/cuda/nvrtc_compiler.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/sha256.h"

namespace te_jax::cuda {
namespace {

std::mutex& RootMutex() {
  static std::mutex mu;
  return mu;
}
std::string& KernelRoot() {
  static std::string root;
  return root;
}

// The headers a kernel TU may include: the device-only kernel tree and the shared headers it uses.
const char* const kSharedHeaders[] = {"cpp/core/flex_math.h", "cpp/core/flex_mods.h", "cpp/core/host_device.h",
                                      "cpp/core/kv_format.h", "cpp/core/kv_rows.h",   "cpp/core/mask_type.h",
                                      "cpp/core/philox.h",    "cpp/core/sink.h",      "cpp/core/variants.h",
                                      "cpp/core/visible_keys.h", "cpp/cuda/kernel_args.h"};
const char* const kKernelTree = "cpp/cuda/kernels";

}  // namespace

void SetKernelRoot(const std::string& root) {
  std::lock_guard<std::mutex> lock(RootMutex());
  KernelRoot() = root;
}

Status GetKernelSources(const KernelSources** out) {
  static KernelSources sources;
  static std::string loaded_root;
  static bool loaded = false;
  std::lock_guard<std::mutex> lock(RootMutex());
  *out = &sources;
  if (loaded && loaded_root == KernelRoot()) return Status::Ok();
  namespace fs = std::filesystem;
  const fs::path root = KernelRoot();
  if (KernelRoot().empty() || !fs::is_directory(root / kKernelTree)) {
    return Status::Unavailable("te_jax's CUDA kernel sources were not found (kernel root '" + KernelRoot() +
                               "' has no " + kKernelTree + "); the package is incomplete");
  }
  std::vector<std::string> names(std::begin(kSharedHeaders), std::end(kSharedHeaders));
  for (const auto& entry : fs::recursive_directory_iterator(root / kKernelTree)) {
    if (!entry.is_regular_file()) continue;
    const std::string ext = entry.path().extension().string();
    if (ext == ".h" || ext == ".cuh") names.push_back(fs::relative(entry.path(), root).generic_string());
  }
  std::sort(names.begin(), names.end());
  KernelSources fresh;
  std::string all;
  for (const std::string& name : names) {
    std::ifstream in(root / name, std::ios::binary);
    if (!in) return Status::Unavailable("cannot read kernel source " + (root / name).string());
    std::stringstream ss;
    ss << in.rdbuf();
    all += name + '\0' + ss.str() + '\0';
    fresh.headers.emplace_back(name, ss.str());
  }
  fresh.digest = Sha256Hex(all);
  sources = std::move(fresh);
  loaded_root = KernelRoot();
  loaded = true;
  return Status::Ok();
}

std::vector<std::string> NvrtcOptions(const std::string& arch) {
  // No fast-math: masked logits rely on -inf and IEEE exp2/log behaviour. -lineinfo costs nothing at run time and
  // lets compute-sanitizer name source lines.
  return {"--gpu-architecture=" + arch, "--std=c++17", "-default-device", "-lineinfo", "-DNDEBUG"};
}

Status NvrtcVersionString(std::string* version) {
  const NvrtcApi* nvrtc = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetNvrtc(&nvrtc));
  *version = "nvrtc " + std::to_string(nvrtc->major) + "." + std::to_string(nvrtc->minor);
  return Status::Ok();
}

Status CompileToCubin(const std::string& name, const std::string& source, const std::string& arch, std::string* cubin) {
  const NvrtcApi* nvrtc = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetNvrtc(&nvrtc));
  const KernelSources* sources = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetKernelSources(&sources));
  std::vector<const char*> header_text, header_names;
  for (const auto& [hname, text] : sources->headers) {
    header_names.push_back(hname.c_str());
    header_text.push_back(text.c_str());
  }
  nvrtcProgram prog = nullptr;
  nvrtcResult r = nvrtc->nvrtcCreateProgram(&prog, source.c_str(), (name + ".cu").c_str(),
                                            static_cast<int>(header_text.size()), header_text.data(),
                                            header_names.data());
  if (r != NVRTC_SUCCESS) return Status::Internal("nvrtcCreateProgram: " + std::string(nvrtc->nvrtcGetErrorString(static_cast<nvrtcResult>(r))));
  const std::vector<std::string> options = NvrtcOptions(arch);
  std::vector<const char*> opts;
  for (const std::string& o : options) opts.push_back(o.c_str());
  r = nvrtc->nvrtcCompileProgram(prog, static_cast<int>(opts.size()), opts.data());
  if (r != NVRTC_SUCCESS) {
    size_t log_size = 0;
    nvrtc->nvrtcGetProgramLogSize(prog, &log_size);
    std::string log(log_size, '\0');
    if (log_size > 0) nvrtc->nvrtcGetProgramLog(prog, log.data());
    nvrtc->nvrtcDestroyProgram(&prog);
    return Status::Internal("NVRTC failed to compile te_jax kernel " + name + " for " + arch + ": " +
                            nvrtc->nvrtcGetErrorString(static_cast<nvrtcResult>(r)) + "\n" + log);
  }
  size_t size = 0;
  r = nvrtc->nvrtcGetCUBINSize(prog, &size);
  if (r == NVRTC_SUCCESS) {
    cubin->assign(size, '\0');
    r = nvrtc->nvrtcGetCUBIN(prog, cubin->data());
  }
  nvrtc->nvrtcDestroyProgram(&prog);
  if (r != NVRTC_SUCCESS || size == 0) {
    return Status::Internal("NVRTC produced no cubin for " + name + " (" + arch + ")");
  }
  return Status::Ok();
}

}  // namespace te_jax::cuda
