// The CPU extension module: hands Python the custom-call targets of both paths and the few core functions the Python
// layer calls while lowering (validation and descriptor packing), so the checks there are the core's own.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <string>

#include "bindings/params_from_python.h"
#include "cpp/validate.h"
#include "ffi/cpu_handlers.h"
#include "legacy/cpu_legacy_handlers.h"
#include "legacy/descriptor.h"
#include "legacy/legacy_failure.h"

namespace nb = nanobind;

namespace te_jax::bindings {
namespace {

template <typename T>
nb::capsule EncapsulateFunction(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

nb::dict FfiRegistrations() {
  nb::dict targets;
  targets["te_jax_attention_forward_cpu_ffi"] = EncapsulateFunction(TeJaxAttentionForwardCpu);
  targets["te_jax_attention_backward_cpu_ffi"] = EncapsulateFunction(TeJaxAttentionBackwardCpu);
  return targets;
}

nb::dict LegacyRegistrations() {
  nb::dict targets;
  targets["te_jax_attention_forward_cpu_legacy"] = EncapsulateFunction(TeJaxLegacyAttentionForwardCpu);
  targets["te_jax_attention_backward_cpu_legacy"] = EncapsulateFunction(TeJaxLegacyAttentionBackwardCpu);
  return targets;
}

}  // namespace
}  // namespace te_jax::bindings

NB_MODULE(_te_jax_cpu, m) {
  using namespace te_jax;
  m.def("ffi_registrations", &bindings::FfiRegistrations);
  m.def("legacy_registrations", &bindings::LegacyRegistrations);
  m.def("validate", [](const nb::dict& fields, int backend) {
    bindings::ThrowIfError(ValidateAttentionParams(bindings::ParamsFromDict(fields), bindings::BackendFromInt(backend)));
  });
  m.def("pack_descriptor", [](const nb::dict& fields) {
    const std::string bytes = legacy::PackDescriptor(bindings::ParamsFromDict(fields));
    return nb::bytes(bytes.data(), bytes.size());
  });
  m.def("unpack_descriptor", [](const nb::bytes& data) {
    AttentionParams params;
    bindings::ThrowIfError(legacy::UnpackDescriptor(data.c_str(), data.size(), &params));
    return bindings::DictFromParams(params);
  });
  m.def("take_legacy_failures", &legacy::TakeLegacyFailures);
  m.attr("descriptor_size") = legacy::kDescriptorSize;
}
