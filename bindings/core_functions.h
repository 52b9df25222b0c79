// What every te_jax extension module exports besides its own targets: the core's validation, descriptor packing and
// the legacy failure record. Both modules define them with this one function, so the CPU and CUDA lowering call the
// same code with the same errors.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings/params_from_python.h"
#include "cpp/core/validate.h"
#include "cpp/core/visible_keys.h"
#include "legacy/descriptor.h"
#include "legacy/flex_descriptor.h"
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
  // The legacy path's opaque bytes: the descriptor, and a call with mods' flex block (legacy/flex_descriptor.h).
  m.def("pack_descriptor", [](const nb::dict& fields) {
    const std::string bytes = legacy::PackOpaque(ParamsFromDict(fields));
    return nb::bytes(bytes.data(), bytes.size());
  });
  m.def("unpack_descriptor", [](const nb::bytes& data) {
    AttentionParams params;
    ThrowIfError(legacy::UnpackOpaque(data.c_str(), data.size(), &params));
    return DictFromParams(params);
  });
  m.def("take_legacy_failures", &legacy::TakeLegacyFailures);
  // The index mask both ways the kernels read it (cpp/core/visible_keys.h): each row's visible keys and each key's seeing
  // rows, as [begin, end) pairs, for the tests to hold against the reference's mask.
  m.def(
      "mask_ranges",
      [](int mask_type, int64_t q_len, int64_t kv_len, int64_t window_left, int64_t window_right) {
        const RowMask mask = MakeRowMask(static_cast<MaskType>(mask_type), q_len, kv_len, window_left, window_right);
        std::vector<std::pair<int64_t, int64_t>> keys, rows;
        for (int64_t i = 0; i < q_len; ++i) keys.emplace_back(mask.Keys(i).begin, mask.Keys(i).end);
        for (int64_t j = 0; j < kv_len; ++j) rows.emplace_back(mask.Rows(j).begin, mask.Rows(j).end);
        return std::make_pair(keys, rows);
      },
      nb::arg("mask_type"), nb::arg("q_len"), nb::arg("kv_len"), nb::arg("window_left"), nb::arg("window_right"));
  m.attr("descriptor_size") = legacy::kDescriptorSize;
}

}  // namespace te_jax::bindings
