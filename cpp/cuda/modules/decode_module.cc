// The decode kernels' modules (kernels/decode/): the forward of few query positions, on every arch. Entries in the
// order of decode/tile_size.h's kernel indices: the one-row-tile kernel on the deep ring, the four-row-tile kernel, the
// combine of split-KV partials, and the one-row-tile kernel on the shallow ring where that ring is shallower. k and v
// are the dtype's or an FP8 KV cache's (the kernels' last template argument).
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/modules/family_modules.h"

namespace te_jax::cuda {

KernelModule DecodeModule(const KernelConfig& c) {
  const std::string args = KernelTemplateArgs(c);
  const int kv_bytes = KvElementSize(c.dtype, c.kv_format);
  const auto decode_kernel = [&](int index) {
    return "te_jax::cuda::decode::DecodeKernel<" + args + ", " + std::to_string(decode::RowTilesOfKernel(index)) +
           ", " + std::to_string(decode::StagesOfKernel(c.head_dim, c.head_dim_v, kv_bytes, index)) + ", " +
           KvElementType(c) + ">";
  };
  const char* const names[] = {"te_jax_attention_decode_rows16", "te_jax_attention_decode_rows64",
                               "te_jax_attention_decode_combine", "te_jax_attention_decode_rows16_shallow"};
  const int count = decode::kShallowStages < decode::DeepStages(c.head_dim, c.head_dim_v, kv_bytes) ? 4 : 3;
  KernelModule m;
  m.includes = {"cpp/core/variants.h", "cpp/cuda/kernels/decode/attention_decode.cuh",
                "cpp/cuda/kernels/decode/combine.cuh"};
  for (int i = 0; i < count; ++i) {
    const std::string kernel =
        i == decode::kCombineKernel
            ? "te_jax::cuda::decode::CombineKernel<" + ElementType(c.dtype) + ", " + std::to_string(c.head_dim_v) + ">"
            : decode_kernel(i);
    m.entries.push_back({names[i], kernel, "te_jax::cuda::DecodeArgs", /*one_block_per_sm=*/false,
                         /*grid_constant=*/true, /*launch_bounds=*/true,
                         decode::KernelSmemBytes(c.head_dim, c.head_dim_v, kv_bytes, i)});
  }
  return m;
}

}  // namespace te_jax::cuda
