// The CUDA extension module: the custom-call targets of both paths, the core's validation and descriptor packing (as
// in the CPU module), the backward workspace size, and the JIT: prepare (lowering time: compile or find in the disk
// cache, then load), compile (no GPU needed: CI and `python -m te_jax.aot`), and the kernel-root / NVRTC-path settings
// the Python layer makes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bindings/core_functions.h"
#include "bindings/cuda_direction.h"
#include "bindings/cudnn_functions.h"
#include "bindings/params_from_python.h"
#include "cpp/cuda/attention_cuda.h"
#include "cpp/cuda/decode_geometry.h"
#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/engine_timing.h"
#include "cpp/cuda/jit_cache.h"
#include "cpp/cuda/kernel_registry.h"
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"
#include "cpp/cuda/nvrtc_compiler.h"
#include "cpp/validate.h"
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
  return d;
}

// {"direction", "dtype" (core code), "head_dim", "head_dim_v", "softcap" (bool), "alibi" (bool), "arch"} and, for the
// backward, optionally "deterministic" (bool, default false), for the forward optionally "decode" (bool, default
// false: the decode kernels, cpp/cuda/decode_geometry.h), optionally "tokens" (bool, default false: segment ids
// or positions), "dropout" (bool, default false), "bias_dtype" (core code of the additive bias's dtype; absent or
// None: no bias) and, with a bias, "bias_fits_tma" (bool, default false: the bias's rows are whole 16-byte chunks,
// cpp/cuda/kernel_config.h).
// {"kind": "length_guard", "arch"} is the length guard module (cpp/cuda/length_guard.h).
cuda::KernelConfig ConfigFromDict(const nb::dict& d) {
  if (d.contains("kind")) {
    if (nb::cast<std::string>(d["kind"]) != "length_guard") throw nb::value_error("kind must be 'length_guard'");
    return cuda::LengthGuardConfig(nb::cast<std::string>(d["arch"]));
  }
  cuda::KernelConfig c;
  c.direction = CudaDirection(nb::cast<std::string>(d["direction"]));
  const int dtype = nb::cast<int>(d["dtype"]);
  if (dtype != static_cast<int>(DType::kBFloat16) && dtype != static_cast<int>(DType::kFloat16)) {
    throw nb::value_error("CUDA kernels are compiled for bfloat16 (1) or float16 (2)");
  }
  c.dtype = static_cast<DType>(dtype);
  c.head_dim = nb::cast<int>(d["head_dim"]);
  c.head_dim_v = nb::cast<int>(d["head_dim_v"]);
  for (int hd : {c.head_dim, c.head_dim_v}) {
    if (hd <= 0 || hd % 8 != 0 || hd > kMaxHeadDim) throw nb::value_error("head dims must be multiples of 8 in [8, 256]");
  }
  c.softcap = nb::cast<bool>(d["softcap"]);
  c.alibi = nb::cast<bool>(d["alibi"]);
  const bool deterministic = d.contains("deterministic") && nb::cast<bool>(d["deterministic"]);
  if (deterministic && c.direction != cuda::Direction::kBackward) {
    throw nb::value_error("deterministic applies to the backward direction only");
  }
  // The module a call with these options runs (the default backward is the deterministic one for large head dims).
  c.deterministic = c.direction == cuda::Direction::kBackward &&
                    (deterministic || !cuda::sm80::BackwardAccumulatesDq(c.head_dim, c.head_dim_v));
  c.decode = d.contains("decode") && nb::cast<bool>(d["decode"]);
  if (c.decode && c.direction != cuda::Direction::kForward) {
    throw nb::value_error("decode applies to the forward direction only");
  }
  c.tokens = d.contains("tokens") && nb::cast<bool>(d["tokens"]);
  c.dropout = d.contains("dropout") && nb::cast<bool>(d["dropout"]);
  if (c.decode && c.dropout) throw nb::value_error("the decode kernels apply no dropout");
  if (c.decode && c.tokens) throw nb::value_error("the decode kernels take no tokens (segment ids, positions)");
  c.bias = d.contains("bias_dtype") && !d["bias_dtype"].is_none();
  if (c.bias) {
    const int bias_dtype = nb::cast<int>(d["bias_dtype"]);
    if (bias_dtype < 0 || bias_dtype >= kNumDTypes) {
      throw nb::value_error("bias_dtype must be a core dtype code: float32 (0), bfloat16 (1) or float16 (2)");
    }
    c.bias_dtype = static_cast<DType>(bias_dtype);
    if (c.decode) throw nb::value_error("the decode kernels take no bias");
  }
  c.bias_fits_tma = d.contains("bias_fits_tma") && nb::cast<bool>(d["bias_fits_tma"]);
  if (c.bias_fits_tma && !c.bias) throw nb::value_error("bias_fits_tma applies to a bias (bias_dtype) only");
  c.arch = nb::cast<std::string>(d["arch"]);
  return c;
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
  m.def("cache_dir", &cuda::CacheDir);
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
        return cuda::ConfigFor(bindings::ParamsFromDict(fields), bindings::CudaDirection(direction), arch).Name();
      },
      nb::arg("params"), nb::arg("direction"), nb::arg("arch"));
  // The entry point of the forward module's kernel a call of these params takes on `arch` (no GPU needed).
  m.def(
      "call_forward_entry",
      [](const nb::dict& fields, const std::string& arch) {
        const AttentionParams params = bindings::ParamsFromDict(fields);
        const cuda::KernelConfig config = cuda::ConfigFor(params, cuda::Direction::kForward, arch);
        cuda::Sm90ForwardKernel kernel;
        if (config.Family() == cuda::KernelFamily::kSm90) {
          bindings::ThrowIfError(cuda::Sm90ForwardKernelFor(config, params, &kernel));
        }
        int count = 0;
        return std::string(config.EntryPoints(&count)[kernel.index]);
      },
      nb::arg("params"), nb::arg("arch"));
  m.def("render_source", [](const nb::dict& config) { return bindings::ConfigFromDict(config).RenderSource(); });
  // How a decode call of these params is laid out on a GPU of `multiprocessors` SMs with `smem_per_multiprocessor`
  // bytes of shared memory each (no GPU needed): the entry point it takes, its splits and its CTAs per split.
  m.def(
      "call_decode_geometry",
      [](const nb::dict& fields, const std::string& arch, int multiprocessors, int smem_per_multiprocessor) {
        const AttentionParams params = bindings::ParamsFromDict(fields);
        const cuda::KernelConfig config = cuda::ConfigFor(params, cuda::Direction::kForward, arch);
        if (!config.decode) {
          bindings::ThrowIfError(Status::InvalidArgument("these params do not take the decode kernels"));
        }
        int count = 0;
        const char* const* entries = config.EntryPoints(&count);
        int smem_bytes[cuda::LoadedModule::kMaxKernels] = {};
        for (int i = 0; i < count; ++i) {
          smem_bytes[i] = cuda::decode::KernelSmemBytes(config.head_dim, config.head_dim_v, i);
        }
        const cuda::DecodeGeometry g =
            cuda::DecodeGeometryOnGpu(params, smem_bytes, count, multiprocessors, smem_per_multiprocessor);
        nb::dict out;
        out["entry"] = std::string(entries[g.kernel]);
        out["splits"] = g.splits;
        out["tiles_per_split"] = g.tiles_per_split;
        out["ctas_per_split"] = g.ctas_per_split;
        return out;
      },
      nb::arg("params"), nb::arg("arch"), nb::arg("multiprocessors"), nb::arg("smem_per_multiprocessor"));
}
