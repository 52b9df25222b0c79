#include "cpp/cpu/key_lane_scores.h"

#include <algorithm>
#include <utility>

#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_vector.h"

namespace te_jax::cpu {
namespace {

// Lane j of the interleave of a and b: their lanes of one half taken alternately (a0 b0 a1 b1 ... for the low half).
template <int kWidth, bool kHigh>
constexpr int InterleavedLane(int j) {
  return (j % 2 == 0 ? 0 : kWidth) + j / 2 + (kHigh ? kWidth / 2 : 0);
}

template <bool kHigh, typename V, int... kLane>
inline V Interleave(const V& a, const V& b, std::integer_sequence<int, kLane...>) {
  return __builtin_shufflevector(a, b, InterleavedLane<sizeof...(kLane), kHigh>(kLane)...);
}

// A W x W block (W = V's lanes) transposed in registers: log2(W) rounds, each interleaving vector i with vector
// i + W / 2 (a round rotates the bits of (vector, lane) by one, so after log2(W) of them lane j of vector i holds
// what lane i of vector j held).
template <typename V>
inline void TransposeBlock(const float* src, int64_t src_stride, float* dst, int64_t dst_stride) {
  using Vec = Vector<V>;
  constexpr int kWidth = Vec::kWidth;
  using Lanes = std::make_integer_sequence<int, kWidth>;
  V v[kWidth];
  for (int i = 0; i < kWidth; ++i) v[i] = Vec::Load(src + i * src_stride);
  for (int round = 1; round < kWidth; round *= 2) {
    V next[kWidth];
    for (int i = 0; i < kWidth / 2; ++i) {
      next[2 * i] = Interleave<false>(v[i], v[i + kWidth / 2], Lanes{});
      next[2 * i + 1] = Interleave<true>(v[i], v[i + kWidth / 2], Lanes{});
    }
    std::copy(next, next + kWidth, v);
  }
  for (int i = 0; i < kWidth; ++i) Vec::Store(dst + i * dst_stride, v[i]);
}

// Rows [key, key + W) of the run into columns of k_t; the head dims past the last whole block one by one.
template <typename V>
inline void TransposeKeys(const float* rows, int64_t row_stride, int64_t head_dim, float* k_t, int64_t k_t_stride) {
  constexpr int kWidth = Vector<V>::kWidth;
  int64_t c = 0;
  for (; c + kWidth <= head_dim; c += kWidth) TransposeBlock<V>(rows + c, row_stride, k_t + c * k_t_stride, k_t_stride);
  for (; c < head_dim; ++c) {
    for (int i = 0; i < kWidth; ++i) k_t[c * k_t_stride + i] = rows[i * row_stride + c];
  }
}

// The run's keys in blocks of V's lanes, then of 8, then one by one.
template <typename V>
void TransposeRunBody(int64_t count, int64_t head_dim, const float* rows, int64_t row_stride, float* k_t,
                      int64_t k_t_stride) {
  int64_t key = 0;
  for (; key + Vector<V>::kWidth <= count; key += Vector<V>::kWidth) {
    TransposeKeys<V>(rows + key * row_stride, row_stride, head_dim, k_t + key, k_t_stride);
  }
  if constexpr (Vector<V>::kWidth > kLanes) {
    for (; key + kLanes <= count; key += kLanes) {
      TransposeKeys<F32x8>(rows + key * row_stride, row_stride, head_dim, k_t + key, k_t_stride);
    }
  }
  for (; key < count; ++key) {
    for (int64_t c = 0; c < head_dim; ++c) k_t[c * k_t_stride + key] = rows[key * row_stride + c];
  }
}

}  // namespace

bool UseKeyLaneScores(int64_t rows) { return rows <= kLanes && CpuIsa() == Isa::kAvx512; }

KeyLaneScores::KeyLaneScores(int64_t max_keys, int64_t head_dim)
    : head_dim_(head_dim),
      stride_(RoundUpToLanes(max_keys)),
      k_t_(head_dim * stride_),
      scores_t_(kLanes * stride_) {}

void KeyLaneScores::AddKeys(int64_t first, int64_t count, const MatrixB& rows) {
  RunWithWidestVectors<&TransposeRunBody<F32x8>, &TransposeRunBody<F32x16>>(
      count, head_dim_, rows.data, rows.row_stride, k_t_.data() + first, stride_);
}

void KeyLaneScores::Scores(int64_t keys, int64_t rows, int64_t lanes, const float* q_t, int64_t q_t_stride,
                           float* scores, int64_t scores_stride) {
  // TileGemm's columns come in whole vectors of 8: the keys past the tile's are zeros, their scores never read.
  const int64_t padded_keys = RoundUpToLanes(keys);
  for (int64_t c = 0; c < head_dim_; ++c) std::fill_n(k_t_.data() + c * stride_ + keys, padded_keys - keys, 0.0f);
  TileGemm(rows, padded_keys, head_dim_, {q_t, 1, q_t_stride}, {k_t_.data(), stride_}, {scores_t_.data(), stride_},
           Accumulate::kNo);
  for (int64_t key = 0; key < keys; ++key) {
    float* row = scores + key * scores_stride;
    for (int64_t r = 0; r < rows; ++r) row[r] = scores_t_[r * stride_ + key];
    std::fill(row + rows, row + lanes, 0.0f);
  }
}

}  // namespace te_jax::cpu
