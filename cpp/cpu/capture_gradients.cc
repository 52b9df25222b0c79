#include "cpp/cpu/capture_gradients.h"

#include <algorithm>

namespace te_jax::cpu {

CaptureGradients::CaptureGradients(const FlexSpec& spec, int64_t parts) {
  if (spec.num_capture_gradients() == 0) return;
  for (int64_t i = 0; i < spec.score_captures; ++i) {
    const int64_t size = spec.capture_elements(i);
    const bool has = spec.has_capture_gradient(i);
    offsets_.push_back(has ? elements_ : -1);
    sizes_.push_back(has ? size : 0);
    elements_ += has ? size : 0;
  }
  parts_.resize(parts);
  pointers_.resize(parts);
}

float* const* CaptureGradients::Part(int64_t part) {
  if (parts_.empty()) return nullptr;
  std::vector<float>& values = parts_[part];
  std::vector<float*>& pointers = pointers_[part];
  if (pointers.empty()) {
    values.assign(elements_, 0.0f);
    for (int64_t offset : offsets_) pointers.push_back(offset < 0 ? nullptr : values.data() + offset);
  }
  return pointers.data();
}

void CaptureGradients::Sum(TaskScheduler* scheduler, void* const* outputs) const {
  if (parts_.empty()) return;
  constexpr int64_t kSumBlock = 16384;
  int64_t output = 0;
  for (size_t i = 0; i < offsets_.size(); ++i) {
    if (offsets_[i] < 0) continue;
    float* result = static_cast<float*>(outputs[output++]);
    const int64_t offset = offsets_[i], size = sizes_[i];
    ParallelFor(scheduler, (size + kSumBlock - 1) / kSumBlock, [&](int64_t block) {
      const int64_t begin = block * kSumBlock, end = std::min(size, begin + kSumBlock);
      for (int64_t e = begin; e < end; ++e) {
        float sum = 0.0f;
        for (const std::vector<float>& part : parts_) sum += part.empty() ? 0.0f : part[offset + e];
        result[e] = sum;
      }
    });
  }
}

}  // namespace te_jax::cpu
