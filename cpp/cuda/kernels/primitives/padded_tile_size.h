// The sizes of PaddedTile (padded_tile.h) that host code needs too: head dims padded to the mma k extent (16), rows
// padded by 16 bytes. Host and device compile it.
#pragma once

#include "cpp/core/host_device.h"

namespace te_jax::cuda {

TE_JAX_HOST_DEVICE constexpr int PadHeadDim(int d) { return (d + 15) / 16 * 16; }

// The bytes of a PaddedTile of `rows` x `padded_cols` 16-bit elements.
TE_JAX_HOST_DEVICE constexpr int PaddedTileBytes(int rows, int padded_cols) { return rows * (padded_cols + 8) * 2; }

}  // namespace te_jax::cuda
