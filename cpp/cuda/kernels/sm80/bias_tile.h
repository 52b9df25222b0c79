// The additive logit bias in the sm80 family: its tiles in shared memory, and the dk/dv kernel's tile of dS
// that becomes dbias.
//
// A bias tile holds rows [row0, row0 + kRows) (query positions) x columns [col0, col0 + kCols) (key positions) of one
// (batch, head) of the operand (BiasArgs), in its element type. It is copied like the k/v tiles, by cp.async in
// 16-byte chunks one stage ahead. A bias row need not start on a 16-byte boundary (Skv has any length), so each row is
// copied from the chunk that holds its first element, with one spare chunk per row, and starts `skew` elements into
// its shared-memory row. The broadcast dims cost nothing: a query-broadcast bias ([.., 1, Skv], e.g. a key mask)
// stages one row that every row reads; a key-broadcast one ([.., Sq, 1]: a constant per row, which moves only the lse
// and the rows it makes -inf, so rare) stages each row's value replicated along the row by plain loads. The readers
// thus never branch on the layout: Row() gives the address of a row's first column, and the columns follow it.
#pragma once

#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/bias_element.h"
#include "cpp/cuda/kernels/common/bias_grad.h"
#include "cpp/cuda/kernels/primitives/cp_async.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"

namespace te_jax::cuda::sm80 {

// The bias of one (batch, head): element (i, j) at data[offset + i * query_stride + j * key_stride].
struct BiasRows {
  const void* data;
  int64_t offset;
  int32_t query_stride;
  int32_t key_stride;
  int64_t elements;

  static __device__ __forceinline__ BiasRows Of(const BiasArgs& a, int b, int h) {
    return {a.data, b * a.batch_stride + h * a.head_stride, a.query_stride, a.key_stride, a.elements};
  }
};

template <typename Bias, int kRows, int kCols>
struct BiasTile {
  using Element = BiasElementOf<Bias>;
  using Storage = typename Element::Storage;
  static constexpr int kSize = static_cast<int>(sizeof(Storage));
  static constexpr int kChunk = 16 / kSize;                // elements per 16-byte chunk
  static constexpr int kChunksPerRow = kCols / kChunk + 1;  // the row and its skew
  // Rows an odd number of chunks apart, so the 8 rows of a fragment's reads start in 8 different bank groups.
  static constexpr int kPitch = kChunksPerRow * kChunk;  // elements
  static constexpr int kBytes = kRows * kPitch * kSize;
  static_assert(kCols % kChunk == 0 && kChunksPerRow % 2 == 1, "bias tile rows: whole chunks, an odd number apart");
  static_assert(kBytes == BiasTileBytes(kRows, kCols, kSize), "tile_size.h and the bias tile disagree on shared memory");

  uint32_t base;  // shared-window address, 16-byte aligned

  // Stages the tile at (row0, col0) of `bias` (col0 a multiple of kChunk, as every tile's first column is); rows at or
  // past seqlen_q are zero-filled. Every thread of the CTA calls it; the copies land with the caller's cp.async group.
  template <int kThreads>
  __device__ __forceinline__ void Load(const BiasRows& bias, int row0, int col0, int seqlen_q, int tid) const {
    const Storage* src = static_cast<const Storage*>(bias.data);
    const int rows = bias.query_stride == 0 ? 1 : kRows;
    if (bias.key_stride == 0) {
      for (int r = tid; r < rows; r += kThreads) {
        const bool valid = bias.query_stride == 0 || row0 + r < seqlen_q;
        const uint32_t x = Element::Splat(
            valid ? Element::LoadGlobal(src + bias.offset + static_cast<int64_t>(row0 + r) * bias.query_stride)
                  : Storage(0));
        for (int c = 0; c < kCols / kChunk; ++c) {
          asm volatile("st.shared.v4.b32 [%0], {%1, %1, %1, %1};" ::"r"(base + (r * kPitch + c * kChunk) * kSize),
                       "r"(x));
        }
      }
      return;
    }
    for (int c = tid; c < rows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, chunk = c - r * kChunksPerRow;
      const int64_t first = bias.offset + static_cast<int64_t>(row0 + r) * bias.query_stride + col0;
      const int64_t at = (first & ~static_cast<int64_t>(kChunk - 1)) + chunk * kChunk;
      const int64_t left = bias.elements - at;  // the last row's last chunk may reach past the operand
      const bool valid = (bias.query_stride == 0 || row0 + r < seqlen_q) && left > 0;
      const int bytes = !valid ? 0 : left >= kChunk ? 16 : static_cast<int>(left) * kSize;
      CpAsync16Partial(base + (r * kPitch + chunk * kChunk) * kSize, valid ? src + at : src, bytes);
    }
  }

  // The address of row r's column 0 of the tile staged at row0; column c is at Row(...) + c * kSize (Value).
  __device__ __forceinline__ uint32_t Row(const BiasRows& bias, int row0, int r) const {
    if (bias.query_stride == 0) r = 0;
    // The skew modulo kChunk needs only the low bits of the element offset (col0 is a multiple of kChunk).
    const uint32_t first = static_cast<uint32_t>(bias.offset) +
                           static_cast<uint32_t>(row0 + r) * static_cast<uint32_t>(bias.query_stride);
    const uint32_t skew = bias.key_stride == 0 ? 0u : first & (kChunk - 1);
    return base + (r * kPitch + skew) * kSize;
  }

  static __device__ __forceinline__ float Value(uint32_t row, int c) { return Element::LoadShared(row + c * kSize); }
};

// One dk/dv step's dS before the logit's derivative (the gradient of each logit, so of the bias) for its kQueries x
// kKeys pairs, stored per element by the fragment loop and added to dbias by the whole CTA after a barrier: reduced
// first along the bias's broadcast dims (in shared memory and registers), then written with coalesced stores or float
// atomics. dbias thus costs an atomic per element only where a full-shape element sums over the batch or the heads;
// a key mask's [B, 1, 1, Skv] gets one per key and step.
template <typename Bias, int kQueries, int kKeys, int kThreads>
struct BiasGradTile {
  // Floats per row: a fragment store's 4 rows (2t apart) land 8t banks apart, its 8 keys in 8 banks of each.
  static constexpr int kPitch = kKeys + 4;
  static constexpr int kBytes = kQueries * kPitch * 4;
  static_assert(kBytes == BiasGradTileBytes(kQueries, kKeys), "tile_size.h and the dbias tile disagree");
  static_assert(kThreads % kKeys == 0, "a whole number of threads per key");

  uint32_t base;  // shared-window address

  __device__ __forceinline__ void Store(int query, int key, float x) const {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(base + (query * kPitch + key) * 4), "f"(x));
  }
  __device__ __forceinline__ float Load(int query, int key) const {
    return BiasElementOf<Float32>::LoadShared(base + (query * kPitch + key) * 4);
  }

  // Adds the tile (queries m0.., keys n0.. of `target`'s (batch, head)) to dbias. Every thread of the CTA calls it,
  // after a barrier behind the last Store.
  __device__ __forceinline__ void Flush(const BiasGradTarget<Bias>& target, int m0, int n0, int seqlen_q, int seqlen_kv,
                                        bool invalid, int tid) const {
    const int queries = min(kQueries, seqlen_q - m0), keys = min(kKeys, seqlen_kv - n0);
    if (target.key_stride != 0) {
      // A thread per key: every element (rows of the queries axis), or their sum where dbias sums over queries.
      constexpr int kRowStep = kThreads / kKeys;
      const int key = tid % kKeys, first = tid / kKeys;
      if (key >= keys || first >= queries) return;
      float sum = 0.0f;
      for (int r = first; r < queries; r += kRowStep) {
        if (target.query_stride != 0) {
          target.Add(target.At(m0 + r, n0 + key), Load(r, key), invalid);
        } else {
          sum += Load(r, key);
        }
      }
      if (target.query_stride == 0) target.Add(target.At(0, n0 + key), sum, invalid);
      return;
    }
    // dbias sums over keys ([.., Sq|1, 1]): a warp per query row, its sum over the tile's keys.
    const int warp = tid >> 5, lane = tid & 31;
    for (int r = warp; r < queries; r += kThreads / 32) {
      float sum = 0.0f;
      for (int k = lane; k < keys; k += 32) sum += Load(r, k);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) target.Add(target.At(m0 + r, 0), sum, invalid);
    }
  }
};

}  // namespace te_jax::cuda::sm80
