// What a compiled module holds: its kernels' entry points, each with the kernel template instance it runs, the
// arguments it takes and the dynamic shared memory it needs, and the translation unit NVRTC compiles from them. Each
// family describes its modules in one function (cpp/cuda/modules/), so an entry's name, its kernel and its launch
// needs are written once, side by side, and the loader (kernel_registry.cc), the launchers and the rendered source
// all read that one list.
#pragma once

#include <string>
#include <vector>

#include "cpp/cuda/kernel_config.h"

namespace te_jax::cuda {

struct ModuleEntry {
  std::string name;    // the extern "C" entry point, e.g. "te_jax_attention_forward"
  std::string kernel;  // the kernel type: a struct with kThreads and a static Run(args)
  std::string args;    // the argument struct it takes by value, e.g. "te_jax::cuda::ForwardArgs"
  // __launch_bounds__(kernel::kThreads, 1): a kernel whose CTA fills an SM gets every register it can use.
  bool one_block_per_sm = false;
  // __grid_constant__: the TMA unit reads the tensor maps in the arguments straight from parameter space.
  bool grid_constant = false;
  bool launch_bounds = true;  // kernels without them (the length guard) leave the register count to the compiler
  int smem_bytes = 0;         // dynamic shared memory
};

struct KernelModule {
  std::vector<std::string> includes;  // kernel headers, relative to the kernel root
  std::vector<ModuleEntry> entries;   // in the order the launchers index them
};

// The module of a configuration (its family's description in cpp/cuda/modules/).
KernelModule ModuleFor(const KernelConfig& config);

// The translation unit of a configuration: its includes and one entry point per kernel.
std::string RenderSource(const KernelConfig& config);

}  // namespace te_jax::cuda
