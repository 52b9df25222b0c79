// Flash-style attention on the CPU. Forward: one work item per (batch, head, Q tile) runs the online softmax over the
// K/V tiles its rows can see; for decode shapes (few query positions, GQA) one per (batch, K/V head, packed tile),
// whose rows are the query heads of the group times the positions, so each K/V tile is read once per group (see
// PacksHeads). Backward: a KV tile's work owns that tile's dK and dV and walks the Q tiles of its head
// group that see it; dQ, which every KV tile adds to, goes to float32 partial buffers summed once at the end, so no
// write is shared and the five products are computed once each. Which KV tiles share a partial buffer fixes the order
// of dQ's additions: by default one work item per (batch, KV head, KV tile) and one buffer per worker, so the order
// follows the thread scheduling; with params.deterministic one item per (batch, KV head, chunk of KV tiles) and one
// buffer per chunk, so the order is a function of the problem alone (see Backward).
//
// K and V rows are read through KvRows (cpp/kv_rows.h): contiguous [B, Skv, Hkv, D] or, in the forward, the pool of
// a paged KV cache read in place through the page table; as float32 rows where they lie or from a compact copy, as
// suits the tile's products (key_rows.h).
//
// Score tiles are key-major (scores[key][row]) so query rows are vector lanes (see online_softmax.h), and scores are
// kept in log2 units: for the plain scaled dot, scale * log2(e) is folded into the packed Q^T.
#include "cpp/cpu/attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpp/cpu/bias_tile.h"
#include "cpp/cpu/dropout_tile.h"
#include "cpp/cpu/element_types.h"
#include "cpp/cpu/key_lane_scores.h"
#include "cpp/cpu/key_rows.h"
#include "cpp/cpu/online_softmax.h"
#include "cpp/cpu/query_rows.h"
#include "cpp/cpu/row_as_float.h"
#include "cpp/cpu/simd_f32x8.h"
#include "cpp/cpu/softmax_backward.h"
#include "cpp/cpu/tile_gemm.h"
#include "cpp/cpu/tile_key_ranges.h"
#include "cpp/cpu/tile_token_bounds.h"
#include "cpp/cpu/worker_loop.h"
#include "cpp/kv_rows.h"
#include "cpp/sink.h"
#include "cpp/validate.h"
#include "cpp/variants.h"
#include "cpp/token_mask.h"
#include "cpp/visible_keys.h"

namespace te_jax::cpu {
namespace {

constexpr int64_t kTileQ = 64;    // query rows per tile: the lanes of a score tile
constexpr int64_t kTileKV = 128;  // keys per tile
// The deterministic backward cuts each (batch, KV head)'s KV tiles into chunks, each with its own float32 copy of dQ:
// enough chunks for kDeterministicItems (batch, KV head, chunk) items, to keep a many-core machine busy, but at most
// kMaxDqChunks copies of dQ (the default backward holds one per thread).
constexpr int64_t kDeterministicItems = 64;
constexpr int64_t kMaxDqChunks = 8;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The plain scaled dot is linear in q, so its scale (and log2 e) can ride on the packed Q^T and the tiles need no
// per-element logit pass; the other variants apply Logit to the raw dot products.
template <typename Variant>
constexpr bool kIsLinear = !Variant::kHasSoftcap && !Variant::kHasAlibi;

template <typename Variant>
Variant MakeVariant(const AttentionParams& p, const float* alibi_slopes, int64_t b, int64_t h) {
  return Variant{p.scale, p.softcap, Variant::kHasAlibi ? alibi_slopes[b * p.num_heads + h] : 0.0f};
}

// The index-based part of the mask. With positions the causal diagonal and the window are TokenMask's, by position,
// so the index range is the whole (unpadded: positions never come with padding masks) key axis.
RowMask BatchMask(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens, int64_t b) {
  // Positions go with the masks without lengths (validate.cc): their causal mask and window are the tokens'.
  if (p.has_positions) return MakeRowMask(MaskType::kNoMask, p.seqlen_q, p.seqlen_kv, -1, -1);
  const bool lengths = IsPadding(p.mask_type);
  return MakeRowMask(p.mask_type, q_seqlens != nullptr ? q_seqlens[b] : p.seqlen_q,
                     lengths ? kv_seqlens[b] : p.seqlen_kv, p.window_left, p.window_right);
}

// The segment ids and positions of one call; BatchTokens gives batch entry b's TokenMask (inactive without them).
struct TokenOperands {
  const int32_t* q_ids;
  const int32_t* kv_ids;
  const int32_t* q_pos;
  const int32_t* kv_pos;
};

TokenOperands TokenOperandsOf(const AttentionOperands& o) {
  return {o.q_segment_ids, o.kv_segment_ids, o.q_positions, o.kv_positions};
}

TokenMask BatchTokens(const AttentionParams& p, const TokenOperands& t, int64_t b) {
  return MakeTokenMask(p.has_segment_ids, p.has_positions, t.q_ids, t.kv_ids, t.q_pos, t.kv_pos, p.seqlen_q,
                       p.seqlen_kv, IsCausal(p.mask_type), p.window_left, p.window_right, b);
}

// One (batch, head) of a [B, S, heads, dim] tensor: row i starts at base + i * stride.
template <typename T>
struct HeadRows {
  T* base;
  int64_t stride;
  T* Row(int64_t i) const { return base + i * stride; }
};

template <typename T>
HeadRows<T> Head(T* tensor, int64_t seqlen, int64_t heads, int64_t dim, int64_t b, int64_t h) {
  return {tensor + (b * seqlen * heads + h) * dim, heads * dim};
}

// out[d][r] = factor * (tile row r of `tensor`, [B, Sq, H, dim])[d], zero in the lanes past the tile's rows: the B
// operand of the key-major score products.
template <typename T>
void PackTransposed(const T* tensor, const QueryRows<kTileQ>& tile, const AttentionParams& p, int64_t dim,
                    int64_t lanes, float factor, float* out) {
  float converted[kMaxHeadDim];
  for (int64_t r = 0; r < lanes; ++r) {
    const float* row = converted;  // float32 rows are read where they lie
    if (r >= tile.rows) {
      std::fill(converted, converted + dim, 0.0f);
    } else if constexpr (std::is_same_v<T, float>) {
      row = tensor + tile.TensorRow(r, p.seqlen_q, p.num_heads) * dim;
    } else {
      RowAsFloat(tensor + tile.TensorRow(r, p.seqlen_q, p.num_heads) * dim, dim, converted);
    }
    for (int64_t d = 0; d < dim; ++d) out[d * kTileQ + r] = factor * row[d];
  }
}

// What the logits of a score tile's lanes need besides the dot, for the variants that are not linear in it: the ALiBi
// slope of the row's head (a packed tile's rows have several) and the position ALiBi measures the keys from, the
// query's diagonal position or, with positions, its token position. Lanes past the rows get 0 and 0; their scores
// are never read.
struct RowLogitInputs {
  float slope[kTileQ];
  int64_t position[kTileQ];

  void Compute(const AttentionParams& p, const float* alibi_slopes, const RowMask& mask, const TokenMask& tokens,
               const QueryRows<kTileQ>& tile) {
    for (int64_t r = 0; r < kTileQ; ++r) {
      const bool row = r < tile.rows;
      slope[r] = row && p.has_alibi ? alibi_slopes[tile.batch * p.num_heads + tile.head[r]] : 0.0f;
      const int64_t i = row ? tile.position[r] : 0;
      position[r] = !row ? 0 : tokens.has_positions() ? tokens.q_pos[i] : i + mask.diag_offset;
    }
  }
};

// scores[key][row] = Logit(dot) in log2 units, for the variants that are not linear in the dot. ALiBi reads key c's
// position first_key + c, or its token position when the call has them.
template <typename Variant>
void ApplyLogits(Variant variant, const RowLogitInputs& rows, const float* dots, float* scores, int64_t keys,
                 int64_t lanes, int64_t first_key, const TokenMask& tokens) {
  for (int64_t c = 0; c < keys; ++c) {
    const int64_t key_position = tokens.has_positions() ? tokens.kv_pos[first_key + c] : first_key + c;
    for (int64_t r = 0; r < lanes; ++r) {
      variant.slope = rows.slope[r];
      scores[c * kTileQ + r] = kLog2e * variant.Logit(dots[c * kTileQ + r], rows.position[r], key_position);
    }
  }
}

bool AllFinite(const MatrixB& tile, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      if (!std::isfinite(tile.data[i * tile.row_stride + j])) return false;
    }
  }
  return true;
}

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

// What every Q tile of every batch can see, [B, Q tiles]: its index range of keys and the bounds of its rows' segment
// ids and positions. The forward's cost estimate and the backward's test of which Q tiles meet a KV tile.
struct QTileReach {
  KeyRange keys;
  RowTokenBounds tokens;
};

std::vector<QTileReach> QTileKeys(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens,
                                  const TokenOperands& token_operands) {
  const int64_t q_tiles = CeilDiv(p.seqlen_q, kTileQ);
  std::vector<QTileReach> reach(p.batch * q_tiles);
  TileKeyRanges<kTileQ> ranges;
  for (int64_t b = 0; b < p.batch; ++b) {
    const RowMask mask = BatchMask(p, q_seqlens, kv_seqlens, b);
    const TokenMask tokens = BatchTokens(p, token_operands, b);
    for (int64_t t = 0; t < q_tiles; ++t) {
      ranges.Compute(mask, tokens, t * kTileQ, std::min(kTileQ, p.seqlen_q - t * kTileQ));
      reach[b * q_tiles + t] = {ranges.any, ranges.token_rows};
    }
  }
  return reach;
}

// The segment id and position bounds of every KV tile (aligned to kTileKV) of every batch, [B, KV tiles]; empty
// without segment ids and positions.
std::vector<KeyTokenBounds> KVTileTokens(const AttentionParams& p, const TokenOperands& token_operands) {
  if (!p.has_segment_ids && !p.has_positions) return {};
  const int64_t kv_tiles = CeilDiv(p.seqlen_kv, kTileKV);
  std::vector<KeyTokenBounds> bounds(p.batch * kv_tiles);
  for (int64_t b = 0; b < p.batch; ++b) {
    const TokenMask tokens = BatchTokens(p, token_operands, b);
    for (int64_t t = 0; t < kv_tiles; ++t) {
      bounds[b * kv_tiles + t].Compute(tokens, t * kTileKV, std::min(kTileKV, p.seqlen_kv - t * kTileKV));
    }
  }
  return bounds;
}

bool Meets(const KeyRange& keys, int64_t begin, int64_t end) {
  return keys.begin < keys.end && keys.begin < end && begin < keys.end;
}

// Whether a Q tile may see KV tile `kv_tile` (aligned) of batch entry b: its index range meets the tile and, with
// segment ids or positions, their bounds do.
bool Meets(const AttentionParams& p, const QTileReach& q_tile, const KeyTokenBounds* kv_tile_tokens, int64_t b,
           int64_t kv_tile) {
  const int64_t begin = kv_tile * kTileKV, end = std::min(p.seqlen_kv, begin + kTileKV);
  if (!Meets(q_tile.keys, begin, end)) return false;
  if (kv_tile_tokens == nullptr) return true;
  const KeyTokenBounds& keys = kv_tile_tokens[b * CeilDiv(p.seqlen_kv, kTileKV) + kv_tile];
  return MayMeet(p.has_segment_ids, p.has_positions, q_tile.tokens, keys);
}

// A work item and its estimated cost: items run most expensive first, so the long causal rows do not end up alone on
// one thread at the end. `tile` is a Q tile (forward), a KV tile or, in the deterministic backward, a chunk of them.
struct WorkItem {
  int64_t batch, head, tile, cost;
};

void SortByCostDescending(std::vector<WorkItem>* items) {
  std::stable_sort(items->begin(), items->end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
}

// ---------------------------------------------------------------------------------------------------------------------
// The operands both directions read, typed.

template <typename T>
struct OperandArgs {
  const AttentionParams& params;
  const T* q;
  const T* k;
  const T* v;
  KvRows k_rows, v_rows;  // where k's and v's rows live (contiguous, or paged in the forward)
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  const float* alibi_slopes;
  TokenOperands tokens;
  const KeyTokenBounds* kv_tile_tokens;  // KVTileTokens; null without segment ids and positions
  BiasOperand bias;
  DropoutOperand dropout;
};

// `kv_tile_tokens` must outlive the result (it points into it).
template <typename T>
OperandArgs<T> OperandArgsOf(const AttentionParams& params, const AttentionOperands& o,
                             const std::vector<KeyTokenBounds>& kv_tile_tokens) {
  return {params,
          static_cast<const T*>(o.q),
          static_cast<const T*>(o.k),
          static_cast<const T*>(o.v),
          MakeKvRows(params, o.page_table, params.head_dim),
          MakeKvRows(params, o.page_table, params.head_dim_v),
          QuerySeqlensRead(params, o.q_seqlens),
          o.kv_seqlens,
          o.alibi_slopes,
          TokenOperandsOf(o),
          kv_tile_tokens.empty() ? nullptr : kv_tile_tokens.data(),
          MakeBiasOperand(params, o.bias),
          MakeDropoutOperand(params, o.dropout)};
}

// ---------------------------------------------------------------------------------------------------------------------
// Forward

template <typename T>
struct ForwardArgs : OperandArgs<T> {
  T* out;
  float* lse;
  const float* sinks;  // [B, H], merged into each finished row (cpp/sink.h); null without sinks
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
template <typename T, typename Variant>
void ForwardTile(const ForwardArgs<T>& args, ForwardScratch& s, const QueryRows<kTileQ>& tile) {
  const AttentionParams& p = args.params;
  const int64_t b = tile.batch, kv_head = tile.kv_head, rows = tile.rows;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  const int64_t lanes = RoundUpToLanes(rows);
  // The bias and dropout address the rows as (h, first_row + r): only unpacked tiles have them (PacksHeads).
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
  const bool k_in_place = ReadInPlace(args.k_rows.row_stride * sizeof(T), TileGemmReadsOfA(lanes));
  const bool v_in_place = ReadInPlace(args.v_rows.row_stride * sizeof(T), TileGemmReadsOfB(rows));
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
    const int64_t next_keys = std::min(kTileKV, s.ranges.any.end - (tile0 + kTileKV));
    if (next_keys > 0) {
      PrefetchKeyRows(args.k, args.k_rows, b, kv_head, tile0 + kTileKV, next_keys);
      PrefetchKeyRows(args.v, args.v_rows, b, kv_head, tile0 + kTileKV, next_keys);
    }
    for (const KeyRun& k_run :
         KeyRowsAsFloat<kTileKV>(args.k, args.k_rows, b, kv_head, key0, keys, k_in_place, s.k.data())) {
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
    const auto v_runs = KeyRowsAsFloat<kTileKV>(args.v, args.v_rows, b, kv_head, key0, keys, v_in_place, s.v.data());
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
    // as a mask) counts as a row that sees no key: its sum is 0, which a NaN logit would have made NaN.
    const float sum = s.softmax.sum[r];
    const bool sees_keys = s.ranges.RowSeesKeys(r) && !(args.bias.active() && sum == 0.0f);
    float out_scale = sees_keys ? 1.0f / sum : 0.0f;
    float lse = sees_keys ? s.softmax.max[r] * kLn2 + std::log(sum) : -INFINITY;
    if (args.sinks != nullptr) MergeSink(args.sinks[b * p.num_heads + tile.head[r]], lse, out_scale);
    T* out_row = args.out + tile.TensorRow(r, p.seqlen_q, p.num_heads) * dv;
    for (int64_t j = 0; j < dv; ++j) out_row[j] = FromFloat<T>(sees_keys ? s.out[r * dv + j] * out_scale : 0.0f);
    args.lse[tile.LseIndex(r, p.seqlen_q, p.num_heads)] = lse;
  }
}

// Decode shapes (issue 17): when a head's queries leave lanes of its Q tile empty (Sq < kTileQ), the forward packs
// the query heads of a K/V group times the positions into the rows of shared tiles, like the CUDA decode kernels: the
// empty lanes cost as much as full ones, and each head of the group would read (convert, gather from pages) the same
// K/V tiles again. Measured on 2 cores (h 32 / kv 8, D 128, 4096 keys, bottom-right causal; fp32 and bf16 alike):
// 3.4x at Sq = 1, 2.5x at 4, 1.1-1.4x at 16, 1.25x at 32, 1.02-1.05x at 63; MQA (kv 1) 5.5-7x at Sq = 1. From Sq =
// kTileQ on a head fills its tiles and packing would save nothing. Only for calls without segment ids, positions,
// bias or dropout, whose operands address the rows of one head (and which decoding does not use); and only with more
// than one head per group, as one head's rows already share their K/V tiles.
bool PacksHeads(const AttentionParams& p) {
  return p.num_heads > p.num_kv_heads && p.seqlen_q < kTileQ && !p.has_segment_ids && !p.has_positions &&
         !p.has_bias && p.dropout_threshold == 0;
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
template <typename T>
std::vector<int64_t> ForwardTileCosts(const AttentionParams& p, const ForwardArgs<T>& args,
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

template <typename T, typename Variant>
void Forward(const AttentionParams& p, const ForwardArgs<T>& args, TaskScheduler* scheduler) {
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
    ForwardTile<T, Variant>(args, scratch[worker], tiling.Rows(p, item.batch, item.head, item.tile));
  });
}

// ---------------------------------------------------------------------------------------------------------------------
// Backward

template <typename T>
struct BackwardArgs : OperandArgs<T> {  // k_rows, v_rows contiguous: the backward refuses paging
  const T* out;
  const float* lse;
  const T* dout;
  const float* dlse;
  T* dq;
  T* dk;
  T* dv;
  void* dbias;  // bias's dtype
};

struct BackwardScratch {
  explicit BackwardScratch(const AttentionParams& p)
      : q(kTileQ * p.head_dim), q_t(p.head_dim * kTileQ), dout(kTileQ * p.head_dim_v), dout_t(p.head_dim_v * kTileQ),
        dots(kTileKV * kTileQ), probs(kTileKV * kTileQ), dscores(kTileKV * kTileQ), k(kTileKV * p.head_dim),
        v(kTileKV * p.head_dim_v), dk(kTileKV * p.head_dim), dv(kTileKV * p.head_dim_v) {}
  std::vector<float> q, q_t, dout, dout_t;  // the Q tile row-major (a float32 copy, key_rows.h) and transposed
  std::vector<float> dots, probs, dscores;  // key-major [kTileKV, kTileQ]
  std::vector<float> k, v;                  // float32 copies of the K/V tile (key_rows.h)
  std::vector<float> dk, dv;                // this KV tile's gradients
  alignas(32) float lse2[kTileQ];           // lse in log2 units; +inf in the lanes past the tile so P = 0 there
  alignas(32) float delta[kTileQ];          // the tile rows' RowDeltas; 0 in the lanes past them
  TileKeyRanges<kTileQ> ranges;
  RowLogitInputs logits;
};

// delta: the call's RowDeltas, [B, H, Sq]; dq_part: the float32 [B, Sq, H, D] partial dQ this tile's contribution is
// added to; dbias_copy: the float32 copy of dbias it adds dS to (bias_tile.h; null without a bias).
template <typename T, typename Variant>
void BackwardQTile(const BackwardArgs<T>& args, BackwardScratch& s, const RowMask& mask, const TokenMask& tokens,
                   const KeyTokenBounds& key_tokens, const MatrixB& k_tile, const MatrixB& v_tile, const float* delta,
                   int64_t b, int64_t h, int64_t first_row, int64_t key0, int64_t keys, float* dq_part,
                   float* dbias_copy) {
  const AttentionParams& p = args.params;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  const int64_t rows = std::min(kTileQ, p.seqlen_q - first_row);
  const int64_t lanes = RoundUpToLanes(rows);
  const HeadRows<const T> q = Head(args.q, p.seqlen_q, p.num_heads, d, b, h);
  const HeadRows<const T> dout = Head(args.dout, p.seqlen_q, p.num_heads, dv, b, h);
  const float* lse = args.lse + (b * p.num_heads + h) * p.seqlen_q + first_row;
  const float* row_delta = delta + (b * p.num_heads + h) * p.seqlen_q + first_row;
  const Variant variant = MakeVariant<Variant>(p, args.alibi_slopes, b, h);

  const QueryRows<kTileQ> tile = QueryRows<kTileQ>::OneHead(b, h, h / (p.num_heads / p.num_kv_heads), first_row, rows);
  s.ranges.Compute(mask, tokens, first_row, rows);
  if constexpr (!kIsLinear<Variant>) s.logits.Compute(p, args.alibi_slopes, mask, tokens, tile);
  // The B operands of the dV and dK products, read once per block of keys (key_rows.h).
  const int64_t reads = TileGemmReadsOfB(keys);
  const MatrixB q_rows = RowsAsFloat(q.Row(first_row), q.stride, rows, d, reads, s.q.data());
  const MatrixB dout_rows = RowsAsFloat(dout.Row(first_row), dout.stride, rows, dv, reads, s.dout.data());
  PackTransposed(args.q, tile, p, d, lanes, kIsLinear<Variant> ? p.scale * kLog2e : 1.0f, s.q_t.data());
  PackTransposed(args.dout, tile, p, dv, lanes, 1.0f, s.dout_t.data());
  for (int64_t r = 0; r < kTileQ; ++r) {
    s.lse2[r] = INFINITY;
    s.delta[r] = 0.0f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    // A row that saw no key (lse = -inf) has every score masked to -inf: lse2 = +inf makes its P 0 rather than NaN.
    s.lse2[r] = lse[r] == -INFINITY ? INFINITY : lse[r] * kLog2e;
    s.delta[r] = row_delta[r];
  }

  // P^T = exp2(S^T - lse), zero where masked.
  float* dots = s.dots.data();
  float* probs = s.probs.data();
  float* dscores = s.dscores.data();
  TileGemm(keys, lanes, d, {k_tile.data, k_tile.row_stride, 1}, {s.q_t.data(), kTileQ}, {dots, kTileQ},
           Accumulate::kNo);
  float* scores = dots;
  if constexpr (!kIsLinear<Variant>) {
    ApplyLogits(variant, s.logits, dots, probs, keys, lanes, key0, tokens);
    scores = probs;
  }
  if (args.bias.active()) AddBias(args.bias, b, h, first_row, rows, key0, keys, kLog2e, kTileQ, scores);
  if (!s.ranges.AllSee(key0, key0 + keys, key_tokens)) s.ranges.MaskScores(scores, kTileQ, key0, keys, lanes);
  RecomputeProbabilities(scores, s.lse2, kTileQ, keys, lanes, probs);

  // dS^T = P^T * (dP^T - delta) * dLogit/dDot, with dP^T = V dO^T.
  TileGemm(keys, lanes, dv, {v_tile.data, v_tile.row_stride, 1}, {s.dout_t.data(), kTileQ}, {dscores, kTileQ},
           Accumulate::kNo);
  // With a bias, dS is first taken in logit units for dbias, then scaled to the dot's.
  const bool linear_scale_later = kIsLinear<Variant> && args.bias.active();
  if (args.dropout.active()) ApplyDropout(args.dropout, b, h, first_row, rows, key0, keys, kTileQ, dscores);
  SoftmaxGradient(probs, s.delta, kIsLinear<Variant> && !linear_scale_later ? p.scale : 1.0f, kTileQ, keys, lanes,
                  dscores);
  if (args.bias.active()) {
    AddBiasGradient(args.bias.layout, b, h, first_row, rows, key0, keys, dscores, kTileQ, dbias_copy);
  }
  if (linear_scale_later) {
    for (int64_t c = 0; c < keys; ++c) {
      for (int64_t r = 0; r < lanes; ++r) dscores[c * kTileQ + r] *= p.scale;
    }
  }
  if constexpr (!kIsLinear<Variant>) {
    for (int64_t c = 0; c < keys; ++c) {
      for (int64_t r = 0; r < lanes; ++r) dscores[c * kTileQ + r] *= variant.DLogitDDot(dots[c * kTileQ + r]);
    }
  }

  // dV takes the probabilities P.V took: dropped and scaled.
  if (args.dropout.active()) ApplyDropout(args.dropout, b, h, first_row, rows, key0, keys, kTileQ, probs);
  TileGemm(keys, dv, rows, {probs, kTileQ, 1}, dout_rows, {s.dv.data(), dv}, Accumulate::kYes);
  TileGemm(keys, d, rows, {dscores, kTileQ, 1}, q_rows, {s.dk.data(), d}, Accumulate::kYes);
  float* dq = dq_part + ((b * p.seqlen_q + first_row) * p.num_heads + h) * d;
  TileGemm(rows, d, keys, {dscores, 1, kTileQ}, k_tile, {dq, p.num_heads * d}, Accumulate::kYes);
}

// Writes the KV tile's dK and dV and adds its dQ contributions to dq_part, heads and Q tiles in ascending order.
template <typename T, typename Variant>
void BackwardKVTile(const BackwardArgs<T>& args, BackwardScratch& s, const std::vector<QTileReach>& q_tile_reach,
                    const float* delta, const WorkItem& item, float* dq_part, float* dbias_copy) {
  const AttentionParams& p = args.params;
  const int64_t b = item.batch, kv_head = item.head;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  const int64_t key0 = item.tile * kTileKV;
  const int64_t keys = std::min(kTileKV, p.seqlen_kv - key0);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t q_tiles = CeilDiv(p.seqlen_q, kTileQ);
  const RowMask mask = BatchMask(p, args.q_seqlens, args.kv_seqlens, b);
  const TokenMask tokens = BatchTokens(p, args.tokens, b);
  const KeyTokenBounds key_tokens =
      args.kv_tile_tokens != nullptr ? args.kv_tile_tokens[b * CeilDiv(p.seqlen_kv, kTileKV) + item.tile]
                                     : KeyTokenBounds{};

  std::fill(s.dk.begin(), s.dk.begin() + keys * d, 0.0f);
  std::fill(s.dv.begin(), s.dv.begin() + keys * dv, 0.0f);
  // K and V each feed two products per Q tile of each head of the group (key_rows.h).
  const int64_t kv_reads = 2 * group * q_tiles;
  const KvRows &k_rows = args.k_rows, &v_rows = args.v_rows;
  const MatrixB k_tile =
      RowsAsFloat(args.k + k_rows.Offset(b, key0, kv_head), k_rows.row_stride, keys, d, kv_reads, s.k.data());
  const MatrixB v_tile =
      RowsAsFloat(args.v + v_rows.Offset(b, key0, kv_head), v_rows.row_stride, keys, dv, kv_reads, s.v.data());
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    for (int64_t t = 0; t < q_tiles; ++t) {
      if (!Meets(p, q_tile_reach[b * q_tiles + t], args.kv_tile_tokens, b, item.tile)) continue;
      BackwardQTile<T, Variant>(args, s, mask, tokens, key_tokens, k_tile, v_tile, delta, b, h, t * kTileQ, key0,
                                keys, dq_part, dbias_copy);
    }
  }

  const HeadRows<T> dk_out = Head(args.dk, p.seqlen_kv, p.num_kv_heads, d, b, kv_head);
  const HeadRows<T> dv_out = Head(args.dv, p.seqlen_kv, p.num_kv_heads, dv, b, kv_head);
  for (int64_t c = 0; c < keys; ++c) {
    for (int64_t j = 0; j < d; ++j) dk_out.Row(key0 + c)[j] = FromFloat<T>(s.dk[c * d + j]);
    for (int64_t j = 0; j < dv; ++j) dv_out.Row(key0 + c)[j] = FromFloat<T>(s.dv[c * dv + j]);
  }
}

// How many Q tiles of one head meet each KV tile, [B, KV tiles]: a KV tile's cost per head of its group.
std::vector<int64_t> KVTileCosts(const AttentionParams& p, const std::vector<QTileReach>& q_tile_reach,
                                 const KeyTokenBounds* kv_tile_tokens) {
  const int64_t q_tiles = CeilDiv(p.seqlen_q, kTileQ);
  const int64_t kv_tiles = CeilDiv(p.seqlen_kv, kTileKV);
  std::vector<int64_t> costs(p.batch * kv_tiles, 0);
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int64_t t = 0; t < kv_tiles; ++t) {
      for (int64_t qt = 0; qt < q_tiles; ++qt) {
        costs[b * kv_tiles + t] += Meets(p, q_tile_reach[b * q_tiles + qt], kv_tile_tokens, b, t);
      }
    }
  }
  return costs;
}

// The number of chunks of the deterministic backward: a function of the shapes only, never of the thread count, so
// every pool (XLA's on the FFI path, te_jax's on the legacy path, of any size) adds dQ up in the same order.
int64_t DeterministicChunks(const AttentionParams& p, int64_t kv_tiles) {
  const int64_t wanted = CeilDiv(kDeterministicItems, std::max<int64_t>(1, p.batch * p.num_kv_heads));
  return std::max<int64_t>(1, std::min({wanted, kMaxDqChunks, kv_tiles}));
}

// The runs of KV tiles the backward's items walk are given as each run's first tile and then the end, [B, runs + 1].
// By default every KV tile is a run of its own.
std::vector<int64_t> SingleTileRuns(int64_t batch, int64_t kv_tiles) {
  std::vector<int64_t> starts(batch * (kv_tiles + 1));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t <= kv_tiles; ++t) starts[b * (kv_tiles + 1) + t] = t;
  }
  return starts;
}

// With deterministic, each batch's KV tiles are cut into `chunks` contiguous runs of about equal cost (under a causal
// mask the first tiles cost the most, so equal tile counts would leave one long chunk). A tile joins the chunk its
// cost's midpoint falls in, or goes by position when no tile costs anything. A run may be empty.
std::vector<int64_t> BalancedRuns(const std::vector<int64_t>& tile_costs, int64_t batch, int64_t kv_tiles,
                                  int64_t chunks) {
  std::vector<int64_t> starts(batch * (chunks + 1));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t* cost = tile_costs.data() + b * kv_tiles;
    int64_t* start = starts.data() + b * (chunks + 1);
    const int64_t total = std::accumulate(cost, cost + kv_tiles, int64_t{0});
    int64_t chunk = 0, before = 0;
    start[0] = 0;
    for (int64_t t = 0; t < kv_tiles; ++t) {
      const int64_t tile_chunk =
          total > 0 ? std::min(chunks - 1, chunks * (2 * before + cost[t]) / (2 * total)) : t * chunks / kv_tiles;
      while (chunk < tile_chunk) start[++chunk] = t;
      before += cost[t];
    }
    while (chunk < chunks) start[++chunk] = kv_tiles;
  }
  return starts;
}

// delta_i = sum_j dO_ij O_ij - dlse_i for the query rows of head h of batch b, [Sq]: what each row of dS = P * (dP -
// delta) subtracts (d lse_i / d s_ij = P_ij, so dlse enters with the opposite sign). Every KV tile's dS needs it: it
// is computed once per row, before the KV tiles.
template <typename T>
void RowDeltas(const BackwardArgs<T>& args, int64_t b, int64_t h, float* delta) {
  const AttentionParams& p = args.params;
  const HeadRows<const T> out = Head(args.out, p.seqlen_q, p.num_heads, p.head_dim_v, b, h);
  const HeadRows<const T> dout = Head(args.dout, p.seqlen_q, p.num_heads, p.head_dim_v, b, h);
  const float* dlse = args.dlse + (b * p.num_heads + h) * p.seqlen_q;
  for (int64_t i = 0; i < p.seqlen_q; ++i) {
    float sum = 0.0f;
    for (int64_t j = 0; j < p.head_dim_v; ++j) sum += ToFloat(out.Row(i)[j]) * ToFloat(dout.Row(i)[j]);
    delta[i] = sum - dlse[i];
  }
}

template <typename T, typename Variant>
void Backward(const AttentionParams& p, const BackwardArgs<T>& args, TaskScheduler* scheduler) {
  const int64_t kv_tiles = CeilDiv(p.seqlen_kv, kTileKV);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const std::vector<QTileReach> q_tile_reach = QTileKeys(p, args.q_seqlens, args.kv_seqlens, args.tokens);
  const std::vector<int64_t> tile_costs = KVTileCosts(p, q_tile_reach, args.kv_tile_tokens);
  const int64_t runs = p.deterministic ? DeterministicChunks(p, kv_tiles) : kv_tiles;
  const std::vector<int64_t> run_starts =
      p.deterministic ? BalancedRuns(tile_costs, p.batch, kv_tiles, runs) : SingleTileRuns(p.batch, kv_tiles);

  // One item per (batch, KV head, run); item.tile is the run.
  std::vector<WorkItem> items;
  items.reserve(p.batch * p.num_kv_heads * runs);
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t* start = run_starts.data() + b * (runs + 1);
    const int64_t* cost = tile_costs.data() + b * kv_tiles;
    for (int64_t r = 0; r < runs; ++r) {
      if (start[r] == start[r + 1]) continue;
      const int64_t run_cost = std::accumulate(cost + start[r], cost + start[r + 1], int64_t{0}) * group;
      for (int64_t h = 0; h < p.num_kv_heads; ++h) items.push_back({b, h, r, run_cost});
    }
  }
  SortByCostDescending(&items);
  std::vector<float> delta(p.batch * p.num_heads * p.seqlen_q);
  ParallelFor(scheduler, p.batch * p.num_heads, [&](int64_t bh) {
    RowDeltas(args, bh / p.num_heads, bh % p.num_heads, delta.data() + bh * p.seqlen_q);
  });
  const int64_t workers = NumWorkers(scheduler, static_cast<int64_t>(items.size()));
  std::vector<BackwardScratch> scratch(workers, BackwardScratch(p));

  // The float32 partial dQs, [B, Sq, H, D] each. Default: one per worker, allocated on its first item, so the memory
  // grows with the thread count and which KV tiles share a buffer depends on the scheduling. Deterministic: one per
  // chunk, at most kMaxDqChunks whatever the thread count, each added to only by its chunk's items, which cover
  // disjoint (batch, KV head) slices of it and walk their KV tiles in ascending order: every element of dQ gets the
  // same additions in the same order on every run.
  const int64_t dq_size = p.batch * p.seqlen_q * p.num_heads * p.head_dim;
  std::vector<std::vector<float>> dq_parts(p.deterministic ? runs : workers);
  if (p.deterministic) {  // zeroed in parallel, like the default's: first touching fresh pages is slow
    ParallelFor(scheduler, runs, [&](int64_t chunk) { dq_parts[chunk].assign(dq_size, 0.0f); });
  }
  const int64_t bias_elements = MakeBiasLayout(p).elements();
  std::vector<float> dbias_copies(args.bias.active() ? BiasGradientCopies(p, runs) * bias_elements : 0, 0.0f);
  ParallelForWorkers(scheduler, static_cast<int64_t>(items.size()), workers, [&](int64_t worker, int64_t i) {
    const WorkItem& item = items[i];
    std::vector<float>& dq_part = dq_parts[p.deterministic ? item.tile : worker];
    if (!p.deterministic && dq_part.empty()) dq_part.assign(dq_size, 0.0f);
    float* dbias_copy = args.bias.active() ? dbias_copies.data() + BiasGradientCopy(p, runs, item.batch, item.head,
                                                                                    item.tile) * bias_elements
                                           : nullptr;
    const int64_t* start = run_starts.data() + item.batch * (runs + 1);
    for (int64_t t = start[item.tile]; t < start[item.tile + 1]; ++t) {
      BackwardKVTile<T, Variant>(args, scratch[worker], q_tile_reach, delta.data(),
                                 {item.batch, item.head, t, item.cost}, dq_part.data(), dbias_copy);
    }
  });
  // Without a bias this writes the placeholder dbias's one zero.
  SumBiasGradientCopies(scheduler, dbias_copies, bias_elements, p.bias_dtype, args.dbias);

  // dQ = the partial dQs summed in index order; every element is written, zero where no key contributed.
  constexpr int64_t kSumBlock = 16384;
  ParallelFor(scheduler, CeilDiv(dq_size, kSumBlock), [&](int64_t block) {
    const int64_t begin = block * kSumBlock, end = std::min(dq_size, begin + kSumBlock);
    for (int64_t e = begin; e < end; ++e) {
      float sum = 0.0f;
      for (const std::vector<float>& part : dq_parts) sum += part.empty() ? 0.0f : part[e];
      args.dq[e] = FromFloat<T>(sum);
    }
  });
}

}  // namespace

Status AttentionForward(const AttentionParams& params, const ForwardBuffers& buffers, TaskScheduler* scheduler) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(params, Backend::kCpu));
  TE_JAX_RETURN_IF_ERROR(ValidateSeqlens(params, buffers.q_seqlens, buffers.kv_seqlens));
  TE_JAX_RETURN_IF_ERROR(ValidatePageTable(params, buffers.page_table, buffers.kv_seqlens));
  const std::vector<KeyTokenBounds> kv_tile_tokens = KVTileTokens(params, TokenOperandsOf(buffers));
  DispatchDType(params.dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const ForwardArgs<T> args{OperandArgsOf<T>(params, buffers, kv_tile_tokens), static_cast<T*>(buffers.out),
                              buffers.lse, params.has_sinks ? buffers.sinks : nullptr};
    DispatchVariant(params.softcap > 0.0f, params.has_alibi, [&](auto variant_tag) {
      Forward<T, decltype(variant_tag)>(params, args, scheduler);
    });
  });
  return Status::Ok();
}

Status AttentionBackward(const AttentionParams& params, const BackwardBuffers& buffers, TaskScheduler* scheduler) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(params, Backend::kCpu));
  TE_JAX_RETURN_IF_ERROR(ValidateBackwardParams(params, Backend::kCpu));
  TE_JAX_RETURN_IF_ERROR(ValidateSeqlens(params, buffers.q_seqlens, buffers.kv_seqlens));
  const std::vector<KeyTokenBounds> kv_tile_tokens = KVTileTokens(params, TokenOperandsOf(buffers));
  DispatchDType(params.dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const BackwardArgs<T> args{OperandArgsOf<T>(params, buffers, kv_tile_tokens),
                               static_cast<const T*>(buffers.out),
                               buffers.lse,
                               static_cast<const T*>(buffers.dout),
                               buffers.dlse,
                               static_cast<T*>(buffers.dq),
                               static_cast<T*>(buffers.dk),
                               static_cast<T*>(buffers.dv),
                               buffers.dbias};
    DispatchVariant(params.softcap > 0.0f, params.has_alibi, [&](auto variant_tag) {
      Backward<T, decltype(variant_tag)>(params, args, scheduler);
    });
  });
  return Status::Ok();
}

}  // namespace te_jax::cpu
