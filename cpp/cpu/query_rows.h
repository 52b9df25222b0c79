// The query rows of one tile of the CPU kernels: row r is query position[r] of head head[r] of one batch entry, and
// every row's head shares one K/V head, so the rows share their K/V tiles. The usual tile holds consecutive positions
// of one head. A packed tile (decode shapes) holds the heads of one K/V group times a few positions, like
// the CUDA decode kernels' tiles (cpp/cuda/kernels/decode/attention_decode.cuh): a K/V tile is then read (and, for
// 16-bit or paged inputs, converted or gathered) once for the whole group instead of once per query head.
#pragma once

#include <cstdint>

namespace te_jax::cpu {

template <int64_t kRows>
struct QueryRows {
  int64_t batch = 0;
  int64_t kv_head = 0;
  int64_t rows = 0;     // the first `rows` entries below are valid
  bool packed = false;  // made by Packed: rows of several heads. Otherwise consecutive positions of one head, the rows
                        // the bias, dropout and token operands are addressed by (as (head, first position + r)).
  alignas(32) int32_t head[kRows];
  alignas(32) int32_t position[kRows];  // the query index within the batch entry

  // Positions first_row .. first_row + rows - 1 of head h.
  static QueryRows OneHead(int64_t b, int64_t h, int64_t kv_head, int64_t first_row, int64_t rows) {
    QueryRows t;
    t.batch = b;
    t.kv_head = kv_head;
    t.rows = rows;
    for (int64_t r = 0; r < rows; ++r) {
      t.head[r] = static_cast<int32_t>(h);
      t.position[r] = static_cast<int32_t>(first_row + r);
    }
    return t;
  }

  // Rows first .. first + rows - 1 of the group * seqlen_q rows of K/V head kv_head, position-major: packed row i is
  // head kv_head * group + i % group at position i / group. The decode kernels' order; it keeps a tile's positions
  // (and so its rows' key ranges) close together when a group's rows take several tiles.
  static QueryRows Packed(int64_t b, int64_t kv_head, int64_t group, int64_t first, int64_t rows) {
    QueryRows t;
    t.batch = b;
    t.kv_head = kv_head;
    t.rows = rows;
    t.packed = true;
    for (int64_t r = 0; r < rows; ++r) {
      t.head[r] = static_cast<int32_t>(kv_head * group + (first + r) % group);
      t.position[r] = static_cast<int32_t>((first + r) / group);
    }
    return t;
  }

  // Row r's row in the [B * Sq * H] row axis of q, out and dout ([B, Sq, H, dim]): its elements start at
  // TensorRow(r) * dim.
  int64_t TensorRow(int64_t r, int64_t seqlen_q, int64_t heads) const {
    return (batch * seqlen_q + position[r]) * heads + head[r];
  }

  // Row r's element of lse [B, H, Sq].
  int64_t LseIndex(int64_t r, int64_t seqlen_q, int64_t heads) const {
    return (batch * heads + head[r]) * seqlen_q + position[r];
  }
};

}  // namespace te_jax::cpu
