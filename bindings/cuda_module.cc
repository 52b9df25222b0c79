// The CUDA extension module: the custom-call targets of both paths, the core's validation and descriptor packing (as
// in the CPU module), the backward workspace size, and the JIT: prepare (lowering time: compile or find in the disk
// cache, then load), compile (no GPU needed: CI and `python -m te_jax.aot`), and the kernel-root / NVRTC-path settings
// the Python layer makes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings/core_functions.h"
#include "bindings/cuda_direction.h"
#include "bindings/cudnn_functions.h"
#include "bindings/params_from_python.h"
#include "cpp/core/validate.h"
#include "cpp/cuda/attention_cuda.h"
#include "cpp/cuda/decode_geometry.h"
#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/engine_timing.h"
#include "cpp/cuda/jit_cache.h"
#include "cpp/cuda/kernel_config.h"
#include "cpp/cuda/kernel_module.h"
#include "cpp/cuda/kernel_registry.h"
#include "cpp/cuda/nvrtc_compiler.h"
#include "ffi/cuda_handlers.h"
#include "legacy/cuda_legacy_handlers.h"

namespace nb = nanobind;

namespace te_jax::bindings {
namespace {

nb::dict FfiRegistrations() {
  nb::dict targets;
  targets["te_jax_attention_forward_cuda_ffi"] = EncapsulateFunction(TeJaxAttentionForwardCuda);
  targets["te_jax_attention_backward_cuda_ffi"] = EncapsulateFunction(TeJaxAttentionBackwardCuda);
  return targets;
}

nb::dict LegacyRegistrations() {
  nb::dict targets;
  targets["te_jax_attention_forward_cuda_legacy"] = EncapsulateFunction(TeJaxLegacyAttentionForwardCuda);
  targets["te_jax_attention_backward_cuda_legacy"] = EncapsulateFunction(TeJaxLegacyAttentionBackwardCuda);
  return targets;
}

nb::dict ReportDict(const cuda::JitReport& r) {
  nb::dict d;
  d["name"] = r.name;
  d["path"] = r.path;
  d["origin"] = r.origin;
  d["seconds"] = r.seconds;
  d["note"] = r.note;
  return d;
}

// A module request from Python (te_jax/aot.py's configurations): {"direction", "dtype" (core code), "head_dim",
// "head_dim_v", "softcap" (bool), "alibi" (bool), "arch"} and optionally "deterministic", "decode", "tokens",
// "dropout" (bools, default false), "kv_format" (cpp/core/kv_format.h's code; absent: k and v in q's dtype),
// "q_format" (the same codes: FP8 attention, q, k and v in it and kv_format the same; absent: q in dtype),
// "bias_dtype" (core code of the additive bias's dtype; absent or None: no bias) and "bias_fits_tma" (bool),
// "score_mod" and "mask_mod" (paths of generated mod sources, te_jax/flex/cuda_source.py).
// {"kind": "length_guard", "arch"} is the length guard module (cpp/cuda/length_guard.h).
// Which module serves the request, and what no module serves, is ConfigFor's decision (cpp/cuda/kernel_config.h).
cuda::KernelConfig ConfigFromDict(const nb::dict& d) {
  if (d.contains("kind")) {
    if (nb::cast<std::string>(d["kind"]) != "length_guard") throw nb::value_error("kind must be 'length_guard'");
    return cuda::LengthGuardConfig(nb::cast<std::string>(d["arch"]));
  }
  const auto flag = [&](const char* key) { return d.contains(key) && nb::cast<bool>(d[key]); };
  cuda::KernelConfig r;
  r.direction = CudaDirection(nb::cast<std::string>(d["direction"]));
  r.dtype = DTypeFromInt(nb::cast<int>(d["dtype"]), "dtype");
  r.head_dim = nb::cast<int>(d["head_dim"]);
  r.head_dim_v = nb::cast<int>(d["head_dim_v"]);
  r.softcap = nb::cast<bool>(d["softcap"]);
  r.alibi = nb::cast<bool>(d["alibi"]);
  r.deterministic = flag("deterministic");
  r.decode = flag("decode");
  if (d.contains("kv_format")) r.kv_format = static_cast<KvFormat>(nb::cast<int>(d["kv_format"]));
  if (d.contains("q_format")) r.q_format = static_cast<KvFormat>(nb::cast<int>(d["q_format"]));
  r.tokens = flag("tokens");
  r.dropout = flag("dropout");
  r.bias = d.contains("bias_dtype") && !d["bias_dtype"].is_none();
  if (r.bias) r.bias_dtype = DTypeFromInt(nb::cast<int>(d["bias_dtype"]), "bias_dtype");
  r.bias_fits_tma = flag("bias_fits_tma");
  if (d.contains("score_mod")) r.score_mod = nb::cast<std::string>(d["score_mod"]);
  if (d.contains("mask_mod")) r.mask_mod = nb::cast<std::string>(d["mask_mod"]);
  r.arch = nb::cast<std::string>(d["arch"]);
  cuda::KernelConfig config;
  ThrowIfError(cuda::ConfigFor(r, &config));
  return config;
}

// The module a call of these params takes on `arch` (no GPU needed).
cuda::KernelConfig CallConfig(const nb::dict& fields, const std::string& direction, const std::string& arch) {
  cuda::KernelConfig config;
  ThrowIfError(cuda::ConfigFor(ParamsFromDict(fields), CudaDirection(direction), arch, &config));
  return config;
}

}  // namespace
}  // namespace te_jax::bindings

NB_MODULE(_te_jax_cuda, m) {
  using namespace te_jax;
  m.def("ffi_registrations", &bindings::FfiRegistrations);
  m.def("legacy_registrations", &bindings::LegacyRegistrations);
  bindings::DefineCoreFunctions(m);
  bindings::DefineCudnnFunctions(m);

  m.def(
      "workspace_bytes",
      [](const nb::dict& fields, const std::string& direction) {
        const AttentionParams params = bindings::ParamsFromDict(fields);
        return bindings::IsForward(direction) ? cuda::ForwardWorkspaceBytes(params)
                                              : cuda::BackwardWorkspaceBytes(params);
      },
      nb::arg("params"), nb::arg("direction"));
  m.def(
      "time_attention",
      [](const nb::dict& fields, const std::string& direction) {
        const AttentionParams params = bindings::ParamsFromDict(fields);
        const cuda::Direction dir = bindings::CudaDirection(direction);
        double ms = 0.0;
        Status status;
        {
          nb::gil_scoped_release release;
          status = cuda::TimeAttention(params, dir, &ms);
        }
        bindings::ThrowIfError(status);
        return ms;
      },
      nb::arg("params"), nb::arg("direction"),
      "Milliseconds per call of params' engine on this GPU (scratch buffers of the call's shapes).");
  m.def("device_description", [] {
    std::string name;
    int driver = 0;
    bindings::ThrowIfError(cuda::DeviceDescription(&name, &driver));
    return nb::make_tuple(name, driver);
  });

  m.def("set_kernel_root", &cuda::SetKernelRoot, nb::arg("root"));
  m.def("set_nvrtc_paths", &cuda::SetNvrtcSearchPaths, nb::arg("paths"));
  m.def("cache_dir", &te_jax::CacheDir);
  m.def("nvrtc_version", [] {
    std::string v;
    bindings::ThrowIfError(cuda::NvrtcVersionString(&v));
    return v;
  });
  // Changes whenever a kernel source does: what a measurement of te_jax's kernels depends on (te_jax/_engine_choice.py).
  m.def("kernel_sources_digest", [] {
    const cuda::KernelSources* sources = nullptr;
    bindings::ThrowIfError(cuda::GetKernelSources(&sources));
    return sources->digest;
  });
  m.def(
      "prepare",
      [](const nb::dict& fields, const std::string& direction) {
        const AttentionParams params = bindings::ParamsFromDict(fields);
        const cuda::Direction dir = bindings::CudaDirection(direction);
        cuda::JitReport report;
        Status status;
        {
          nb::gil_scoped_release release;
          status = cuda::Prepare(params, dir, &report);
        }
        bindings::ThrowIfError(status);
        return bindings::ReportDict(report);
      },
      nb::arg("params"), nb::arg("direction"));
  m.def(
      "compile",
      [](const nb::dict& config) {
        const cuda::KernelConfig c = bindings::ConfigFromDict(config);
        cuda::JitReport report;
        Status status;
        {
          nb::gil_scoped_release release;
          status = cuda::EnsureCubin(c, &report);
        }
        bindings::ThrowIfError(status);
        return bindings::ReportDict(report);
      },
      nb::arg("config"));
  m.def("kernel_name", [](const nb::dict& config) { return bindings::ConfigFromDict(config).Name(); });
  // The module a call of these params takes on `arch` (no GPU needed): its name says the family and tile.
  m.def(
      "call_kernel_name",
      [](const nb::dict& fields, const std::string& direction, const std::string& arch) {
        return bindings::CallConfig(fields, direction, arch).Name();
      },
      nb::arg("params"), nb::arg("direction"), nb::arg("arch"));
  // The entry point of the forward module's kernel a call of these params takes on `arch` (no GPU needed).
  m.def(
      "call_forward_entry",
      [](const nb::dict& fields, const std::string& arch) {
        const cuda::KernelConfig config = bindings::CallConfig(fields, "forward", arch);
        cuda::Sm90ForwardKernel kernel;
        if (config.Family() == cuda::KernelFamily::kSm90) {
          bindings::ThrowIfError(cuda::Sm90ForwardKernelFor(config, bindings::ParamsFromDict(fields), &kernel));
        }
        return cuda::ModuleFor(config).entries[kernel.index].name;
      },
      nb::arg("params"), nb::arg("arch"));
  // Whether a call of these params in `direction` on `arch` launches its module's document kernels (no GPU needed).
  m.def(
      "call_reads_documents",
      [](const nb::dict& fields, const std::string& direction, const std::string& arch) {
        const cuda::KernelConfig config = bindings::CallConfig(fields, direction, arch);
        bool reads = false;
        if (config.Family() == cuda::KernelFamily::kSm90) {
          bindings::ThrowIfError(cuda::Sm90ReadsDocuments(config, &reads));
        }
        return reads;
      },
      nb::arg("params"), nb::arg("direction"), nb::arg("arch"));
  // Why te_jax's CUDA kernels do not serve this FP8 KV cache call in `direction` on `arch` (default: the current
  // device's), or None where they do (no GPU needed with an arch).
  m.def(
      "fp8_kv_refusal",
      [](const nb::dict& fields, const std::string& direction,
         std::optional<std::string> arch) -> std::optional<std::string> {
        if (!arch) {
          CUdevice device = 0;
          arch.emplace();
          bindings::ThrowIfError(cuda::CurrentDeviceArch(&device, &*arch));
        }
        const AttentionParams params = bindings::ParamsFromDict(fields);
        if (!IsFp8(params.kv_format)) throw nb::value_error("fp8_kv_refusal takes an FP8 KV cache call's params");
        const std::string refusal =
            cuda::Fp8Refusal(cuda::RequestFor(params, bindings::CudaDirection(direction), *arch));
        if (refusal.empty()) return std::nullopt;
        return refusal;
      },
      nb::arg("params"), nb::arg("direction"), nb::arg("arch") = nb::none());
  m.def("render_source", [](const nb::dict& config) { return cuda::RenderSource(bindings::ConfigFromDict(config)); });
  // How a decode call of these params is laid out on a GPU of `multiprocessors` SMs with `smem_per_multiprocessor`
  // bytes of shared memory each (no GPU needed): the entry point it takes, its splits and its CTAs per split. With
  // `registers` (per entry point, as the loaded module reports them), an SM's CTAs are bounded by its 64K registers too.
  m.def(
      "call_decode_geometry",
      [](const nb::dict& fields, const std::string& arch, int multiprocessors, int smem_per_multiprocessor,
         const std::vector<int>& registers) {
        const cuda::KernelConfig config = bindings::CallConfig(fields, "forward", arch);
        if (!config.decode) {
          bindings::ThrowIfError(Status::InvalidArgument("these params do not take the decode kernels"));
        }
        const cuda::KernelModule module = cuda::ModuleFor(config);
        std::vector<int> smem_bytes;
        for (const cuda::ModuleEntry& e : module.entries) smem_bytes.push_back(e.smem_bytes);
        if (!registers.empty() && registers.size() != smem_bytes.size()) {
          bindings::ThrowIfError(Status::InvalidArgument("registers: one count per entry point, " +
                                                         std::to_string(smem_bytes.size()) + " of them"));
        }
        const cuda::DecodeGeometry g = cuda::DecodeGeometryOnGpu(bindings::ParamsFromDict(fields), smem_bytes.data(),
                                                                 static_cast<int>(module.entries.size()),
                                                                 multiprocessors, smem_per_multiprocessor,
                                                                 registers.empty() ? nullptr : registers.data(),
                                                                 registers.empty() ? 0 : 65536);
        nb::dict out;
        out["entry"] = module.entries[g.kernel].name;
        out["splits"] = g.splits;
        out["tiles_per_split"] = g.tiles_per_split;
        out["ctas_per_split"] = g.ctas_per_split;
        return out;
      },
      nb::arg("params"), nb::arg("arch"), nb::arg("multiprocessors"), nb::arg("smem_per_multiprocessor"),
      nb::arg("registers") = std::vector<int>{});
}
