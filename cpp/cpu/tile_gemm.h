// The one matrix product of the CPU kernels, C (+)= A B on float32 tiles, used for S = Q K^T, O += P V and the five
// backward products.
#pragma once

#include <cstdint>

namespace te_jax::cpu {

// Element (i, k) of A is at data[i * row_stride + k * col_stride]. A is only ever broadcast one element at a time, so
// any strides serve: the kernels multiply by a tile or by its transpose without copying it.
struct MatrixA {
  const float* data;
  int64_t row_stride;
  int64_t col_stride;
};

// Row-major with contiguous rows; the column count must be a multiple of kLanes.
struct MatrixB {
  const float* data;
  int64_t row_stride;
};
struct MatrixC {
  float* data;
  int64_t row_stride;
};

enum class Accumulate : bool { kNo = false, kYes = true };

// C[rows x cols] = A[rows x depth] B[depth x cols], or += with Accumulate::kYes. cols must be a multiple of kLanes.
void TileGemm(int64_t rows, int64_t cols, int64_t depth, const MatrixA& a, const MatrixB& b, const MatrixC& c,
              Accumulate accumulate);

// How many times TileGemm reads each element of A (once per panel of C's columns) and of B (once per block of C's
// rows): whether a compact copy of an operand can pay for itself (key_rows.h).
int64_t TileGemmReadsOfA(int64_t cols);
int64_t TileGemmReadsOfB(int64_t rows);

}  // namespace te_jax::cpu
