// The additive logit bias on the CPU (cpp/core/bias.h): added to a key-major score tile after the variant's logit and
// before the mask, and its gradient gathered from the tile's dS in the backward.
//
// dbias sums dS over the bias's broadcast dims, and several backward work items (batch, KV head, run of KV tiles) add
// to the same element. To keep the sum independent of the thread timing, each item adds into its own float32 copy of
// dbias, chosen by the item's coordinates along the broadcast dims (BiasGradientCopy): two items that share a copy
// differ along a full dim, so they never touch the same element, and each element of a copy gets its additions from
// one item in the item's fixed loop order. The copies are summed in index order at the end. They cost
// copies * |bias| floats (at most the full [B, H, Sq, Skv] broadcast in float32: B copies for a [1, H, Sq, Skv] bias).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpp/core/bias.h"
#include "cpp/cpu/element_types.h"
#include "cpp/cpu/parallel_for.h"

namespace te_jax::cpu {

// One call's bias operand; data is null without a bias.
struct BiasOperand {
  const void* data = nullptr;
  DType dtype = DType::kFloat32;
  BiasLayout layout{};

  bool active() const { return data != nullptr; }
};

inline BiasOperand MakeBiasOperand(const AttentionParams& p, const void* data) {
  return p.has_bias ? BiasOperand{data, p.bias_dtype, MakeBiasLayout(p)} : BiasOperand{};
}

// scores[c * row_stride + r] += factor * bias[b, h, first_row + r, key0 + c] for the tile's rows and keys.
inline void AddBias(const BiasOperand& bias, int64_t b, int64_t h, int64_t first_row, int64_t rows, int64_t key0,
                    int64_t keys, float factor, int64_t row_stride, float* scores) {
  DispatchDType(bias.dtype, [&](auto tag) {
    const auto* data = static_cast<const decltype(tag)*>(bias.data);
    for (int64_t c = 0; c < keys; ++c) {
      for (int64_t r = 0; r < rows; ++r) {
        scores[c * row_stride + r] += factor * ToFloat(data[bias.layout.Offset(b, h, first_row + r, key0 + c)]);
      }
    }
  });
}

// dbias_copy[b, h, first_row + r, key0 + c] += dscores[c * row_stride + r] (dS in natural units), broadcast dims
// summed through the layout's zero strides.
inline void AddBiasGradient(const BiasLayout& layout, int64_t b, int64_t h, int64_t first_row, int64_t rows,
                            int64_t key0, int64_t keys, const float* dscores, int64_t row_stride, float* dbias_copy) {
  for (int64_t c = 0; c < keys; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      dbias_copy[layout.Offset(b, h, first_row + r, key0 + c)] += dscores[c * row_stride + r];
    }
  }
}

// How many dbias copies a backward of `runs` KV-tile runs needs (see the top of this file).
inline int64_t BiasGradientCopies(const AttentionParams& p, int64_t runs) {
  const uint8_t bits = p.bias_broadcast;
  return (bits & kBroadcastBatch ? p.batch : 1) * (bits & kBroadcastHeads ? p.num_kv_heads : 1) *
         (bits & kBroadcastKey ? runs : 1);
}

// The copy the backward item (batch, kv_head, run) adds to: its coordinates along the broadcast dims.
inline int64_t BiasGradientCopy(const AttentionParams& p, int64_t runs, int64_t batch, int64_t kv_head, int64_t run) {
  const uint8_t bits = p.bias_broadcast;
  int64_t copy = bits & kBroadcastBatch ? batch : 0;
  if (bits & kBroadcastHeads) copy = copy * p.num_kv_heads + kv_head;
  if (bits & kBroadcastKey) copy = copy * runs + run;
  return copy;
}

// dbias = the copies ([copies, |bias|] float32) summed in index order, in the bias's dtype.
inline void SumBiasGradientCopies(TaskScheduler* scheduler, const std::vector<float>& copies, int64_t elements,
                                  DType dtype, void* dbias) {
  constexpr int64_t kSumBlock = 16384;
  const int64_t num_copies = elements > 0 ? static_cast<int64_t>(copies.size()) / elements : 0;
  DispatchDType(dtype, [&](auto tag) {
    using B = decltype(tag);
    ParallelFor(scheduler, (elements + kSumBlock - 1) / kSumBlock, [&](int64_t block) {
      const int64_t begin = block * kSumBlock, end = std::min(elements, begin + kSumBlock);
      for (int64_t e = begin; e < end; ++e) {
        float sum = 0.0f;
        for (int64_t c = 0; c < num_copies; ++c) sum += copies[c * elements + e];
        static_cast<B*>(dbias)[e] = FromFloat<B>(sum);
      }
    });
  });
}

}  // namespace te_jax::cpu
