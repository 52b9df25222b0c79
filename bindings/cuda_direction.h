// "forward" / "backward" from Python as the CUDA backend's Direction (a ValueError otherwise), for the CUDA module's
// functions and the cuDNN engine's.
#pragma once

#include <string>

#include "bindings/params_from_python.h"
#include "cpp/cuda/kernel_config.h"

namespace te_jax::bindings {

inline cuda::Direction CudaDirection(const std::string& direction) {
  return IsForward(direction) ? cuda::Direction::kForward : cuda::Direction::kBackward;
}

}  // namespace te_jax::bindings
