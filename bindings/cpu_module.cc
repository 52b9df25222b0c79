// The CPU extension module: hands Python the custom-call targets of both paths and the functions the lowering calls
// (bindings/core_functions.h, and this backend's backward workspace size).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/core_functions.h"
#include "bindings/params_from_python.h"
#include "cpp/core/cache_dir.h"
#include "cpp/cpu/attention_cpu.h"
#include "cpp/cpu/isa_dispatch.h"
#include "ffi/cpu_handlers.h"
#include "legacy/cpu_legacy_handlers.h"

namespace nb = nanobind;

NB_MODULE(_te_jax_cpu, m) {
  using te_jax::bindings::EncapsulateFunction;
  m.def("ffi_registrations", [] {
    nb::dict targets;
    targets["te_jax_attention_forward_cpu_ffi"] = EncapsulateFunction(TeJaxAttentionForwardCpu);
    targets["te_jax_attention_backward_cpu_ffi"] = EncapsulateFunction(TeJaxAttentionBackwardCpu);
    return targets;
  });
  m.def("legacy_registrations", [] {
    nb::dict targets;
    targets["te_jax_attention_forward_cpu_legacy"] = EncapsulateFunction(TeJaxLegacyAttentionForwardCpu);
    targets["te_jax_attention_backward_cpu_legacy"] = EncapsulateFunction(TeJaxLegacyAttentionBackwardCpu);
    return targets;
  });
  te_jax::bindings::DefineCoreFunctions(m);
  m.def(
      "workspace_bytes",
      [](const nb::dict& fields, const std::string& direction) -> int64_t {
        if (te_jax::bindings::IsForward(direction)) return 0;
        return te_jax::cpu::BackwardWorkspaceBytes(te_jax::bindings::ParamsFromDict(fields));
      },
      nb::arg("params"), nb::arg("direction"));
  // The instruction set the kernels run in (cpp/cpu/isa_dispatch.h): te_jax/cpu_isa.py.
  m.def("cpu_isa", [] { return std::string(te_jax::cpu::IsaName(te_jax::cpu::CpuIsa())); });
  // Where the score_mod / mask_mod libraries are cached (te_jax/flex/cpu_library.py), beside the CUDA cubins.
  m.def("cache_dir", [] { return te_jax::CacheDir(); });
}
