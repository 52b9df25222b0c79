// score_mod / mask_mod (te_jax.flex) as a call of the core sees them: what the call states (FlexSpec: the compiled
// libraries serving each mod, its captured arrays' shapes), and the ABI of the tile functions such a library exports,
// which a backend calls on its score tiles with the captures' addresses (FlexCapture). A library is the generated
// struct (te_jax::flex::ScoreMod / MaskMod) compiled with a loop over a tile around it (te_jax/flex/tile_source.py), so
// the per-element call is inlined there and the install-time kernels only gain a call per tile.
//
// Tiles are key-major, as the CPU kernels hold them: element (row r, key c) is scores[c * ld + r], the score of query
// q0 + r and key kv0 + c, for r < rows, c < cols. Indices are the call's global ones: b the batch entry, h the query
// head. A score tile holds `unit` * the logit (the CPU keeps log2 units: unit = log2(e)); Score sees the logit.
//
//   te_jax_flex_score_tile:  scores = unit * Score(scores / unit)           (the forward's and backward's logits)
//   te_jax_flex_dscore_tile: dscores *= DScore(scores / unit) where dscores != 0 (scores: the logits before Score; a
//                            key whose probability is 0, masked or -inf, passes no gradient even where DScore is not
//                            finite)
//   te_jax_flex_mask_tile:   scores = -inf where Mask is false
//   te_jax_flex_dcaptures_tile (a score_mod with floating-point captures): grads[i] += dscores * d Score / d capture i
//                            where dscores != 0 (dscores: the loss's derivative in the modified logits; grads[i] a
//                            float32 array of capture i's shape, null for a capture without a gradient)
#pragma once

#include "cpp/core/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cstdint>
#include <string>
#include <vector>
#endif

namespace te_jax {

// A block's state in a block mask's blocks: the mask_mod hides all its pairs, some, or none.
inline constexpr int8_t kBlockHidden = 0, kBlockPartial = 1, kBlockVisible = 2;

// The most dimensions a captured array may have; the CUDA kernels take fewer captures, of fewer dimensions
// (cpp/cuda/kernel_args.h: FlexArgs).
inline constexpr int kMaxFlexCaptureRank = 8;
inline constexpr int kMaxKernelCaptures = 8;
inline constexpr int kMaxKernelCaptureRank = 4;

// A captured array: its elements row-major (what XLA passes), strides in elements.
struct FlexCapture {
  const void* data;
  int64_t rank;
  int64_t shape[kMaxFlexCaptureRank];
  int64_t strides[kMaxFlexCaptureRank];
};

extern "C" {
typedef void (*FlexScoreTile)(const FlexCapture* captures, float unit, float* scores, int64_t ld, int64_t b,
                              int64_t h, int64_t q0, int64_t rows, int64_t kv0, int64_t cols);
typedef void (*FlexDScoreTile)(const FlexCapture* captures, float unit, const float* scores, float* dscores,
                               int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t kv0, int64_t cols);
typedef void (*FlexDCapturesTile)(const FlexCapture* captures, float unit, const float* scores, const float* dscores,
                                  float* const* grads, int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows,
                                  int64_t kv0, int64_t cols);
typedef void (*FlexMaskTile)(const FlexCapture* captures, float* scores, int64_t ld, int64_t b, int64_t h, int64_t q0,
                             int64_t rows, int64_t kv0, int64_t cols);
}

// The exported names of the tile functions.
inline constexpr const char* kFlexScoreTileSymbol = "te_jax_flex_score_tile";
inline constexpr const char* kFlexDScoreTileSymbol = "te_jax_flex_dscore_tile";
inline constexpr const char* kFlexMaskTileSymbol = "te_jax_flex_mask_tile";
inline constexpr const char* kFlexDCapturesTileSymbol = "te_jax_flex_dcaptures_tile";

#if !defined(__CUDACC_RTC__)
// What a call with mods states, the same on both entry paths (FFI: attributes and the trailing operands' shapes;
// legacy: the descriptor). The captures are the custom call's last operands, the score_mod's first.
struct FlexSpec {
  std::string score_library;  // the shared library serving the score_mod; empty: none
  std::string mask_library;   // the mask_mod's; empty: none
  // vmap folds N examples into the batch (example n of entry b is entry b * N + n): the mods see b / batch_fold.
  int64_t batch_fold = 1;
  int64_t score_captures = 0;  // how many of the captures are the score_mod's
  // Bit i: the score_mod's capture i (floating point) has a gradient, one float32 result of the backward each, in
  // capture order after the workspace.
  int64_t capture_gradients = 0;
  // A block mask of the mask_mod (te_jax/block_mask.py): its blocks' queries and keys (0: none). Its blocks, int8
  // [B or 1, H or 1, ceil(Sq / block_q), ceil(Skv / block_kv)] of kBlockHidden / kBlockPartial / kBlockVisible, are the
  // last capture.
  int64_t block_q = 0;
  int64_t block_kv = 0;
  std::vector<std::vector<int64_t>> capture_shapes;

  bool has_score_mod() const { return !score_library.empty(); }
  bool has_mask_mod() const { return !mask_library.empty(); }
  bool active() const { return has_score_mod() || has_mask_mod(); }
  bool has_block_mask() const { return block_q > 0; }
  // The mask_mod's captures (after the score_mod's, before the block mask's blocks).
  int64_t mask_captures() const { return num_captures() - score_captures - (has_block_mask() ? 1 : 0); }
  int64_t num_captures() const { return static_cast<int64_t>(capture_shapes.size()); }
  int64_t capture_elements(int64_t i) const {
    int64_t n = 1;
    for (int64_t extent : capture_shapes[i]) n *= extent;
    return n;
  }
  bool has_capture_gradient(int64_t i) const { return i < 63 && ((capture_gradients >> i) & 1) != 0; }
  int64_t num_capture_gradients() const { return static_cast<int64_t>(gradient_captures().size()); }
  // The capture of each capture gradient, in the backward's result order.
  std::vector<int64_t> gradient_captures() const {
    std::vector<int64_t> captures;
    for (int64_t i = 0; i < score_captures && i < num_captures(); ++i) {
      if (has_capture_gradient(i)) captures.push_back(i);
    }
    return captures;
  }
};
#endif

}  // namespace te_jax
