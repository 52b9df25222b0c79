#include "cpp/cuda/kernel_registry.h"

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/jit_cache.h"
#include "cpp/cuda/kernel_module.h"
#include "cpp/cuda/nvrtc_compiler.h"
#include "cpp/cuda/sha256.h"

namespace te_jax::cuda {
namespace {

struct Entry {
  std::mutex mu;
  std::string cubin;
  std::string path;
  CUlibrary library = nullptr;
  LoadedModule module;
  std::set<int> devices;  // devices whose shared-memory limits are raised
};

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}

std::map<std::string, std::shared_ptr<Entry>>& Registry() {
  static auto* registry = new std::map<std::string, std::shared_ptr<Entry>>();  // never destroyed: outlives XLA
  return *registry;
}

std::shared_ptr<Entry> EntryFor(const std::string& name) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto& slot = Registry()[name];
  if (!slot) slot = std::make_shared<Entry>();
  return slot;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Must hold entry->mu.
Status EnsureCubinLocked(const KernelConfig& config, Entry* entry, JitReport* report) {
  report->name = config.Name();
  if (!entry->cubin.empty()) {
    report->origin = "memory";
    report->path = entry->path;
    return Status::Ok();
  }
  const auto start = std::chrono::steady_clock::now();
  const KernelSources* sources = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetKernelSources(&sources));
  std::string nvrtc_version;
  // Without NVRTC the key cannot be formed; the cubin can then only come from a compile, which needs NVRTC anyway.
  TE_JAX_RETURN_IF_ERROR(NvrtcVersionString(&nvrtc_version));
  const std::string source = RenderSource(config);
  std::string key_text = report->name + '\0' + source + '\0' + sources->digest + '\0' + config.arch + '\0' + nvrtc_version;
  for (const std::string& option : NvrtcOptions(config.arch)) key_text += '\0' + option;
  const std::string key = Sha256Hex(key_text);
  entry->path = CachePath(report->name, key);
  report->path = entry->path;
  if (ReadCacheEntry(entry->path, &entry->cubin)) {
    report->origin = "disk";
    report->seconds = SecondsSince(start);
    return Status::Ok();
  }
  std::string cubin;
  TE_JAX_RETURN_IF_ERROR(CompileToCubin(report->name, source, config.arch, &cubin));
  // A cache that cannot be written (read-only home) costs a recompile per process, not a failure.
  (void)WriteCacheEntry(entry->path, cubin);
  entry->cubin = std::move(cubin);
  report->origin = "compiled";
  report->seconds = SecondsSince(start);
  return Status::Ok();
}

}  // namespace

Status EnsureCubin(const KernelConfig& config, JitReport* report) {
  std::shared_ptr<Entry> entry = EntryFor(config.Name());
  std::lock_guard<std::mutex> lock(entry->mu);
  return EnsureCubinLocked(config, entry.get(), report);
}

Status GetLoadedModule(const KernelConfig& config, CUdevice device, const LoadedModule** module, JitReport* report) {
  std::shared_ptr<Entry> entry = EntryFor(config.Name());
  std::lock_guard<std::mutex> lock(entry->mu);
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  if (entry->library == nullptr) {
    TE_JAX_RETURN_IF_ERROR(EnsureCubinLocked(config, entry.get(), report));
    CUresult r = driver->cuLibraryLoadData(&entry->library, entry->cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (r != CUDA_SUCCESS && report->origin == "disk") {
      // A cubin that passed the checksum but does not load (e.g. written by a broken build): rebuild it once.
      entry->cubin.clear();
      std::string cubin;
      TE_JAX_RETURN_IF_ERROR(CompileToCubin(config.Name(), RenderSource(config), config.arch, &cubin));
      (void)WriteCacheEntry(entry->path, cubin);
      entry->cubin = std::move(cubin);
      report->origin = "compiled";
      r = driver->cuLibraryLoadData(&entry->library, entry->cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0);
    }
    if (r != CUDA_SUCCESS) {
      entry->library = nullptr;
      return Status::Internal("cannot load te_jax kernel " + config.Name() + ": " + driver->ErrorString(r));
    }
    const KernelModule module = ModuleFor(config);
    const int count = static_cast<int>(module.entries.size());
    entry->module.kernels.assign(count, nullptr);
    entry->module.smem_bytes.assign(count, 0);
    for (int i = 0; i < count; ++i) {
      const ModuleEntry& e = module.entries[i];
      r = driver->cuLibraryGetKernel(&entry->module.kernels[i], entry->library, e.name.c_str());
      if (r != CUDA_SUCCESS) {
        return Status::Internal("te_jax kernel " + config.Name() + " has no entry point " + e.name + ": " +
                                driver->ErrorString(r));
      }
      entry->module.smem_bytes[i] = e.smem_bytes;
    }
    entry->module.dependent_launch = DependentLaunch(config.arch);
    entry->module.tma = HasTma(config.arch);
  } else {
    report->name = config.Name();
    report->origin = "memory";
    report->path = entry->path;
  }
  if (entry->devices.count(device) == 0) {
    // The registers once, before any launch reads them: launches on other devices read them without the lock.
    if (entry->module.registers.empty()) {
      std::vector<int> registers(entry->module.count(), 0);
      for (int i = 0; i < entry->module.count(); ++i) {
        const CUresult r = driver->cuKernelGetAttribute(&registers[i], CU_FUNC_ATTRIBUTE_NUM_REGS,
                                                        entry->module.kernels[i], device);
        if (r != CUDA_SUCCESS) {
          return Status::Internal("cannot read the registers of te_jax kernel " + config.Name() + ": " +
                                  driver->ErrorString(r));
        }
      }
      entry->module.registers = std::move(registers);
    }
    for (int i = 0; i < entry->module.count(); ++i) {
      if (entry->module.smem_bytes[i] <= 48 * 1024) continue;
      const CUresult r = driver->cuKernelSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                      entry->module.smem_bytes[i], entry->module.kernels[i], device);
      if (r != CUDA_SUCCESS) {
        return Status::Internal("te_jax kernel " + config.Name() + " needs " +
                                std::to_string(entry->module.smem_bytes[i]) +
                                " bytes of shared memory, which this GPU refuses: " + driver->ErrorString(r));
      }
    }
    entry->devices.insert(device);
  }
  *module = &entry->module;
  return Status::Ok();
}

Status CurrentDeviceArch(CUdevice* device, std::string* arch) {
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  if (driver->cuCtxGetDevice(device) != CUDA_SUCCESS) {
    const CUresult r = driver->cuDeviceGet(device, 0);
    if (r != CUDA_SUCCESS) return Status::Unavailable("no CUDA device: " + driver->ErrorString(r));
  }
  int major = 0, minor = 0;
  CUresult r = driver->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, *device);
  if (r == CUDA_SUCCESS) r = driver->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, *device);
  if (r != CUDA_SUCCESS) return Status::Internal("cannot read the GPU's compute capability: " + driver->ErrorString(r));
  if (major < 8) {
    return Status::InvalidArgument("te_jax's CUDA kernels need compute capability 8.0 (Ampere) or newer; this GPU is " +
                                   std::to_string(major) + "." + std::to_string(minor));
  }
  *arch = ArchForComputeCapability(major, minor);
  return Status::Ok();
}

}  // namespace te_jax::cuda
