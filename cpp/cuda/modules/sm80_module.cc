// The sm80 family's modules (kernels/sm80/): mma.sync, ldmatrix and cp.async, on every arch from sm_80. A forward
// module holds the forward kernel; a backward module the preprocess, the dk/dv kernel and either the dq conversion
// (the default: dk/dv adds to a float dq accumulator) or the dq kernel (deterministic), then the dbias conversion
// with a bias. With tokens, the token-table kernels follow.
#include "cpp/cuda/kernels/sm80/tile_size.h"
#include "cpp/cuda/modules/family_modules.h"

namespace te_jax::cuda {

KernelModule Sm80Module(const KernelConfig& c) {
  const std::string args = KernelTemplateArgs(c);
  const int bias_bytes = c.BiasBytes();
  KernelModule m;
  m.includes.push_back("cpp/core/variants.h");
  if (c.direction == Direction::kForward) {
    m.includes.push_back("cpp/cuda/kernels/sm80/attention_fwd.cuh");
    m.entries.push_back({"te_jax_attention_forward", "te_jax::cuda::sm80::ForwardKernel<" + args + ">",
                         "te_jax::cuda::ForwardArgs", false, false, true,
                         sm80::ForwardSmemBytes(c.head_dim, c.head_dim_v, c.tokens, bias_bytes)});
    AddTokenKernels(c, "te_jax::cuda::ForwardArgs", &m);
    return m;
  }
  m.includes.push_back("cpp/cuda/kernels/sm80/attention_bwd.cuh");
  m.entries.push_back(BackwardPreprocessEntry(c));
  const bool accumulate_dq = !c.deterministic;
  ModuleEntry dkdv{accumulate_dq ? "te_jax_attention_backward_dkdv_dq" : "te_jax_attention_backward_dkdv",
                   "te_jax::cuda::sm80::BackwardDkDvKernel<" + args + ", " + (accumulate_dq ? "true" : "false") + ">",
                   "te_jax::cuda::BackwardArgs"};
  dkdv.smem_bytes = sm80::BackwardDkDvSmemBytes(c.head_dim, c.head_dim_v, accumulate_dq, c.tokens, bias_bytes);
  m.entries.push_back(dkdv);
  if (accumulate_dq) {
    m.entries.push_back(DqConvertEntry(c));
  } else {
    ModuleEntry dq{"te_jax_attention_backward_dq", "te_jax::cuda::sm80::BackwardDqKernel<" + args + ">",
                   "te_jax::cuda::BackwardArgs"};
    dq.smem_bytes = sm80::BackwardDqSmemBytes(c.head_dim, c.head_dim_v, c.tokens, bias_bytes);
    m.entries.push_back(dq);
  }
  if (c.bias) m.entries.push_back(BiasGradConvertEntry(c));
  AddTokenKernels(c, "te_jax::cuda::BackwardArgs", &m);
  return m;
}

}  // namespace te_jax::cuda
