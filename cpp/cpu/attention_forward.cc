// The CPU forward, flash-style: one work item per (batch, head, Q tile) runs the online softmax over the K/V tiles
// its rows can see; for decode shapes (few query positions, GQA) one per (batch, K/V head, packed tile), whose rows
// are the query heads of the group times the positions, so each K/V tile is read once per group (see PacksHeads).
//
// K and V rows are read through KvRows (cpp/core/kv_rows.h): contiguous [B, Skv, Hkv, D] or, in the forward, the pool of
// a paged KV cache read in place through the page table; as float32 rows where they lie or from a compact copy, as
// suits the tile's products (key_rows.h). Score tiles are key-major (scores[key][row]) so query rows are vector lanes
// (see online_softmax.h), in log2 units (tile_logits.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpp/core/kv_rows.h"
#include "cpp/core/sink.h"
#include "cpp/core/validate.h"
#include "cpp/core/variants.h"
#include "cpp/cpu/all_finite.h"
#include "cpp/cpu/attention_cpu.h"
#include "cpp/cpu/batch_masks.h"
#include "cpp/cpu/bias_tile.h"
#include "cpp/cpu/dropout_tile.h"
#include "cpp/cpu/element_types.h"
#include "cpp/cpu/key_lane_scores.h"
#include "cpp/cpu/key_rows.h"
#include "cpp/cpu/online_softmax.h"
#include "cpp/cpu/operand_args.h"
#include "cpp/cpu/pack_transposed.h"
#include "cpp/cpu/query_rows.h"
#include "cpp/cpu/simd_f32x8.h"
#include "cpp/cpu/tile_gemm.h"
#include "cpp/cpu/tile_key_ranges.h"
#include "cpp/cpu/tile_logits.h"
#include "cpp/cpu/tile_reach.h"
#include "cpp/cpu/tile_shape.h"
#include "cpp/cpu/tile_token_bounds.h"
#include "cpp/cpu/work_items.h"
#include "cpp/cpu/worker_loop.h"

namespace te_jax::cpu {
namespace {

// out[r] += sum over the keys row r sees of P[key][r] * v[key], for a tile that straddles a row's range edge and whose
// V holds a NaN or inf: the matrix product would add 0 * NaN = NaN to the rows that do not see that key, and keys a
// row does not see must never affect it. Rare (only non-finite inputs take it), so plain loops.
template <int64_t kRows>
void AddVisibleProducts(const TileKeyRanges<kRows>& ranges, const float* probs, const MatrixB& v_tile, int64_t key0,
                        int64_t keys, int64_t rows, int64_t dv, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < keys; ++c) {
      if (!ranges.Sees(r, key0 + c)) continue;
      const float p = probs[c * kRows + r];
      for (int64_t j = 0; j < dv; ++j) out[r * dv + j] += p * v_tile.data[c * v_tile.row_stride + j];
    }
  }
}

template <typename T, typename TKv>
struct ForwardArgs : OperandArgs<T, TKv> {
  T* out;
  float* lse;
  const float* sinks;  // [B, H], merged into each finished row (cpp/core/sink.h); null without sinks
};

struct ForwardScratch {
  explicit ForwardScratch(const AttentionParams& p)
      : q_t(p.head_dim * kTileQ), scores(kTileKV * kTileQ), out(kTileQ * p.head_dim_v), k(kTileKV * p.head_dim),
        v(kTileKV * p.head_dim_v), key_lane_scores(kTileKV, p.head_dim) {}
  std::vector<float> q_t;     // [D, kTileQ], scaled
  std::vector<float> scores;  // [kTileKV, kTileQ]
  std::vector<float> out;     // [kTileQ, Dv], unnormalised
  std::vector<float> k, v;    // compact float32 copies of the K/V tile (key_rows.h)
  KeyLaneScores key_lane_scores;  // S for tiles of few rows
  alignas(32) float rescale[kTileQ];
  TileKeyRanges<kTileQ> ranges;
  RowLogitInputs logits;
  OnlineSoftmax<kTileQ> softmax;
};

// The online softmax of one tile's rows over the K/V tiles they see, and its out and lse rows.
template <typename T, typename TKv, typename Variant>
void ForwardTile(const ForwardArgs<T, TKv>& args, ForwardScratch& s, const QueryRows<kTileQ>& tile) {
  const AttentionParams& p = args.params;
  const int64_t b = tile.batch, kv_head = tile.kv_head, rows = tile.rows;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  const int64_t lanes = RoundUpToLanes(rows);
  // The bias, dropout and mods address the rows as (h, first_row + r): only unpacked tiles have them (PacksHeads).
  const int64_t h = tile.head[0], first_row = tile.position[0];
  const RowMask mask = BatchMask(p, args.q_seqlens, args.kv_seqlens, b);
  const TokenMask tokens = BatchTokens(p, args.tokens, b);
  const Variant variant = MakeVariant<Variant>(p, args.alibi_slopes, b, h);

  s.ranges.Compute(mask, tokens, tile.position, rows);
  if constexpr (!kIsLinear<Variant>) s.logits.Compute(p, args.alibi_slopes, mask, tokens, tile);
  s.softmax.Reset();
  std::fill(s.out.begin(), s.out.begin() + rows * dv, 0.0f);
  PackTransposed(args.q, tile, p, d, lanes, kIsLinear<Variant> ? p.scale * kLog2e : 1.0f, s.q_t.data());
  // float32 K/V rows in place or from a compact copy (key_rows.h): a decode tile's few rows read them once.
  const bool k_in_place = ReadInPlace(args.k_rows.row_stride * sizeof(TKv), TileGemmReadsOfA(lanes));
  const bool v_in_place = ReadInPlace(args.v_rows.row_stride * sizeof(TKv), TileGemmReadsOfB(rows));
  const RowDescales k_descales{args.kv_descales, 0}, v_descales{args.kv_descales, 1};
  const bool key_lanes = UseKeyLaneScores(rows);  // a decode tile's scores: key_lane_scores.h

  float* scores = s.scores.data();
  // Key tiles start at the first key a row sees, or at a multiple of kTileKV: with segment ids or positions, whose
  // bounds per aligned tile KVTileTokens computed once (a tile whose ids or positions no row of this tile can see is
  // skipped before anything of it is loaded); and in a packed tile, so that where a row's key tiles are cut, and so
  // its bits, never depend on which rows share its tile (the packed tile size follows the thread count: PlanForward).
  // The products and the online softmax are otherwise per row (a key a row does not see adds exact zeros to its
  // sums), so a packed row gets the bits the unpacked tiles give it wherever the two cut the keys alike: unless a left
  // window starts the rows' keys inside a KV tile (the unpacked tiles then start at their first visible key).
  const bool aligned = tokens.active() || tile.packed;
  const int64_t first_key = aligned ? s.ranges.any.begin / kTileKV * kTileKV : s.ranges.any.begin;
  const KeyTokenBounds no_tokens;
  for (int64_t tile0 = first_key; tile0 < s.ranges.any.end; tile0 += kTileKV) {
    const KeyTokenBounds& key_tokens =
        tokens.active() ? args.kv_tile_tokens[b * CeilDiv(p.seqlen_kv, kTileKV) + tile0 / kTileKV] : no_tokens;
    if (!s.ranges.MayMeet(key_tokens)) continue;
    // A packed tile's first tile starts at its first visible key (TrimKeys narrows the token mask's).
    int64_t key0 = tokens.active() ? tile0 : std::max(tile0, s.ranges.any.begin);
    int64_t key_end = std::min(tile0 + kTileKV, s.ranges.any.end);
    const bool all_see = s.ranges.AllSee(key0, key_end, key_tokens);
    if (!all_see && tokens.active()) {
      s.ranges.TrimKeys(&key0, &key_end);
      if (key0 == key_end) continue;
    }
    const int64_t keys = key_end - key0;
    // A block mask: a tile whose blocks hide every pair adds nothing to its rows (P = 0) and is skipped, unless its V
    // rows hold a NaN or inf, which enters as 0 x NaN (a hidden key's, as without the block mask); one whose blocks
    // keep every pair takes no mask_mod.
    const int8_t block_state = args.flex.TileState(b, h, first_row, rows, key0, keys);
    if (block_state == kBlockHidden) {
      const auto v_runs = KeyRowsAsFloat<kTileKV>(args.v, args.v_rows, b, kv_head, key0, keys, v_in_place, s.v.data(),
                                                 v_descales);
      if (std::all_of(v_runs.begin(), v_runs.end(),
                      [&](const KeyRun& v_run) { return AllFinite(v_run.rows, v_run.count, dv); })) {
        continue;
      }
    }
    const int64_t next_keys = std::min(kTileKV, s.ranges.any.end - (tile0 + kTileKV));
    if (next_keys > 0) {
      PrefetchKeyRows(args.k, args.k_rows, b, kv_head, tile0 + kTileKV, next_keys);
      PrefetchKeyRows(args.v, args.v_rows, b, kv_head, tile0 + kTileKV, next_keys);
    }
    for (const KeyRun& k_run :
         KeyRowsAsFloat<kTileKV>(args.k, args.k_rows, b, kv_head, key0, keys, k_in_place, s.k.data(), k_descales)) {
      if (key_lanes) {
        s.key_lane_scores.AddKeys(k_run.first, k_run.count, k_run.rows);
      } else {
        TileGemm(k_run.count, lanes, d, {k_run.rows.data, k_run.rows.row_stride, 1}, {s.q_t.data(), kTileQ},
                 {scores + k_run.first * kTileQ, kTileQ}, Accumulate::kNo);
      }
    }
    if (key_lanes) s.key_lane_scores.Scores(keys, rows, lanes, s.q_t.data(), kTileQ, scores, kTileQ);
    if constexpr (!kIsLinear<Variant>) ApplyLogits(variant, s.logits, scores, scores, keys, lanes, key0, tokens);
    if (args.bias.active()) AddBias(args.bias, b, h, first_row, rows, key0, keys, kLog2e, kTileQ, scores);
    if (args.flex.active()) {
      args.flex.Apply(kLog2e, scores, kTileQ, b, h, first_row, rows, key0, keys, block_state == kBlockVisible);
    }
    if (!all_see) {
      s.ranges.MaskScores(scores, kTileQ, key0, keys, lanes);
    } else if (tokens.active()) {
      s.ranges.MarkAllSeen(rows);
    }
    s.softmax.Update(scores, kTileQ, keys, lanes, s.rescale);
    // After the softmax's sums (lse sees every probability), before P.V.
    if (args.dropout.active()) ApplyDropout(args.dropout, b, h, first_row, rows, key0, keys, kTileQ, scores);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < dv; ++j) s.out[r * dv + j] *= s.rescale[r];
    }
    const auto v_runs = KeyRowsAsFloat<kTileKV>(args.v, args.v_rows, b, kv_head, key0, keys, v_in_place, s.v.data(),
                                                 v_descales);
    const bool v_finite = all_see || std::all_of(v_runs.begin(), v_runs.end(), [&](const KeyRun& v_run) {
                            return AllFinite(v_run.rows, v_run.count, dv);
                          });
    for (const KeyRun& v_run : v_runs) {
      if (v_finite) {
        TileGemm(rows, dv, v_run.count, {scores + v_run.first * kTileQ, 1, kTileQ}, v_run.rows, {s.out.data(), dv},
                 Accumulate::kYes);
      } else {
        AddVisibleProducts(s.ranges, scores + v_run.first * kTileQ, v_run.rows, key0 + v_run.first, v_run.count, rows,
                           dv, s.out.data());
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    // A row that sees no key gives out = 0 and lse = -inf whatever its accumulator holds. A row that sees keys follows
    // the formula in IEEE arithmetic: a NaN anywhere in it, or a sum of 0 (all its logits -inf, from inf inputs),
    // comes out as NaN. With a bias, a row whose every logit is -inf (a -inf bias on each key it sees, the bias used
    // as a mask) counts as a row that sees no key: its sum is 0, which a NaN logit would have made NaN. So does a row
    // whose every key the mask_mod hides or the score_mod makes -inf.
    const float sum = s.softmax.sum[r];
    const bool sees_keys = s.ranges.RowSeesKeys(r) && !((args.bias.active() || args.flex.active()) && sum == 0.0f);
    float out_scale = sees_keys ? 1.0f / sum : 0.0f;
    float lse = sees_keys ? s.softmax.max[r] * kLn2 + std::log(sum) : -INFINITY;
    if (args.sinks != nullptr) MergeSink(args.sinks[b * p.num_heads + tile.head[r]], lse, out_scale);
    T* out_row = args.out + tile.TensorRow(r, p.seqlen_q, p.num_heads) * dv;
    for (int64_t j = 0; j < dv; ++j) out_row[j] = FromFloat<T>(sees_keys ? s.out[r * dv + j] * out_scale : 0.0f);
    args.lse[tile.LseIndex(r, p.seqlen_q, p.num_heads)] = lse;
  }
}

// Decode shapes: when a head's queries leave lanes of its Q tile empty (Sq < kTileQ), the forward packs
// the query heads of a K/V group times the positions into the rows of shared tiles, like the CUDA decode kernels: the
// empty lanes cost as much as full ones, and each head of the group would read (convert, gather from pages) the same
// K/V tiles again. Measured on 2 cores (h 32 / kv 8, D 128, 4096 keys, bottom-right causal; fp32 and bf16 alike):
// 3.4x at Sq = 1, 2.5x at 4, 1.1-1.4x at 16, 1.25x at 32, 1.02-1.05x at 63; MQA (kv 1) 5.5-7x at Sq = 1. From Sq =
// kTileQ on a head fills its tiles and packing would save nothing. Only for calls without segment ids, positions,
// bias or dropout, whose operands address the rows of one head (and which decoding does not use); and only with more
// than one head per group, as one head's rows already share their K/V tiles. Nor with score_mod / mask_mod, whose
// tiles are one head's rows too.
bool PacksHeads(const AttentionParams& p) {
  return p.num_heads > p.num_kv_heads && p.seqlen_q < kTileQ && !p.has_segment_ids && !p.has_positions &&
         !p.has_bias && p.dropout_threshold == 0 && !p.flex.active();
}

// How the forward cuts the query rows into work items (batch, unit, tile): a unit is a query head whose Sq rows take
// tiles of kTileQ, or, packed, a K/V head whose group * Sq rows take tiles of tile_rows.
struct ForwardTiling {
  bool packed;
  int64_t units;      // per batch entry
  int64_t unit_rows;  // Sq or group * Sq
  int64_t tile_rows;

  int64_t tiles() const { return CeilDiv(unit_rows, tile_rows); }

  QueryRows<kTileQ> Rows(const AttentionParams& p, int64_t b, int64_t unit, int64_t t) const {
    const int64_t group = p.num_heads / p.num_kv_heads;
    const int64_t first = t * tile_rows, rows = std::min(tile_rows, unit_rows - first);
    return packed ? QueryRows<kTileQ>::Packed(b, unit, group, first, rows)
                  : QueryRows<kTileQ>::OneHead(b, unit, unit / group, first, rows);
  }
};

// A packed group's rows are cut into as many tiles as it takes to give each of `threads` threads an item (a single
// K/V head of a single sequence, MQA, would otherwise run on one thread), but no tile narrower than a vector of rows,
// which costs as much as a full vector. Each tile reads the K/V tiles again, so no more tiles than that.
ForwardTiling PlanForward(const AttentionParams& p, int64_t threads) {
  if (!PacksHeads(p)) return {false, p.num_heads, p.seqlen_q, kTileQ};
  const int64_t group_rows = p.num_heads / p.num_kv_heads * p.seqlen_q;
  const int64_t tiles_wanted = CeilDiv(threads, std::max<int64_t>(1, p.batch * p.num_kv_heads));
  const int64_t tile_rows = std::clamp(RoundUpToLanes(CeilDiv(group_rows, tiles_wanted)), kLanes, kTileQ);
  return {true, p.num_kv_heads, group_rows, tile_rows};
}

// The estimated cost of every tile of every batch entry, [B, tiles]: the keys its rows may see.
template <typename T, typename TKv>
std::vector<int64_t> ForwardTileCosts(const AttentionParams& p, const ForwardArgs<T, TKv>& args,
                                      const ForwardTiling& tiling) {
  const int64_t tiles = tiling.tiles();
  std::vector<int64_t> costs(p.batch * tiles);
  if (tiling.packed) {  // no token operands; every K/V head's tiles see the same keys
    TileKeyRanges<kTileQ> ranges;
    for (int64_t b = 0; b < p.batch; ++b) {
      const RowMask mask = BatchMask(p, args.q_seqlens, args.kv_seqlens, b);
      for (int64_t t = 0; t < tiles; ++t) {
        const QueryRows<kTileQ> tile = tiling.Rows(p, b, 0, t);
        ranges.Compute(mask, TokenMask{}, tile.position, tile.rows);
        costs[b * tiles + t] = std::max<int64_t>(0, ranges.any.end - ranges.any.begin);
      }
    }
    return costs;
  }
  const std::vector<QTileReach> reach = QTileKeys(p, args.q_seqlens, args.kv_seqlens, args.tokens);
  for (int64_t i = 0; i < p.batch * tiles; ++i) {
    const KeyRange keys = reach[i].keys;
    costs[i] = std::max<int64_t>(0, keys.end - keys.begin);
    if (args.kv_tile_tokens == nullptr || costs[i] == 0) continue;
    costs[i] = 0;  // the keys of the tiles it may meet
    for (int64_t t = keys.begin / kTileKV; t * kTileKV < keys.end; ++t) {
      if (Meets(p, reach[i], args.kv_tile_tokens, i / tiles, t)) costs[i] += kTileKV;
    }
  }
  return costs;
}

template <typename T, typename TKv, typename Variant>
void Forward(const AttentionParams& p, const ForwardArgs<T, TKv>& args, TaskScheduler* scheduler) {
  const ForwardTiling tiling = PlanForward(p, scheduler != nullptr ? scheduler->NumThreads() : 1);
  const int64_t tiles = tiling.tiles();
  const std::vector<int64_t> costs = ForwardTileCosts(p, args, tiling);
  std::vector<WorkItem> items;
  items.reserve(p.batch * tiling.units * tiles);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t u = 0; u < tiling.units; ++u) {
      for (int64_t t = 0; t < tiles; ++t) items.push_back({b, u, t, costs[b * tiles + t]});
    }
  }
  SortByCostDescending(&items);
  const int64_t workers = NumWorkers(scheduler, static_cast<int64_t>(items.size()));
  std::vector<ForwardScratch> scratch(workers, ForwardScratch(p));
  ParallelForWorkers(scheduler, static_cast<int64_t>(items.size()), workers, [&](int64_t worker, int64_t i) {
    const WorkItem& item = items[i];
    ForwardTile<T, TKv, Variant>(args, scratch[worker], tiling.Rows(p, item.batch, item.head, item.tile));
  });
}

}  // namespace

Status AttentionForward(const AttentionParams& params, const ForwardBuffers& buffers, TaskScheduler* scheduler) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(params, Backend::kCpu));
  TE_JAX_RETURN_IF_ERROR(ValidateSeqlens(params, buffers.q_seqlens, buffers.kv_seqlens));
  TE_JAX_RETURN_IF_ERROR(ValidatePageTable(params, buffers.page_table, buffers.kv_seqlens));
  FlexTiles flex;
  TE_JAX_RETURN_IF_ERROR(LoadFlexTiles(params.flex, buffers.flex_captures, buffers.dropout, &flex));
  const std::vector<KeyTokenBounds> kv_tile_tokens = KVTileTokens(params, TokenOperandsOf(buffers));
  DispatchDType(params.dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    DispatchKvFormat(params.kv_format, dtype_tag, [&](auto kv_tag) {
      using TKv = decltype(kv_tag);
      const ForwardArgs<T, TKv> args{OperandArgsOf<T, TKv>(params, buffers, kv_tile_tokens, flex),
                                     static_cast<T*>(buffers.out), buffers.lse,
                                     params.has_sinks ? buffers.sinks : nullptr};
      DispatchVariant(params.softcap > 0.0f, params.has_alibi, [&](auto variant_tag) {
        Forward<T, TKv, decltype(variant_tag)>(params, args, scheduler);
      });
    });
  });
  return Status::Ok();
}

}  // namespace te_jax::cpu
