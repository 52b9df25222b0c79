// S = Q K^T for a tile of few query rows (a decode step's packed tile) with the keys in the vector lanes. TileGemm
// puts a tile's query rows in the lanes and broadcasts K element by element: with a one-query decode tile's 4 rows
// (h 32 / kv 8) an FMA fills 4 of its 8 lanes, and a broadcast and an FMA per K element bounded the CPU's decode.
// Here the tile's K rows are first transposed in registers (keys along the lanes)
// and TileGemm runs with q as the broadcast operand, so each FMA serves a vector of keys. Every score is the same
// chain of FMAs over d, in the same order, as TileGemm over the K rows gives it: the same bits.
#pragma once

#include <cstdint>
#include <vector>

#include "cpp/cpu/simd_f32x8.h"
#include "cpp/cpu/tile_gemm.h"

namespace te_jax::cpu {

// Whether a tile of `rows` query rows takes KeyLaneScores: at most 8 rows (above, TileGemm's lanes are full enough
// that the transpose would not pay for itself), where the AVX-512 products run (with AVX2's 8-lane vectors, whose
// interleaves cross the register's 128-bit halves, one-query decode measured 0.7-1.0x of TileGemm's, 2-core Xeon).
bool UseKeyLaneScores(int64_t rows);

class KeyLaneScores {
 public:
  KeyLaneScores(int64_t max_keys, int64_t head_dim);

  // Keys [first, first + count) of the tile: float32 rows of head_dim elements, rows.row_stride apart.
  void AddKeys(int64_t first, int64_t count, const MatrixB& rows);

  // scores[key * scores_stride + r] = the product of q row r (column r of q_t, [head_dim, q_t_stride]) with key `key`
  // for the tile's keys [0, keys) (all added) and rows [0, rows <= kLanes); lanes [rows, lanes) get zeros.
  void Scores(int64_t keys, int64_t rows, int64_t lanes, const float* q_t, int64_t q_t_stride, float* scores,
              int64_t scores_stride);

 private:
  int64_t head_dim_;
  int64_t stride_;               // the transposed tile's row length: max_keys rounded up to kLanes
  std::vector<float> k_t_;       // [head_dim, stride_]: K^T
  std::vector<float> scores_t_;  // [kLanes, stride_]: S^T
};

}  // namespace te_jax::cpu
