// What every te_jax extension module exports besides its own targets: the core's validation, descriptor packing and
// the legacy failure record. Both modules define them with this one function, so the CPU and CUDA lowering call the
// same code with the same errors.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <string>

#include "bindings/params_from_python.h"
#include "cpp/validate.h"
#include "legacy/descriptor.h"
#include "legacy/legacy_failure.h"

namespace te_jax::bindings {

template <typename T>
nb::capsule EncapsulateFunction(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

inline void DefineCoreFunctions(nb::module_& m) {
  // direction "backward" adds what only the backward refuses (ValidateBackwardParams).
  m.def(
      "validate",
      [](const nb::dict& fields, int backend, const std::string& direction) {
        const AttentionParams params = ParamsFromDict(fields);
        ThrowIfError(ValidateAttentionParams(params, BackendFromInt(backend)));
        if (!IsForward(direction)) ThrowIfError(ValidateBackwardParams(params, BackendFromInt(backend)));
      },
      nb::arg("fields"), nb::arg("backend"), nb::arg("direction") = "forward");
  m.def("pack_descriptor", [](const nb::dict& fields) {
    const std::string bytes = legacy::PackDescriptor(ParamsFromDict(fields));
    return nb::bytes(bytes.data(), bytes.size());
  });
  m.def("unpack_descriptor", [](const nb::bytes& data) {
    AttentionParams params;
    ThrowIfError(legacy::UnpackDescriptor(data.c_str(), data.size(), &params));
    return DictFromParams(params);
  });
  m.def("take_legacy_failures", &legacy::TakeLegacyFailures);
  m.attr("descriptor_size") = legacy::kDescriptorSize;
}

}  // namespace te_jax::bindings
