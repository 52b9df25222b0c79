// The CPU kernels' tile shape: a score tile is kTileKV keys by kTileQ query rows (the rows in the vector lanes).
#pragma once

#include <cstdint>

namespace te_jax::cpu {

inline constexpr int64_t kTileQ = 64;    // query rows per tile: the lanes of a score tile
inline constexpr int64_t kTileKV = 128;  // keys per tile

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace te_jax::cpu
