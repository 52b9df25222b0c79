// Element types of q, k, v and out. The numeric values are part of the legacy descriptor format: never renumber.
#pragma once

#include <cstdint>

namespace te_jax {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline constexpr int kNumDTypes = 3;

inline int DTypeSize(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace te_jax
