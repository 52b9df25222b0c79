// Each kernel family's description of its modules (kernel_module.h), and the parts they share.
#pragma once

#include <string>

#include "cpp/cuda/kernel_config.h"
#include "cpp/cuda/kernel_module.h"

namespace te_jax::cuda {

KernelModule Sm80Module(const KernelConfig& config);
KernelModule Sm90Module(const KernelConfig& config);
KernelModule DecodeModule(const KernelConfig& config);
KernelModule LengthGuardModule();

// The kernels' element type of a dtype: "te_jax::cuda::BFloat16", ...
std::string ElementType(DType dtype);
// The kernels' element type of k and v: the dtype's, or an FP8 KV cache's ("te_jax::cuda::E4M3", ...).
std::string KvElementType(const KernelConfig& config);
// The kernels' type of an FP8 format.
std::string Fp8ElementType(KvFormat format);
// The template arguments every attention kernel takes: "<element>, <d>, <dv>, <variant>".
std::string KernelTemplateArgs(const KernelConfig& config);
// The argument struct of a kernel that applies the variant: `args`, or WithFlex<args> with mods (kernel_args.h).
std::string AttentionArgs(const KernelConfig& config, const std::string& args);
// "<element>, <d>, <dv>": the row kernels' arguments.
std::string RowKernelTemplateArgs(const KernelConfig& config);

// The backward's row kernels (kernels/common/backward_row_kernels.cuh), around either family's dk/dv kernels.
ModuleEntry BackwardPreprocessEntry(const KernelConfig& config);
ModuleEntry DqConvertEntry(const KernelConfig& config);
ModuleEntry BiasGradConvertEntry(const KernelConfig& config);

// A module with tokens (segment ids or positions) ends with the token tables and spans kernels
// (kernels/common/token_tables.cuh), which take the module's plain arguments `args` and run first.
void AddTokenKernels(const KernelConfig& config, const std::string& args, KernelModule* module);

}  // namespace te_jax::cuda
