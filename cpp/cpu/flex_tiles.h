// score_mod / mask_mod on the CPU's key-major score tiles: the tile functions of the call's compiled libraries
// (cpp/core/flex_mods.h), loaded once per process, with the call's captures. A call without mods has none and the
// kernels test `active()` once per tile.
#pragma once

#include <cstdint>
#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/core/flex_mods.h"
#include "cpp/core/status.h"

namespace te_jax::cpu {

class FlexTiles {
 public:
  bool active() const { return score_ != nullptr || mask_ != nullptr; }
  bool has_score() const { return score_ != nullptr; }

  // The tiles hold `unit` * the logit; rows first_row.. of batch entry b (of the folded batch) and query head h.
  void Score(float unit, float* scores, int64_t ld, int64_t b, int64_t h, int64_t first_row, int64_t rows,
             int64_t key0, int64_t keys) const {
    score_(captures_.data(), unit, scores, ld, Batch(b), h + h0_, first_row + q0_, rows, key0 + kv0_, keys);
  }
  // dscores *= DScore(logits before Score) where dscores != 0.
  void DScore(float unit, const float* scores, float* dscores, int64_t ld, int64_t b, int64_t h, int64_t first_row,
              int64_t rows, int64_t key0, int64_t keys) const {
    dscore_(captures_.data(), unit, scores, dscores, ld, Batch(b), h + h0_, first_row + q0_, rows, key0 + kv0_, keys);
  }
  // grads[i] += dscores * d Score / d capture i (dscores: the loss's derivative in the modified logits; scores: the
  // logits before Score); grads indexed by the score_mod's captures, null for those without a gradient.
  void DCaptures(float unit, const float* scores, const float* dscores, float* const* grads, int64_t ld, int64_t b,
                 int64_t h, int64_t first_row, int64_t rows, int64_t key0, int64_t keys) const {
    dcaptures_(captures_.data(), unit, scores, dscores, grads, ld, Batch(b), h + h0_, first_row + q0_, rows,
               key0 + kv0_, keys);
  }
  void Mask(float* scores, int64_t ld, int64_t b, int64_t h, int64_t first_row, int64_t rows, int64_t key0,
            int64_t keys) const {
    mask_(captures_.data() + score_captures_, scores, ld, Batch(b), h + h0_, first_row + q0_, rows, key0 + kv0_,
          keys);
  }
  // Score and Mask where the call has them; Mask not where `visible` (a block mask keeps the whole tile).
  void Apply(float unit, float* scores, int64_t ld, int64_t b, int64_t h, int64_t first_row, int64_t rows,
             int64_t key0, int64_t keys, bool visible = false) const {
    if (score_ != nullptr) Score(unit, scores, ld, b, h, first_row, rows, key0, keys);
    if (mask_ != nullptr && !visible) Mask(scores, ld, b, h, first_row, rows, key0, keys);
  }

  // What the call's block mask says of a tile (the blocks it overlaps): kBlockHidden if they all hide every pair,
  // kBlockVisible if they all keep every pair, else kBlockPartial (and without a block mask).
  int8_t TileState(int64_t b, int64_t h, int64_t first_row, int64_t rows, int64_t key0, int64_t keys) const;

  friend Status LoadFlexTiles(const FlexSpec& spec, const void* const* captures, const uint32_t* offsets,
                              FlexTiles* tiles);

 private:
  // The mods' batch entry: b of the folded batch, from the call's first.
  int64_t Batch(int64_t b) const { return (b + b0_) / batch_fold_; }

  FlexScoreTile score_ = nullptr;
  FlexDScoreTile dscore_ = nullptr;
  FlexDCapturesTile dcaptures_ = nullptr;
  FlexMaskTile mask_ = nullptr;
  std::vector<FlexCapture> captures_;  // the score_mod's, then the mask_mod's (then the block mask's blocks)
  const FlexCapture* blocks_ = nullptr;  // the block mask's blocks, null without one
  int64_t block_q_ = 0, block_kv_ = 0;
  int64_t score_captures_ = 0;
  int64_t batch_fold_ = 1;
  // The global (b, h, q, kv) of the call's element [0, 0, 0, 0] (a shard's; the dropout operand's offsets).
  int64_t b0_ = 0, h0_ = 0, q0_ = 0, kv0_ = 0;
};

// The tile functions of spec's libraries (dlopen'ed once per process and kept), the captures at `captures`
// (spec.num_captures() addresses, row-major with spec.capture_shapes) and the indices' offsets (the dropout operand,
// cpp/core/attention_params.h). Nothing without mods.
Status LoadFlexTiles(const FlexSpec& spec, const void* const* captures, const uint32_t* offsets, FlexTiles* tiles);

}  // namespace te_jax::cpu
