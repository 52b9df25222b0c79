// Register blocking: a 6 x 16 block of C lives in 12 vector registers while k runs, fed per step by two vector loads
// of B and six broadcasts of A, so the loop is bound by FMA throughput rather than by loads and stores.
#include "cpp/cpu/tile_gemm.h"

#include "cpp/cpu/isa_dispatch.h"
#include "cpp/cpu/simd_f32x8.h"

namespace te_jax::cpu {
namespace {

constexpr int kBlockRows = 6;
constexpr int kPanelCols = 2 * kLanes;  // TileGemmBody's column panels: GemmColumnPanel<2>

template <int kRows, int kVectors>
inline void GemmBlock(int64_t depth, const float* a, int64_t a_row, int64_t a_col, const float* b, int64_t b_row,
                      float* c, int64_t c_row, Accumulate accumulate) {
  F32x8 acc[kRows][kVectors];
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kVectors; ++j) {
      acc[i][j] = accumulate == Accumulate::kYes ? Load(c + i * c_row + j * kLanes) : F32x8{};
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    F32x8 b_k[kVectors];
    for (int j = 0; j < kVectors; ++j) b_k[j] = Load(b + k * b_row + j * kLanes);
    for (int i = 0; i < kRows; ++i) {
      const F32x8 a_ik = Splat(a[i * a_row + k * a_col]);
      for (int j = 0; j < kVectors; ++j) acc[i][j] += a_ik * b_k[j];
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kVectors; ++j) Store(c + i * c_row + j * kLanes, acc[i][j]);
  }
}

// All rows of C against kVectors * kLanes columns: full blocks of kBlockRows, then one block of the remaining rows.
template <int kVectors>
inline void GemmColumnPanel(int64_t rows, int64_t depth, const MatrixA& a, const float* b, int64_t b_row, float* c,
                            int64_t c_row, Accumulate accumulate) {
  int64_t i = 0;
  for (; i + kBlockRows <= rows; i += kBlockRows) {
    GemmBlock<kBlockRows, kVectors>(depth, a.data + i * a.row_stride, a.row_stride, a.col_stride, b, b_row,
                                    c + i * c_row, c_row, accumulate);
  }
  const float* a_rest = a.data + i * a.row_stride;
  float* c_rest = c + i * c_row;
  const int64_t ar = a.row_stride, ac = a.col_stride;
  switch (rows - i) {
    case 5: GemmBlock<5, kVectors>(depth, a_rest, ar, ac, b, b_row, c_rest, c_row, accumulate); break;
    case 4: GemmBlock<4, kVectors>(depth, a_rest, ar, ac, b, b_row, c_rest, c_row, accumulate); break;
    case 3: GemmBlock<3, kVectors>(depth, a_rest, ar, ac, b, b_row, c_rest, c_row, accumulate); break;
    case 2: GemmBlock<2, kVectors>(depth, a_rest, ar, ac, b, b_row, c_rest, c_row, accumulate); break;
    case 1: GemmBlock<1, kVectors>(depth, a_rest, ar, ac, b, b_row, c_rest, c_row, accumulate); break;
    default: break;
  }
}

inline void TileGemmBody(int64_t rows, int64_t cols, int64_t depth, const MatrixA& a, const MatrixB& b,
                         const MatrixC& c, Accumulate accumulate) {
  int64_t j = 0;
  for (; j + kPanelCols <= cols; j += kPanelCols) {
    GemmColumnPanel<2>(rows, depth, a, b.data + j, b.row_stride, c.data + j, c.row_stride, accumulate);
  }
  if (j < cols) GemmColumnPanel<1>(rows, depth, a, b.data + j, b.row_stride, c.data + j, c.row_stride, accumulate);
}

}  // namespace

void TileGemm(int64_t rows, int64_t cols, int64_t depth, const MatrixA& a, const MatrixB& b, const MatrixC& c,
              Accumulate accumulate) {
  RunWithBestIsa<&TileGemmBody>(rows, cols, depth, a, b, c, accumulate);
}

int64_t TileGemmReadsOfA(int64_t cols) { return (cols + kPanelCols - 1) / kPanelCols; }
int64_t TileGemmReadsOfB(int64_t rows) { return (rows + kBlockRows - 1) / kBlockRows; }

}  // namespace te_jax::cpu
