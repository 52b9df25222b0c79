// The gradients of a score_mod's floating-point captures on the CPU (cpp/core/flex_mods.h): float32 partial sums, one
// set per part (a worker's, or with deterministic an item's, whose additions come in a fixed order), added up part by
// part in index order into the backward's results, so a deterministic call gives the same bits on every run.
#pragma once

#include <cstdint>
#include <vector>

#include "cpp/core/flex_mods.h"
#include "cpp/cpu/parallel_for.h"

namespace te_jax::cpu {

class CaptureGradients {
 public:
  // Nothing (Part gives null) without capture gradients.
  CaptureGradients(const FlexSpec& spec, int64_t parts);

  // Part `part`'s gradients indexed by the score_mod's captures (null for those without one), zeroed on first use;
  // null without capture gradients. One thread at a time per part.
  float* const* Part(int64_t part);

  // Writes the results (`outputs`: spec.num_capture_gradients() float32 arrays) as the parts' sums in part order.
  void Sum(TaskScheduler* scheduler, void* const* outputs) const;

 private:
  std::vector<int64_t> offsets_;  // per score capture, its gradient's first element in a part; -1 without one
  std::vector<int64_t> sizes_;    // per score capture, its gradient's elements (0 without one)
  int64_t elements_ = 0;
  std::vector<std::vector<float>> parts_;
  std::vector<std::vector<float*>> pointers_;
};

}  // namespace te_jax::cpu
