// The cuDNN engine's lowering-time functions for the CUDA extension module: whether it is available, which calls it
// serves (and why not), graph preparation, workspace sizes, and the library search paths the Python layer sets.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings/cuda_direction.h"
#include "bindings/params_from_python.h"
#include "cpp/cuda/cudnn/cudnn_attention.h"

namespace te_jax::bindings {

inline void DefineCudnnFunctions(nb::module_& m) {
  // Whether this build compiled the engine (cuDNN's and the frontend's headers found at install).
  m.def("cudnn_built", &cuda::cudnn::Built);
  // (True, "") or (False, the reason: a build without the headers, libcudnn missing or too old).
  m.def("cudnn_available", [] {
    Status status;
    {
      nb::gil_scoped_release release;
      status = cuda::cudnn::Available();
    }
    return std::make_pair(status.ok(), status.message());
  });
  m.def("cudnn_version", [] {
    nb::gil_scoped_release release;
    return cuda::cudnn::Version();
  });
  // None when the engine serves the call, else the reason (it builds the graph on the current device, once).
  m.def(
      "cudnn_supports",
      [](const nb::dict& fields, const std::string& direction) -> std::optional<std::string> {
        const AttentionParams params = ParamsFromDict(fields);
        const cuda::Direction dir = CudaDirection(direction);
        Status status;
        {
          nb::gil_scoped_release release;
          status = cuda::cudnn::Supports(params, dir);
        }
        if (status.ok()) return std::nullopt;
        return status.message();
      },
      nb::arg("params"), nb::arg("direction"));
  m.def(
      "cudnn_prepare",
      [](const nb::dict& fields, const std::string& direction) {
        const AttentionParams params = ParamsFromDict(fields);
        const cuda::Direction dir = CudaDirection(direction);
        Status status;
        {
          nb::gil_scoped_release release;
          status = cuda::cudnn::Prepare(params, dir);
        }
        ThrowIfError(status);
      },
      nb::arg("params"), nb::arg("direction"));
  m.def(
      "cudnn_workspace_bytes",
      [](const nb::dict& fields, const std::string& direction) {
        const AttentionParams params = ParamsFromDict(fields);
        const cuda::Direction dir = CudaDirection(direction);
        nb::gil_scoped_release release;
        return dir == cuda::Direction::kForward ? cuda::cudnn::ForwardWorkspaceBytes(params)
                                                : cuda::cudnn::BackwardWorkspaceBytes(params);
      },
      nb::arg("params"), nb::arg("direction"));
  // paths: candidates for libcudnn.so.9, tried in order before the loader's default search; cudart_paths: for the
  // CUDA runtime the cuDNN frontend calls (cudnn_library.cc says why).
  m.def("set_cudnn_paths", &cuda::cudnn::SetLibrarySearchPaths, nb::arg("paths"),
        nb::arg("cudart_paths") = std::vector<std::string>{});
}

}  // namespace te_jax::bindings
