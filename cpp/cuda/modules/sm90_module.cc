// The sm90 family's modules (kernels/sm90/): wgmma, TMA and warp specialisation, on sm_90a. A forward module holds
// the forward kernel (three consumer warpgroups where that measured faster, else two) and, for the plain product, the
// persistent one; a backward module the row kernels around the sm90 dk/dv kernel (and the sm90 dq kernel when
// deterministic). A tokens module of an otherwise plain product also has the document kernels (document_tables.cuh).
// Their kernels take the arguments with tensor maps, which must stay in parameter space (__grid_constant__); the
// token-table kernels take the plain arguments those embed.
#include "cpp/cuda/kernels/sm90/tile_size.h"
#include "cpp/cuda/modules/family_modules.h"

namespace te_jax::cuda {
namespace {

ModuleEntry TmaEntry(const std::string& name, const std::string& kernel, const std::string& args, int smem_bytes) {
  return {name, kernel, args, /*one_block_per_sm=*/true, /*grid_constant=*/true, /*launch_bounds=*/true, smem_bytes};
}

KernelModule Forward(const KernelConfig& c) {
  const std::string args = KernelTemplateArgs(c);
  const int consumers = c.HasThreeConsumerForward() ? 3 : 2;
  KernelModule m;
  m.includes = {"cpp/core/variants.h", "cpp/cuda/kernels/sm90/attention_fwd.cuh"};
  // FP8 attention: the kernel's Input is q's, k's and v's format (its last template argument).
  const std::string input = c.Fp8Attention() ? ", false, false, " + Fp8ElementType(c.q_format) : "";
  m.entries.push_back(TmaEntry(
      "te_jax_attention_forward",
      "te_jax::cuda::sm90::ForwardKernel<" + args + ", " + std::to_string(consumers) + input + ">",
      AttentionArgs(c, "te_jax::cuda::TmaForwardArgs"),
      sm90::ForwardSmemBytes(c.head_dim, c.head_dim_v, c.tokens, consumers, c.BiasBytes(), /*persistent=*/false,
                             c.Fp8Attention() ? 1 : 2)));
  const int persistent_smem = sm90::ForwardSmemBytes(c.head_dim, c.head_dim_v, /*tokens=*/false, /*consumers=*/2,
                                                     /*bias_bytes=*/0, /*persistent=*/true);
  if (c.HasPersistentForward()) {
    m.entries.push_back(TmaEntry("te_jax_attention_forward_persistent",
                                 "te_jax::cuda::sm90::ForwardKernel<" + args + ", 2, true>",
                                 "te_jax::cuda::TmaForwardArgs", persistent_smem));
  }
  if (c.HasDocumentForward()) {
    // The plain product's persistent kernel over the document table's works, and the table's kernel.
    KernelConfig plain = c;
    plain.tokens = false;
    const sm90::ForwardTile tile = sm90::ForwardTileSize(c.head_dim, c.head_dim_v);
    m.includes.push_back("cpp/cuda/kernels/common/document_tables.cuh");
    m.entries.push_back(TmaEntry("te_jax_attention_forward_documents",
                                 "te_jax::cuda::sm90::ForwardKernel<" + KernelTemplateArgs(plain) + ", 2, true, true>",
                                 "te_jax::cuda::TmaForwardArgs", persistent_smem));
    m.entries.push_back({"te_jax_document_table",
                         "te_jax::cuda::DocumentTableKernel<" + std::to_string(tile.block_m) + ", " +
                             std::to_string(tile.block_n) + ">",
                         "te_jax::cuda::ForwardArgs"});
  }
  AddTokenKernels(c, "te_jax::cuda::ForwardArgs", &m);
  return m;
}

KernelModule Backward(const KernelConfig& c) {
  const std::string args = KernelTemplateArgs(c);
  using Kind = sm90::BackwardKernelKind;
  const auto smem = [&](Kind kind) {
    return sm90::BackwardSmemBytes(c.head_dim, c.head_dim_v, kind, c.tokens, c.dropout, c.BiasBytes());
  };
  const bool accumulate_dq = !c.deterministic;
  const Kind dkdv = accumulate_dq ? Kind::kDkDvAccumulatingDq : Kind::kDkDv;
  // A score_mod's dk/dv kernel has its capture gradients' scratch after the rest.
  const int scratch = c.score_mod.empty() ? 0
                                          : sm90::BackwardCaptureScratchBytes(c.head_dim, c.head_dim_v, dkdv, c.tokens,
                                                                              c.dropout, c.BiasBytes());
  KernelModule m;
  m.includes = {"cpp/core/variants.h", "cpp/cuda/kernels/common/backward_row_kernels.cuh",
                "cpp/cuda/kernels/sm90/attention_bwd.cuh"};
  m.entries.push_back(BackwardPreprocessEntry(c));
  m.entries.push_back(TmaEntry(
      accumulate_dq ? "te_jax_attention_backward_dkdv_dq" : "te_jax_attention_backward_dkdv",
      "te_jax::cuda::sm90::BackwardKernel<" + args + ", true, " + (accumulate_dq ? "true" : "false") + ">",
      AttentionArgs(c, "te_jax::cuda::TmaBackwardArgs"), smem(dkdv) + scratch));
  if (accumulate_dq) {
    m.entries.push_back(DqConvertEntry(c));
  } else {
    m.entries.push_back(TmaEntry("te_jax_attention_backward_dq",
                                 "te_jax::cuda::sm90::BackwardKernel<" + args + ", false>",
                                 AttentionArgs(c, "te_jax::cuda::TmaBackwardArgs"), smem(Kind::kDq)));
  }
  if (c.bias) m.entries.push_back(BiasGradConvertEntry(c));
  if (c.HasDocumentBackward()) {
    // The plain product's dk/dv kernel over the document table's works (entry 3), and the table's kernel (entry 4).
    KernelConfig plain = c;
    plain.tokens = false;
    const int owned = sm90::BackwardOwnedRows(c.head_dim, c.head_dim_v);
    const int step = sm90::BackwardStepRows(c.head_dim, c.head_dim_v, /*tokens=*/false, /*dropout=*/false);
    m.includes.push_back("cpp/cuda/kernels/common/document_tables.cuh");
    m.entries.push_back(TmaEntry("te_jax_attention_backward_dkdv_dq_documents",
                                 "te_jax::cuda::sm90::BackwardKernel<" + KernelTemplateArgs(plain) +
                                     ", true, true, true>",
                                 "te_jax::cuda::TmaBackwardArgs",
                                 sm90::BackwardSmemBytes(c.head_dim, c.head_dim_v, Kind::kDkDvAccumulatingDq,
                                                         /*tokens=*/false, /*dropout=*/false, /*bias_bytes=*/0)));
    m.entries.push_back({"te_jax_document_table",
                         "te_jax::cuda::DocumentTableKernel<" + std::to_string(owned) + ", " + std::to_string(step) +
                             ", true, te_jax::cuda::BackwardArgs>",
                         "te_jax::cuda::BackwardArgs"});
  }
  AddTokenKernels(c, "te_jax::cuda::BackwardArgs", &m);
  return m;
}

}  // namespace

KernelModule Sm90Module(const KernelConfig& c) {
  return c.direction == Direction::kForward ? Forward(c) : Backward(c);
}

}  // namespace te_jax::cuda
