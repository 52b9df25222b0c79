#include "cpp/cuda/kernel_config.h"

#include <cstdlib>

#include "cpp/bias.h"
#include "cpp/cuda/decode_geometry.h"
#include "cpp/cuda/token_workspace.h"
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"
#include "cpp/cuda/kernels/sm90/tile_size.h"

namespace te_jax::cuda {
namespace {

int ArchNumber(const std::string& arch) {
  int number = 0;  // "sm_90a" -> 90, "sm_100a" -> 100
  for (size_t i = 3; i < arch.size() && arch[i] >= '0' && arch[i] <= '9'; ++i) number = 10 * number + (arch[i] - '0');
  return number;
}

const char* const kForwardEntries[] = {"te_jax_attention_forward", "te_jax_token_tables", "te_jax_token_spans"};
const char* const kPersistentForwardEntries[] = {"te_jax_attention_forward", "te_jax_attention_forward_persistent"};
const char* const kBackwardEntries[] = {"te_jax_attention_backward_preprocess", "te_jax_attention_backward_dkdv_dq",
                                        "te_jax_attention_backward_dq_convert", "te_jax_token_tables",
                                        "te_jax_token_spans"};
const char* const kDeterministicBackwardEntries[] = {"te_jax_attention_backward_preprocess",
                                                     "te_jax_attention_backward_dkdv", "te_jax_attention_backward_dq",
                                                     "te_jax_token_tables", "te_jax_token_spans"};
const char* const kBiasBackwardEntries[] = {"te_jax_attention_backward_preprocess", "te_jax_attention_backward_dkdv_dq",
                                            "te_jax_attention_backward_dq_convert", "te_jax_bias_grad_convert",
                                            "te_jax_token_tables", "te_jax_token_spans"};
const char* const kBiasDeterministicBackwardEntries[] = {
    "te_jax_attention_backward_preprocess", "te_jax_attention_backward_dkdv", "te_jax_attention_backward_dq",
    "te_jax_bias_grad_convert", "te_jax_token_tables", "te_jax_token_spans"};

// In the order of decode/tile_size.h's kernel indices.
const char* const kDecodeEntries[] = {"te_jax_attention_decode_rows16", "te_jax_attention_decode_rows64",
                                      "te_jax_attention_decode_combine", "te_jax_attention_decode_rows16_shallow"};

const char* const kLengthGuardEntries[] = {"te_jax_guard_lengths", "te_jax_enforce_length_contract"};

// The token tables and spans kernels (kernels/common/token_tables.cuh) for a module whose kernels take `args`.
std::string TokenKernelsSource(const std::string& args) {
  return "#include \"cpp/cuda/kernels/common/token_tables.cuh\"\n"
         "extern \"C\" __global__ void __launch_bounds__(te_jax::cuda::kTokenTableThreads)\n"
         "te_jax_token_tables(const " + args + " args) { te_jax::cuda::TokenTablesKernel<" + args + ">::Run(args); }\n"
         "extern \"C\" __global__ void __launch_bounds__(te_jax::cuda::kTokenTableThreads)\n"
         "te_jax_token_spans(const " + args + " args) { te_jax::cuda::TokenSpansKernel<" + args + ">::Run(args); }\n";
}

const char* VariantName(bool softcap, bool alibi) {
  if (softcap) return alibi ? "softcap_alibi" : "softcap";
  return alibi ? "alibi" : "scaled";
}

// The bias's element type in module names and in the rendered source.
const char* BiasName(DType dtype) {
  return dtype == DType::kFloat32 ? "_bias_f32" : dtype == DType::kBFloat16 ? "_bias_bf16" : "_bias_fp16";
}
const char* BiasElement(DType dtype) {
  return dtype == DType::kFloat32    ? "te_jax::cuda::Float32"
         : dtype == DType::kBFloat16 ? "te_jax::cuda::BFloat16"
                                     : "te_jax::cuda::Float16";
}

// The dbias accumulator's conversion (kernels/sm80/attention_bwd.cuh), the entry after a backward's attention kernels.
std::string BiasGradConvertSource(DType bias_dtype, const char* entry) {
  return std::string("using BiasGradConvert = te_jax::cuda::sm80::BiasGradConvertKernel<") + BiasElement(bias_dtype) +
         ">;\n"
         "extern \"C\" __global__ void __launch_bounds__(BiasGradConvert::kThreads)\n" + entry +
         "(const te_jax::cuda::BackwardArgs args) { BiasGradConvert::Run(args); }\n";
}

}  // namespace

const char* const* KernelConfig::EntryPoints(int* count) const {
  if (kind == ModuleKind::kLengthGuard) {
    *count = 2;
    return kLengthGuardEntries;
  }
  if (decode) {  // the shallow ring's kernel where it is shallower than the deep one
    *count = decode::kShallowStages < decode::DeepStages(head_dim, head_dim_v) ? 4 : 3;
    return kDecodeEntries;
  }
  const int token_kernels = tokens ? 2 : 0;
  if (HasPersistentForward()) {
    *count = 2;
    return kPersistentForwardEntries;
  }
  if (direction == Direction::kForward) {
    *count = 1 + token_kernels;
    return kForwardEntries;
  }
  if (bias) {
    *count = 4 + token_kernels;
    return deterministic ? kBiasDeterministicBackwardEntries : kBiasBackwardEntries;
  }
  *count = 3 + token_kernels;
  return deterministic ? kDeterministicBackwardEntries : kBackwardEntries;
}

KernelFamily KernelConfig::Family() const {
  if (decode) return KernelFamily::kDecode;
  // A bias: the sm80 family but where TMA copies its rows (kernels/sm90/bias_tile.h).
  if (kind != ModuleKind::kAttention || arch != "sm_90a" || (bias && !bias_fits_tma)) return KernelFamily::kSm80;
  const bool served = direction == Direction::kForward
                          ? sm90::ServesForward(head_dim, head_dim_v, tokens, BiasBytes())
                          : sm90::ServesBackward(head_dim, head_dim_v, !deterministic, tokens, dropout, BiasBytes());
  return served ? KernelFamily::kSm90 : KernelFamily::kSm80;
}

bool KernelConfig::PlainSm90Forward() const {
  return direction == Direction::kForward && Family() == KernelFamily::kSm90 && !softcap && !alibi && !tokens &&
         !dropout && !bias;
}

bool KernelConfig::HasThreeConsumerForward() const {
  return PlainSm90Forward() && sm90::ForwardHasThreeConsumerKernel(head_dim, head_dim_v, true);
}

bool KernelConfig::HasPersistentForward() const {
  return PlainSm90Forward() && sm90::ForwardHasPersistentKernel(head_dim, head_dim_v, true);
}

std::string KernelConfig::Name() const { return BaseName() + (pipeline_stress ? "_stress" : ""); }

std::string KernelConfig::BaseName() const {
  if (kind == ModuleKind::kLengthGuard) return "length_guard_" + arch;
  const bool sm90 = Family() == KernelFamily::kSm90;
  const char* what = decode ? "dec" : direction == Direction::kForward ? "fwd" : (deterministic ? "bwd_det" : "bwd");
  std::string name = std::string(what) + "_" + (dtype == DType::kBFloat16 ? "bf16" : "fp16") + "_d" +
                     std::to_string(head_dim) + "_dv" + std::to_string(head_dim_v) + "_" +
                     VariantName(softcap, alibi) + (tokens ? "_tokens" : "") + (dropout ? "_dropout" : "") +
                     (bias ? BiasName(bias_dtype) : "") + "_" + arch;
  if (decode) return name + "_decode_n" + std::to_string(decode::kBlockN);
  if (direction != Direction::kForward) {
    if (!sm90) return name;
    return name + "_sm90_" + std::to_string(sm90::BackwardOwnedRows(head_dim, head_dim_v)) + "x" +
           std::to_string(sm90::BackwardStepRows(head_dim, head_dim_v, tokens, dropout, bias));
  }
  if (sm90) {  // the first kernel's tile
    const sm90::ForwardTile t =
        sm90::ForwardTileSize(head_dim, head_dim_v, tokens, HasThreeConsumerForward() ? 3 : 2, BiasBytes());
    return name + "_sm90_" + std::to_string(t.block_m) + "x" + std::to_string(t.block_n);
  }
  const sm80::TileSize t = sm80::ForwardTileSize(head_dim, head_dim_v, bias);
  return name + "_sm80_" + std::to_string(t.block_m) + "x" + std::to_string(t.block_n);
}

std::string KernelConfig::RenderSource() const {
  if (kind == ModuleKind::kLengthGuard) {
    return "// te_jax JIT translation unit: " + Name() + "\n#include \"cpp/cuda/kernels/common/length_guard.cuh\"\n"
           "extern \"C\" __global__ void te_jax_guard_lengths(const te_jax::cuda::LengthGuardArgs args) {\n"
           "  te_jax::cuda::GuardLengths(args);\n}\n"
           "extern \"C\" __global__ void te_jax_enforce_length_contract(const te_jax::cuda::LengthGuardArgs args) {\n"
           "  te_jax::cuda::EnforceLengthContract(args);\n}\n";
  }
  const std::string element = dtype == DType::kBFloat16 ? "te_jax::cuda::BFloat16" : "te_jax::cuda::Float16";
  const std::string variant = std::string("te_jax::LogitsVariant<") + (softcap ? "true" : "false") + ", " +
                              (alibi ? "true" : "false") + ", " + (tokens ? "true" : "false") + ", " +
                              (dropout ? "true" : "false") + (bias ? std::string(", ") + BiasElement(bias_dtype) : "") + ">";
  const std::string dims = std::to_string(head_dim) + ", " + std::to_string(head_dim_v);
  std::string src = "// te_jax JIT translation unit: " + Name() + "\n" +
                    (pipeline_stress ? "#define TE_JAX_PIPELINE_STRESS 1\n" : "") + "#include \"cpp/variants.h\"\n";
  if (decode) {
    const std::string decode_kernel = "te_jax::cuda::decode::DecodeKernel<" + element + ", " + dims + ", " + variant;
    const auto stages = [&](int index) { return std::to_string(decode::StagesOfKernel(head_dim, head_dim_v, index)); };
    src += "#include \"cpp/cuda/kernels/decode/attention_decode.cuh\"\n"
           "#include \"cpp/cuda/kernels/decode/combine.cuh\"\n"
           "using Rows16 = " + decode_kernel + ", 1, " + stages(0) + ">;\n"
           "using Rows64 = " + decode_kernel + ", 4, " + stages(1) + ">;\n"
           "using Combine = te_jax::cuda::decode::CombineKernel<" + element + ", " + std::to_string(head_dim_v) + ">;\n"
           "using Rows16Shallow = " + decode_kernel + ", 1, " + stages(decode::kShallowKernel) + ">;\n";
    int count = 0;
    const char* const* entries = EntryPoints(&count);
    const std::string kernels[] = {"Rows16", "Rows64", "Combine", "Rows16Shallow"};
    for (int i = 0; i < count; ++i) {
      src += "extern \"C\" __global__ void __launch_bounds__(" + kernels[i] + "::kThreads)\n" + entries[i] +
             "(const __grid_constant__ te_jax::cuda::DecodeArgs args) { " + kernels[i] + "::Run(args); }\n";
    }
  } else if (direction == Direction::kForward && Family() == KernelFamily::kSm90) {
    // The tensor maps are read by the TMA unit straight from parameter space: the parameter must stay constant.
    src += "#include \"cpp/cuda/kernels/sm90/attention_fwd.cuh\"\n";
    const auto kernel = [&](const char* entry, int consumers, bool persistent = false) {
      const std::string fwd = "te_jax::cuda::sm90::ForwardKernel<" + element + ", " + dims + ", " + variant + ", " +
                              std::to_string(consumers) + (persistent ? ", true>" : ">");
      return "extern \"C\" __global__ void __launch_bounds__(" + fwd + "::kThreads, 1)\n" + entry +
             "(const __grid_constant__ te_jax::cuda::TmaForwardArgs args) { " + fwd + "::Run(args); }\n";
    };
    src += kernel(kForwardEntries[0], HasThreeConsumerForward() ? 3 : 2);
    if (HasPersistentForward()) src += kernel(kPersistentForwardEntries[1], 2, true);
    // The token kernels take the plain arguments, which TmaForwardArgs embeds (the launcher passes those).
    if (tokens) src += TokenKernelsSource("te_jax::cuda::ForwardArgs");
  } else if (direction == Direction::kForward) {
    src += "#include \"cpp/cuda/kernels/sm80/attention_fwd.cuh\"\n"
           "using Fwd = te_jax::cuda::sm80::ForwardKernel<" + element + ", " + dims + ", " + variant + ">;\n"
           "extern \"C\" __global__ void __launch_bounds__(Fwd::kThreads)\n"
           "te_jax_attention_forward(const te_jax::cuda::ForwardArgs args) { Fwd::Run(args); }\n";
    if (tokens) src += TokenKernelsSource("te_jax::cuda::ForwardArgs");
  } else if (Family() == KernelFamily::kSm90) {
    // The row kernels (delta', and the dq accumulator's conversion) come from the sm80 family (plain loads, any arch).
    int count = 0;
    const char* const* entries = EntryPoints(&count);
    src += "#include \"cpp/cuda/kernels/sm80/attention_bwd.cuh\"\n"
           "#include \"cpp/cuda/kernels/sm90/attention_bwd.cuh\"\n"
           "using Pre = te_jax::cuda::sm80::BackwardPreprocessKernel<" + element + ", " + dims +
           (bias ? ", true" : "") + ">;\n"
           "using DkDv = te_jax::cuda::sm90::BackwardKernel<" + element + ", " + dims + ", " + variant + ", true, " +
           (deterministic ? "false" : "true") + ">;\n" +
           (deterministic
                ? "using Dq = te_jax::cuda::sm90::BackwardKernel<" + element + ", " + dims + ", " + variant + ", false>;\n"
                : "using DqConvert = te_jax::cuda::sm80::BackwardDqConvertKernel<" + element + ", " + dims + ">;\n") +
           "extern \"C\" __global__ void __launch_bounds__(Pre::kThreads)\n" + entries[0] +
           "(const te_jax::cuda::BackwardArgs args) { Pre::Run(args); }\n"
           "extern \"C\" __global__ void __launch_bounds__(DkDv::kThreads, 1)\n" + entries[1] +
           "(const __grid_constant__ te_jax::cuda::TmaBackwardArgs args) { DkDv::Run(args); }\n";
    src += deterministic ? std::string("extern \"C\" __global__ void __launch_bounds__(Dq::kThreads, 1)\n") + entries[2] +
                               "(const __grid_constant__ te_jax::cuda::TmaBackwardArgs args) { Dq::Run(args); }\n"
                         : std::string("extern \"C\" __global__ void __launch_bounds__(DqConvert::kThreads)\n") +
                               entries[2] + "(const te_jax::cuda::BackwardArgs args) { DqConvert::Run(args); }\n";
    if (bias) src += BiasGradConvertSource(bias_dtype, entries[3]);
    // The token kernels take the plain arguments, which TmaBackwardArgs embeds (the launcher passes those).
    if (tokens) src += TokenKernelsSource("te_jax::cuda::BackwardArgs");
  } else {
    const std::string dq_kernel = deterministic ? "Dq" : "DqConvert";
    src += "#include \"cpp/cuda/kernels/sm80/attention_bwd.cuh\"\n"
           "using Pre = te_jax::cuda::sm80::BackwardPreprocessKernel<" + element + ", " + dims +
           (bias ? ", true" : "") + ">;\n"
           "using DkDv = te_jax::cuda::sm80::BackwardDkDvKernel<" + element + ", " + dims + ", " + variant + ", " +
           (deterministic ? "false" : "true") + ">;\n";
    src += deterministic
               ? "using Dq = te_jax::cuda::sm80::BackwardDqKernel<" + element + ", " + dims + ", " + variant + ">;\n"
               : "using DqConvert = te_jax::cuda::sm80::BackwardDqConvertKernel<" + element + ", " + dims + ">;\n";
    int count = 0;
    const char* const* entries = EntryPoints(&count);
    const std::string kernels[] = {"Pre", "DkDv", dq_kernel};
    for (int i = 0; i < 3; ++i) {
      src += "extern \"C\" __global__ void __launch_bounds__(" + kernels[i] + "::kThreads)\n" + entries[i] +
             "(const te_jax::cuda::BackwardArgs args) { " + kernels[i] + "::Run(args); }\n";
    }
    if (bias) src += BiasGradConvertSource(bias_dtype, entries[3]);
    if (tokens) src += TokenKernelsSource("te_jax::cuda::BackwardArgs");
  }
  return src;
}

KernelConfig ConfigFor(const AttentionParams& params, Direction direction, const std::string& arch) {
  KernelConfig c;
  c.direction = direction;
  c.dtype = params.dtype;
  c.head_dim = static_cast<int>(params.head_dim);
  c.head_dim_v = static_cast<int>(params.head_dim_v);
  c.softcap = params.softcap > 0.0f;
  c.alibi = params.has_alibi;
  c.deterministic = direction == Direction::kBackward &&
                    (params.deterministic || !sm80::BackwardAccumulatesDq(c.head_dim, c.head_dim_v));
  c.tokens = UsesTokens(params);
  c.dropout = params.dropout_threshold > 0;
  c.bias = params.has_bias;
  c.bias_dtype = params.has_bias ? params.bias_dtype : DType::kFloat32;
  c.bias_fits_tma = BiasFitsTma(params);
  c.decode = direction == Direction::kForward && UsesDecodeKernels(params);
  c.arch = arch;
  const char* stress = std::getenv("TE_JAX_PIPELINE_STRESS");
  c.pipeline_stress = stress != nullptr && std::string(stress) == "1";
  return c;
}

KernelConfig LengthGuardConfig(const std::string& arch) {
  KernelConfig c;
  c.kind = ModuleKind::kLengthGuard;
  c.arch = arch;
  const char* stress = std::getenv("TE_JAX_PIPELINE_STRESS");
  c.pipeline_stress = stress != nullptr && std::string(stress) == "1";
  return c;
}

Status Sm90ForwardKernelFor(const KernelConfig& config, const AttentionParams& params, Sm90ForwardKernel* kernel) {
  const char* env = std::getenv("TE_JAX_SM90_PERSISTENT");
  const std::string mode = env == nullptr || *env == '\0' ? "auto" : env;
  if (mode != "auto" && mode != "0" && mode != "1") {
    return Status::InvalidArgument("TE_JAX_SM90_PERSISTENT must be auto, 0 or 1, got \"" + mode + "\"");
  }
  const bool three = config.HasThreeConsumerForward();
  const int block_n = sm90::ForwardTileSize(static_cast<int>(params.head_dim), static_cast<int>(params.head_dim_v),
                                            config.tokens, three ? 3 : 2, config.BiasBytes())
                          .block_n;
  const bool persistent =
      config.HasPersistentForward() &&
      (mode == "1" || (mode == "auto" && sm90::ForwardPrefersPersistentKernel(
                                             three, static_cast<int>((params.seqlen_kv + block_n - 1) / block_n),
                                             IsCausal(params.mask_type))));
  *kernel = persistent ? Sm90ForwardKernel{1, 2, true} : Sm90ForwardKernel{0, three ? 3 : 2, false};
  return Status::Ok();
}

bool BiasFitsTma(const AttentionParams& params) {
  return params.has_bias && !(params.bias_broadcast & kBroadcastKey) &&
         params.seqlen_kv * DTypeSize(params.bias_dtype) % 16 == 0;
}

bool DependentLaunch(const std::string& arch) { return ArchNumber(arch) >= 90; }

bool HasTma(const std::string& arch) { return ArchNumber(arch) >= 90; }

std::string ArchForComputeCapability(int major, int minor) {
  std::string arch = "sm_" + std::to_string(major) + std::to_string(minor);
  if (major == 9 || major == 10 || major == 12) arch += "a";  // arch-specific targets of Hopper and Blackwell
  return arch;
}

}  // namespace te_jax::cuda
