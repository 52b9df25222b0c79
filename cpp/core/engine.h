// Which implementation runs a call on the GPU. The Python layer resolves "auto" to one of these at lowering time (by
// measurement or the built-in table, te_jax/engine.py), so a handler never chooses: both custom-call paths run
// exactly the engine the lowering named. The numeric values are part of the legacy descriptor format: never renumber.
#pragma once

#include <cstdint>

namespace te_jax {

enum class Engine : uint8_t {
  kTe = 0,     // te_jax's own kernels (the CPU backend; on CUDA the best kernel family for the GPU)
  kCudnn = 1,  // cuDNN's fused SDPA graphs (CUDA only; cpp/cuda/cudnn/)
};

inline constexpr int kNumEngines = 2;

}  // namespace te_jax
