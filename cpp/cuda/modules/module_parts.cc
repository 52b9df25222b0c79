#include "cpp/cuda/modules/family_modules.h"

namespace te_jax::cuda {
namespace {

const char* Bool(bool b) { return b ? "true" : "false"; }

// The variant (cpp/core/variants.h) the configuration's kernels are built with; mods are the structs the translation
// unit holds (RenderSource).
std::string VariantType(const KernelConfig& c) {
  std::string variant = std::string("te_jax::LogitsVariant<") + Bool(c.softcap) + ", " + Bool(c.alibi) + ", " +
                        Bool(c.tokens) + ", " + Bool(c.dropout);
  if (c.bias || c.mods()) variant += ", " + (c.bias ? ElementType(c.bias_dtype) : std::string("te_jax::NoBias"));
  if (c.mods()) {
    variant += std::string(", te_jax::cuda::KernelMods<") +
               (c.score_mod.empty() ? "te_jax::cuda::NoScoreMod" : "te_jax::flex::ScoreMod") + ", " +
               (c.mask_mod.empty() ? "te_jax::cuda::NoMaskMod" : "te_jax::flex::MaskMod") + ">";
  }
  return variant + ">";
}

}  // namespace

std::string ElementType(DType dtype) {
  return dtype == DType::kFloat32    ? "te_jax::cuda::Float32"
         : dtype == DType::kBFloat16 ? "te_jax::cuda::BFloat16"
                                     : "te_jax::cuda::Float16";
}

std::string Fp8ElementType(KvFormat format) {
  return format == KvFormat::kE4M3 ? "te_jax::cuda::E4M3" : "te_jax::cuda::E5M2";
}

std::string KvElementType(const KernelConfig& c) {
  return IsFp8(c.kv_format) ? Fp8ElementType(c.kv_format) : ElementType(c.dtype);
}

std::string RowKernelTemplateArgs(const KernelConfig& c) {
  return ElementType(c.dtype) + ", " + std::to_string(c.head_dim) + ", " + std::to_string(c.head_dim_v);
}

std::string KernelTemplateArgs(const KernelConfig& c) { return RowKernelTemplateArgs(c) + ", " + VariantType(c); }

std::string AttentionArgs(const KernelConfig& c, const std::string& args) {
  return c.mods() ? "te_jax::cuda::WithFlex<" + args + ">" : args;
}

ModuleEntry BackwardPreprocessEntry(const KernelConfig& c) {
  return {"te_jax_attention_backward_preprocess",
          "te_jax::cuda::BackwardPreprocessKernel<" + RowKernelTemplateArgs(c) + (c.bias ? ", true" : "") + ">",
          "te_jax::cuda::BackwardArgs"};
}

ModuleEntry DqConvertEntry(const KernelConfig& c) {
  return {"te_jax_attention_backward_dq_convert",
          "te_jax::cuda::BackwardDqConvertKernel<" + RowKernelTemplateArgs(c) + ">", "te_jax::cuda::BackwardArgs"};
}

ModuleEntry BiasGradConvertEntry(const KernelConfig& c) {
  return {"te_jax_bias_grad_convert", "te_jax::cuda::BiasGradConvertKernel<" + ElementType(c.bias_dtype) + ">",
          "te_jax::cuda::BackwardArgs"};
}

void AddTokenKernels(const KernelConfig& c, const std::string& args, KernelModule* module) {
  if (!c.tokens) return;
  module->includes.push_back("cpp/cuda/kernels/common/token_tables.cuh");
  module->entries.push_back({"te_jax_token_tables", "te_jax::cuda::TokenTablesKernel<" + args + ">", args});
  module->entries.push_back({"te_jax_token_spans", "te_jax::cuda::TokenSpansKernel<" + args + ">", args});
}

}  // namespace te_jax::cuda
