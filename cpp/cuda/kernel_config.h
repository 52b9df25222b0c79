// One JIT configuration: what a compiled kernel module is specialised on, and the one decision of which module a call
// or a named request takes (ConfigFor). Masks, windows, lengths, scale and softcap value are run-time arguments, so
// the set of modules is small: direction (forward, decode, backward, deterministic backward) x dtype x (D, Dv) x
// variant x arch. A configuration has a readable name (e.g. "fwd_bf16_d128_dv128_softcap_sm_90a_sm90_128x128");
// its kernels and translation unit are kernel_module.h's.
#pragma once

#include <string>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"

namespace te_jax::cuda {

enum class Direction { kForward, kBackward };

// What a module holds: an attention direction of te_jax's kernels, or the length guard other engines run around
// theirs (kernels/common/length_guard.cuh), which depends on the arch alone.
enum class ModuleKind { kAttention, kLengthGuard };

// Which kernel family serves a configuration: sm80 (mma.sync, cp.async; every arch from sm_80), sm90 (wgmma, TMA,
// warp specialisation; on sm_90a the forward, and the backward of head dims up to 128), or decode (the forward of few
// query positions, kernels/decode/; every arch). The family follows from the configuration, so the AOT sets, the
// cache and the launcher agree on it.
enum class KernelFamily { kSm80, kSm90, kDecode };

struct KernelConfig {
  ModuleKind kind = ModuleKind::kAttention;
  Direction direction = Direction::kForward;
  DType dtype = DType::kBFloat16;
  int head_dim = 0;
  int head_dim_v = 0;
  bool softcap = false;
  bool alibi = false;
  // Backward only: the kernels that write dq once per row in a fixed order (a dq kernel after dk/dv) instead of adding
  // it to a float accumulator (kernels/sm80/attention_bwd.cuh, kernels/sm90/attention_bwd.cuh). In a request
  // (ConfigFor), fused_attn's deterministic argument, which is one reason for them.
  bool deterministic = false;
  // Forward only: the decode kernels (cpp/cuda/decode_geometry.h says which calls take them).
  bool decode = false;
  // How k and v are stored: in dtype, or FP8: a KV cache (q in dtype), which the decode kernels alone serve (on sm_89 and
  // newer, head dims multiples of 16: FP8Refusal), or with q_format FP8 attention.
  KvFormat kv_format = KvFormat::kAsQ;
  // FP8 attention proper: q, k and v in this FP8 format (kv_format the same), the output in dtype; the sm90 forward's
  // FP8 kernel serves it (Fp8AttentionRefusal). kAsQ: q in dtype.
  KvFormat q_format = KvFormat::kAsQ;
  bool Fp8Attention() const { return IsFp8(q_format); }
  // Segment ids or positions (packed sequences): the kernels built with the variant's token mask, and the
  // two token-table kernels (kernels/common/token_tables.cuh) as the module's last entries. Both families serve them.
  bool tokens = false;
  // Attention dropout: the kernels built with the variant's dropout (kernels/common/dropout.h); both
  // families serve it.
  bool dropout = false;
  // An additive logit bias of element type bias_dtype: the kernels built with the variant's bias, and in
  // the backward the dbias conversion kernel as the entry after the attention kernels. The sm80 family serves it on
  // every arch; on sm_90a the sm90 family serves a bias whose rows TMA copies (bias_fits_tma: BiasFitsTma) where its
  // ring fits (sm90/tile_size.h).
  bool bias = false;
  DType bias_dtype = DType::kFloat32;
  bool bias_fits_tma = false;
  // score_mod / mask_mod (te_jax.flex): the paths of their generated CUDA sources, flex-<kind>-<sha256 of the
  // source>.cuh in the cache folder (te_jax/flex/cuda_source.py); empty: none. The module renders them into its
  // translation unit and names them by their hashes. The sm90 family's forward and backward serve them.
  std::string score_mod;
  std::string mask_mod;
  bool mods() const { return !score_mod.empty() || !mask_mod.empty(); }
  int BiasBytes() const { return bias ? DTypeSize(bias_dtype) : 0; }  // the bias's element size, 0 without one
  std::string arch;  // NVRTC --gpu-architecture value, e.g. "sm_90a"
  // A test build whose sm90 pipelines sleep at random at every stage hand-over (kernels/primitives/pipeline.h): set by
  // TE_JAX_PIPELINE_STRESS=1 in the environment; its modules carry "_stress" in their names.
  bool pipeline_stress = false;

  KernelFamily Family() const;
  // An sm90 forward module whose first kernel has three consumer warpgroups (sm90/tile_size.h).
  bool HasThreeConsumerForward() const;
  // An sm90 forward module whose second kernel is a persistent one (sm90/tile_size.h), which calls take by their shape.
  bool HasPersistentForward() const;
  bool PlainSm90Forward() const;  // an sm90 forward without soft-cap, ALiBi, tokens, dropout or a bias
  // An sm90 forward module of tokens and otherwise the plain product, where head dims have the persistent kernel: it
  // also has the document kernel (the persistent one over a packed row's documents) and the document table's kernel
  // (kernels/common/document_tables.cuh), after the token kernel.
  bool HasDocumentForward() const;
  // An sm90 backward module of the plain product but for tokens, accumulating dq: it also has the document kernels.
  bool HasDocumentBackward() const;
  std::string Name() const;  // names the family and tile of the forward, e.g. "fwd_bf16_d128_dv128_scaled_sm_90a_sm90_128x128"
  std::string BaseName() const;  // the name without the stress suffix
};

// The one decision of which module serves a request. `requested` holds the options of a call (RequestFor) or of a
// configuration the AOT sets and the tests name (te_jax/aot.py, through the extension's compile and kernel_name), its
// `deterministic` being fused_attn's argument; the module is the deterministic backward for it and wherever the
// default backward does not accumulate dq (kernels/common/tile_size.h), of the family that follows from the rest
// (KernelConfig::Family). A request no module serves is an InvalidArgument naming what is wrong.
Status ConfigFor(const KernelConfig& requested, KernelConfig* config);

// Why no module serves an FP8 KV cache request (kv_format an FP8 format): empty where the decode kernels serve it.
// The one decision of which FP8 calls run on te_jax's CUDA kernels (the others are the Python layer's to dequantize).
std::string Fp8Refusal(const KernelConfig& requested);

// Why no module serves an FP8 attention request (q_format an FP8 format): empty where the sm90 forward's FP8 kernel
// serves it.
std::string Fp8AttentionRefusal(const KernelConfig& requested);

// The request of a validated call's params.
KernelConfig RequestFor(const AttentionParams& params, Direction direction, const std::string& arch);

// The module of a validated call: ConfigFor(RequestFor(...)).
Status ConfigFor(const AttentionParams& params, Direction direction, const std::string& arch, KernelConfig* config);

KernelConfig LengthGuardConfig(const std::string& arch);

// The kernel of an sm90 forward module that a call takes: its index in the module's entries, its consumer warpgroups, and
// whether it is the persistent one. TE_JAX_SM90_PERSISTENT picks the persistent kernel wherever the module has one
// ("1"), never ("0"), or by the call's shape ("auto", the default; sm90/tile_size.h); another value is an error.
struct Sm90ForwardKernel {
  int index = 0;
  int consumers = 2;
  bool persistent = false;
};
Status Sm90ForwardKernelFor(const KernelConfig& config, const AttentionParams& params, Sm90ForwardKernel* kernel);

// Whether an sm90 module's document kernels run for packed calls (the device then decides per call whether the ids
// allow the reading): TE_JAX_SM90_DOCUMENTS=all (the default) launches the forward's (HasDocumentForward) and the
// backward's (HasDocumentBackward), "forward" the forward's alone, "0" none; another value is an error.
Status Sm90ReadsDocuments(const KernelConfig& config, bool* reads);

// Whether a call's bias is one the TMA unit copies row by row: not broadcast along the keys, and its rows (Skv
// elements) whole 16-byte chunks.
bool BiasFitsTma(const AttentionParams& params);

// "sm_80", "sm_86", "sm_89", "sm_90a" (Hopper's arch-specific target), "sm_100a", ... from a compute capability.
std::string ArchForComputeCapability(int major, int minor);

// Whether kernels built for `arch` wait for the previous kernel when launched as dependents (sm_90 and newer:
// kernels/primitives/dependent_launch.h), so the host may launch them so.
bool DependentLaunch(const std::string& arch);

// Whether kernels built for `arch` have the TMA unit (sm_90 and newer), so the host encodes tensor maps for the kernels
// that copy with it where they can (the decode kernels' contiguous calls: kernels/decode/attention_decode.cuh).
bool HasTma(const std::string& arch);

}  // namespace te_jax::cuda
