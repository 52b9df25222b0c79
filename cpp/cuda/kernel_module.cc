#include "cpp/cuda/kernel_module.h"

#include <fstream>
#include <sstream>

#include "cpp/cuda/modules/family_modules.h"

namespace te_jax::cuda {
namespace {

// A mod's generated source (kernel_config.h), or an #error naming the file NVRTC then reports.
std::string ModSource(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "#error \"te_jax: cannot read the generated source " + path + "\"\n";
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

KernelModule ModuleFor(const KernelConfig& config) {
  if (config.kind == ModuleKind::kLengthGuard) return LengthGuardModule();
  switch (config.Family()) {
    case KernelFamily::kDecode:
      return DecodeModule(config);
    case KernelFamily::kSm90:
      return Sm90Module(config);
    case KernelFamily::kSm80:
      break;
  }
  return Sm80Module(config);
}

std::string RenderSource(const KernelConfig& config) {
  const KernelModule module = ModuleFor(config);
  std::string src = "// te_jax JIT translation unit: " + config.Name() + "\n";
  if (config.pipeline_stress) src += "#define TE_JAX_PIPELINE_STRESS 1\n";
  for (const std::string& header : module.includes) src += "#include \"" + header + "\"\n";
  for (const std::string* mod : {&config.score_mod, &config.mask_mod}) {
    if (!mod->empty()) src += ModSource(*mod);
  }
  for (size_t i = 0; i < module.entries.size(); ++i) {
    const ModuleEntry& e = module.entries[i];
    const std::string kernel = "Kernel" + std::to_string(i);
    src += "using " + kernel + " = " + e.kernel + ";\n";
    src += "extern \"C\" __global__ void ";
    if (e.launch_bounds) src += "__launch_bounds__(" + kernel + "::kThreads" + (e.one_block_per_sm ? ", 1" : "") + ")\n";
    src += e.name + "(const " + (e.grid_constant ? "__grid_constant__ " : "") + e.args + " args) { " + kernel +
           "::Run(args); }\n";
  }
  return src;
}

}  // namespace te_jax::cuda
