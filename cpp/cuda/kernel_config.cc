#include "cpp/cuda/kernel_config.h"

#include <cstdlib>

#include "cpp/core/bias.h"
#include "cpp/core/limits.h"
#include "cpp/cuda/decode_geometry.h"
#include "cpp/cuda/kernels/common/tile_size.h"
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"
#include "cpp/cuda/kernels/sm90/tile_size.h"
#include "cpp/cuda/token_workspace.h"

namespace te_jax::cuda {
namespace {

// TE_JAX_PIPELINE_STRESS=1: the stress builds of kernel_config.h's pipeline_stress.
bool PipelineStress() {
  const char* stress = std::getenv("TE_JAX_PIPELINE_STRESS");
  return stress != nullptr && std::string(stress) == "1";
}

int ArchNumber(const std::string& arch) {
  int number = 0;  // "sm_90a" -> 90, "sm_100a" -> 100
  for (size_t i = 3; i < arch.size() && arch[i] >= '0' && arch[i] <= '9'; ++i) number = 10 * number + (arch[i] - '0');
  return number;
}

const char* VariantName(bool softcap, bool alibi) {
  if (softcap) return alibi ? "softcap_alibi" : "softcap";
  return alibi ? "alibi" : "scaled";
}

// A mod's name in module names: "_<kind><the source's hash, 16 digits>", from its file name (kernel_config.h).
std::string ModName(const char* kind, const std::string& path) {
  if (path.empty()) return "";
  const size_t end = path.size() >= 4 ? path.size() - 4 : 0;  // before ".cuh"
  return std::string("_") + kind + path.substr(end >= 16 ? end - 16 : 0, 16);
}

// An FP8 KV cache's format in module names.
const char* KvFormatName(KvFormat format) {
  return format == KvFormat::kE4M3 ? "_kv_e4m3" : format == KvFormat::kE5M2 ? "_kv_e5m2" : "";
}

// FP8 attention's format in module names (q, k and v).
const char* QkvFormatName(KvFormat format) { return format == KvFormat::kE4M3 ? "_qkv_e4m3" : "_qkv_e5m2"; }

// The bias's element type in module names.
const char* BiasName(DType dtype) {
  return dtype == DType::kFloat32 ? "_bias_f32" : dtype == DType::kBFloat16 ? "_bias_bf16" : "_bias_fp16";
}

}  // namespace

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
         !dropout && !bias && !mods() && !Fp8Attention();
}

bool KernelConfig::HasDocumentForward() const {
  return direction == Direction::kForward && Family() == KernelFamily::kSm90 && tokens && !softcap && !alibi &&
         !dropout && !bias && !mods() && sm90::ForwardHasPersistentKernel(head_dim, head_dim_v, true);
}

bool KernelConfig::HasDocumentBackward() const {
  return direction == Direction::kBackward && Family() == KernelFamily::kSm90 && tokens && !softcap && !alibi &&
         !dropout && !bias && !mods() && !deterministic &&
         sm90::ServesBackward(head_dim, head_dim_v, /*accumulate_dq=*/true, /*tokens=*/false);
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
  std::string name = std::string(what) + "_" + (dtype == DType::kBFloat16 ? "bf16" : "fp16") +
                     (Fp8Attention() ? QkvFormatName(q_format) : KvFormatName(kv_format)) + "_d" +
                     std::to_string(head_dim) + "_dv" + std::to_string(head_dim_v) + "_" +
                     VariantName(softcap, alibi) + (tokens ? "_tokens" : "") + (dropout ? "_dropout" : "") +
                     (bias ? BiasName(bias_dtype) : "") + ModName("score", score_mod) + ModName("mask", mask_mod) +
                     "_" + arch;
  if (decode) return name + "_decode_n" + std::to_string(decode::kBlockN);
  if (direction != Direction::kForward) {
    if (!sm90) return name;
    return name + "_sm90_" + std::to_string(sm90::BackwardOwnedRows(head_dim, head_dim_v)) + "x" +
           std::to_string(sm90::BackwardStepRows(head_dim, head_dim_v, tokens, dropout, bias));
  }
  if (sm90) {  // the first kernel's tile
    const sm90::ForwardTile t = sm90::ForwardTileSize(head_dim, head_dim_v, tokens, HasThreeConsumerForward() ? 3 : 2,
                                                      BiasBytes(), Fp8Attention() ? 1 : 2);
    return name + "_sm90_" + std::to_string(t.block_m) + "x" + std::to_string(t.block_n);
  }
  const sm80::TileSize t = sm80::ForwardTileSize(head_dim, head_dim_v, bias);
  return name + "_sm80_" + std::to_string(t.block_m) + "x" + std::to_string(t.block_n);
}

Status ConfigFor(const KernelConfig& r, KernelConfig* config) {
  if (r.dtype != DType::kBFloat16 && r.dtype != DType::kFloat16) {
    return Status::InvalidArgument("CUDA kernels are compiled for bfloat16 (1) or float16 (2)");
  }
  for (int hd : {r.head_dim, r.head_dim_v}) {
    if (hd <= 0 || hd % 8 != 0 || hd > kMaxHeadDim) {
      return Status::InvalidArgument("head dims must be multiples of 8 in [8, 256]");
    }
  }
  if (r.deterministic && r.direction != Direction::kBackward) {
    return Status::InvalidArgument("deterministic applies to the backward direction only");
  }
  if (r.decode && r.direction != Direction::kForward) {
    return Status::InvalidArgument("decode applies to the forward direction only");
  }
  if (r.decode && r.dropout) return Status::InvalidArgument("the decode kernels apply no dropout");
  if (r.decode && r.tokens) {
    return Status::InvalidArgument("the decode kernels take no tokens (segment ids, positions)");
  }
  if (r.decode && r.bias) return Status::InvalidArgument("the decode kernels take no bias");
  if (r.Fp8Attention() || IsFp8(r.kv_format)) {
    const std::string refusal = r.Fp8Attention() ? Fp8AttentionRefusal(r) : Fp8Refusal(r);
    if (!refusal.empty()) return Status::InvalidArgument(refusal);
  }
  if (r.bias_fits_tma && !r.bias) return Status::InvalidArgument("bias_fits_tma applies to a bias (bias_dtype) only");
  *config = r;
  config->kind = ModuleKind::kAttention;
  config->deterministic = r.direction == Direction::kBackward &&
                          (r.deterministic || !BackwardAccumulatesDq(r.head_dim, r.head_dim_v));
  if (!r.bias) config->bias_dtype = DType::kFloat32;
  config->pipeline_stress = PipelineStress();
  // Mods: the family of the module itself (its backward scheme decided above).
  if (config->mods() && (config->decode || config->Family() != KernelFamily::kSm90)) {
    return Status::InvalidArgument(
        "score_mod/mask_mod run in the sm90 kernels so far (Hopper, sm_90a; head dims the sm90 " +
        std::string(r.direction == Direction::kForward ? "forward" : "backward") + " serves, a bias whose rows are "
        "whole 16-byte chunks); this call's GPU (" + r.arch + "), head dims (" + std::to_string(r.head_dim) + ", " +
        std::to_string(r.head_dim_v) + ") or bias take another kernel family: run it on the CPU backend, or write it "
        "with fused_attn's built-in options");
  }
  return Status::Ok();
}

std::string Fp8Refusal(const KernelConfig& r) {
  const std::string what = "te_jax's CUDA kernels read an FP8 KV cache in the decode kernels only: ";
  if (r.direction != Direction::kForward) return what + "the forward (the backward takes the dequantized values)";
  if (!r.decode) {
    return what + "a forward of at most " + std::to_string(kMaxDecodeSeqlenQ) +
           " query positions without segment ids, positions, dropout, a bias or score/mask mods";
  }
  if (ArchNumber(r.arch) < 89) {
    return what + "on sm_89 and newer (their f16 products convert FP8 with cvt), not " + r.arch;
  }
  if (r.head_dim % 16 != 0 || r.head_dim_v % 16 != 0) {
    return what + "head dims that are multiples of 16 (rows of whole 16-byte chunks), not (" +
           std::to_string(r.head_dim) + ", " + std::to_string(r.head_dim_v) + ")";
  }
  return "";
}

std::string Fp8AttentionRefusal(const KernelConfig& r) {
  const std::string what = "te_jax's CUDA kernels serve FP8 attention (FP8 q, k and v) in the sm90 forward only: ";
  if (r.kv_format != r.q_format) return what + "k and v in q's FP8 format";
  if (r.direction != Direction::kForward || r.decode) return what + "the forward, in the sm90 family (not decode)";
  if (r.arch != "sm_90a") return what + "on sm_90a (FP8 wgmma), not " + r.arch;
  if (!sm90::ServesFp8Forward(r.head_dim, r.head_dim_v)) {
    return what + "head dims (128, 128) so far, not (" + std::to_string(r.head_dim) + ", " +
           std::to_string(r.head_dim_v) + ")";
  }
  if (r.tokens || r.dropout || r.bias || r.mods()) {
    return what + "without segment ids, positions, dropout, a bias or score/mask mods";
  }
  return "";
}

KernelConfig RequestFor(const AttentionParams& params, Direction direction, const std::string& arch) {
  KernelConfig r;
  r.direction = direction;
  r.dtype = params.dtype;
  r.head_dim = static_cast<int>(params.head_dim);
  r.head_dim_v = static_cast<int>(params.head_dim_v);
  r.softcap = params.softcap > 0.0f;
  r.alibi = params.has_alibi;
  r.deterministic = direction == Direction::kBackward && params.deterministic;
  r.decode = direction == Direction::kForward && UsesDecodeKernels(params);
  r.kv_format = params.kv_format;
  r.q_format = params.q_format;
  r.tokens = UsesTokens(params);
  r.dropout = params.dropout_threshold > 0;
  r.bias = params.has_bias;
  r.bias_dtype = params.bias_dtype;
  r.bias_fits_tma = BiasFitsTma(params);
  r.score_mod = params.flex.score_library;
  r.mask_mod = params.flex.mask_library;
  r.arch = arch;
  return r;
}

Status ConfigFor(const AttentionParams& params, Direction direction, const std::string& arch, KernelConfig* config) {
  return ConfigFor(RequestFor(params, direction, arch), config);
}

KernelConfig LengthGuardConfig(const std::string& arch) {
  KernelConfig c;
  c.kind = ModuleKind::kLengthGuard;
  c.arch = arch;
  c.pipeline_stress = PipelineStress();
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

Status Sm90ReadsDocuments(const KernelConfig& config, bool* reads) {
  const char* env = std::getenv("TE_JAX_SM90_DOCUMENTS");
  const std::string mode = env == nullptr || *env == '\0' ? "all" : env;
  if (mode != "forward" && mode != "all" && mode != "0") {
    return Status::InvalidArgument("TE_JAX_SM90_DOCUMENTS must be all, forward or 0, got \"" + mode + "\"");
  }
  *reads = config.direction == Direction::kForward ? config.HasDocumentForward() && mode != "0"
                                                   : config.HasDocumentBackward() && mode == "all";
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
