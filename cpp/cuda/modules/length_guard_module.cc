// The length guard's module (kernels/common/length_guard.cuh), which other engines (cuDNN) run around their calls: it
// depends on the arch alone. Its kernels leave the register count to the compiler.
#include "cpp/cuda/modules/family_modules.h"

namespace te_jax::cuda {

KernelModule LengthGuardModule() {
  KernelModule m;
  m.includes = {"cpp/cuda/kernels/common/length_guard.cuh"};
  for (ModuleEntry e : {ModuleEntry{"te_jax_guard_lengths", "te_jax::cuda::GuardLengthsKernel", ""},
                        ModuleEntry{"te_jax_enforce_length_contract", "te_jax::cuda::EnforceLengthContractKernel", ""}}) {
    e.args = "te_jax::cuda::LengthGuardArgs";
    e.launch_bounds = false;
    m.entries.push_back(e);
  }
  return m;
}

}  // namespace te_jax::cuda
