// Register blocking: a block of C lives in vector registers while k runs, fed per step by two vector loads of B and
// one broadcast of A per row, so the loop is bound by FMA throughput rather than by loads and stores: 6 x 16 in 12 ymm
// registers (AVX2: 16 registers), 8 x 32 in 16 zmm (AVX-512: 32 registers, twice the lanes per FMA). Every element of
// C takes one fused multiply-add per k in k order on either, so both give the same bits.
#include "cpp/cpu/tile_gemm.h"

#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_vector.h"

namespace te_jax::cpu {
namespace {

// The rows of C a block holds in registers, two vectors per row (above).
template <typename V>
constexpr int kBlockRows = Vector<V>::kWidth == 8 ? 6 : 8;

template <typename V, int kRows, int kVectors>
inline void GemmBlock(int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t b_row,
                      float* c, int64_t c_row, Accumulate accumulate) {
  using Vec = Vector<V>;
  V acc[kRows][kVectors];
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kVectors; ++j) {
      acc[i][j] = accumulate == Accumulate::kYes ? Vec::Load(c + i * c_row + j * Vec::kWidth) : V{};
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    V b_k[kVectors];
    for (int j = 0; j < kVectors; ++j) b_k[j] = Vec::Load(b + k * b_row + j * Vec::kWidth);
    for (int i = 0; i < kRows; ++i) {
      // A scalar times a vector rather than Splat: GCC then broadcasts straight from memory (one vbroadcastss m32),
      // where a Splat of the loaded float took three instructions per element of A (decode's key-major products).
      const float a_ik = a[i * a_row + k * a_col];
      for (int j = 0; j < kVectors; ++j) acc[i][j] += a_ik * b_k[j];
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kVectors; ++j) Vec::Store(c + i * c_row + j * Vec::kWidth, acc[i][j]);
  }
}

// The last rows_left (0 to kRows) rows of C as one block.
template <typename V, int kVectors, int kRows>
inline void GemmLastRows(int64_t rows_left, int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b,
                         int64_t b_row, float* c, int64_t c_row, Accumulate accumulate) {
  if constexpr (kRows > 0) {
    if (rows_left == kRows) {
      GemmBlock<V, kRows, kVectors>(depth, a, a_row, a_col, b, b_row, c, c_row, accumulate);
    } else {
      GemmLastRows<V, kVectors, kRows - 1>(rows_left, depth, a, a_row, a_col, b, b_row, c, c_row, accumulate);
    }
  }
}

// All rows of C against kVectors vectors of columns: full blocks, then one block of the remaining rows.
template <typename V, int kVectors>
inline void GemmColumnPanel(int64_t rows, int64_t depth, const MatrixA& a, const float* b, int64_t b_row, float* c,
                            int64_t c_row, Accumulate accumulate) {
  int64_t i = 0;
  for (; i + kBlockRows<V> <= rows; i += kBlockRows<V>) {
    GemmBlock<V, kBlockRows<V>, kVectors>(depth, a.data + i * a.row_stride, a.row_stride, a.col_stride, b, b_row,
                                          c + i * c_row, c_row, accumulate);
  }
  GemmLastRows<V, kVectors, kBlockRows<V> - 1>(rows - i, depth, a.data + i * a.row_stride, a.row_stride, a.col_stride,
                                               b, b_row, c + i * c_row, c_row, accumulate);
}

// Tiles of at most this many rows (a decode tile's P V) take panels of four vectors where the columns allow, each row
// of B then walked half as often: with AVX-512's 32 registers only (the 16 accumulators alone fill AVX2's 16).
constexpr int64_t kFewRows = 4;

// Panels of two vectors of V; what is left (columns come in multiples of kLanes) in one V, then one F32x8.
template <typename V>
inline void TileGemmBody(int64_t rows, int64_t cols, int64_t depth, const MatrixA& a, const MatrixB& b,
                         const MatrixC& c, Accumulate accumulate) {
  constexpr int kWidth = Vector<V>::kWidth;
  int64_t j = 0;
  if (kWidth > kLanes && rows <= kFewRows) {
    for (; j + 4 * kWidth <= cols; j += 4 * kWidth) {
      GemmLastRows<V, 4, kFewRows>(rows, depth, a.data, a.row_stride, a.col_stride, b.data + j, b.row_stride,
                                   c.data + j, c.row_stride, accumulate);
    }
  }
  for (; j + 2 * kWidth <= cols; j += 2 * kWidth) {
    GemmColumnPanel<V, 2>(rows, depth, a, b.data + j, b.row_stride, c.data + j, c.row_stride, accumulate);
  }
  if (kWidth > kLanes && j + kWidth <= cols) {
    GemmColumnPanel<V, 1>(rows, depth, a, b.data + j, b.row_stride, c.data + j, c.row_stride, accumulate);
    j += kWidth;
  }
  if (j < cols) {
    GemmColumnPanel<F32x8, 1>(rows, depth, a, b.data + j, b.row_stride, c.data + j, c.row_stride, accumulate);
  }
}

template <typename V>
constexpr int64_t kPanelCols = 2 * Vector<V>::kWidth;

}  // namespace

void TileGemm(int64_t rows, int64_t cols, int64_t depth, const MatrixA& a, const MatrixB& b, const MatrixC& c,
              Accumulate accumulate) {
  RunWithWidestVectors<&TileGemmBody<F32x8>, &TileGemmBody<F32x16>>(rows, cols, depth, a, b, c, accumulate);
}

int64_t TileGemmReadsOfA(int64_t cols) {
  const int64_t panel = CpuIsa() == Isa::kAvx512 ? kPanelCols<F32x16> : kPanelCols<F32x8>;
  return (cols + panel - 1) / panel;
}

int64_t TileGemmReadsOfB(int64_t rows) {
  const int64_t block = CpuIsa() == Isa::kAvx512 ? kBlockRows<F32x16> : kBlockRows<F32x8>;
  return (rows + block - 1) / block;
}

}  // namespace te_jax::cpu
