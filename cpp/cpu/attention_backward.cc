// The CPU backward: a KV tile's work owns that tile's dK and dV and walks the Q tiles of its head group that see it;
// dQ, which every KV tile adds to, goes to float32 partial buffers summed once at the end, so no write is shared and
// the five products are computed once each. Which KV tiles share a partial buffer fixes the order of dQ's additions:
// by default one work item per (batch, KV head, KV tile) and one buffer per worker, so the order follows the thread
// scheduling; with params.deterministic one item per (batch, KV head, chunk of KV tiles) and one buffer per chunk, so
// the order is a function of the problem alone (see Backward).
//
// K and V rows are read through KvRows (cpp/core/kv_rows.h): contiguous [B, Skv, Hkv, D] or, in the forward, the pool of
// a paged KV cache read in place through the page table; as float32 rows where they lie or from a compact copy, as
// suits the tile's products (key_rows.h). Score tiles are key-major (scores[key][row]) so query rows are vector lanes
// (see online_softmax.h), in log2 units (tile_logits.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "cpp/core/validate.h"
#include "cpp/core/variants.h"
#include "cpp/cpu/all_finite.h"
#include "cpp/cpu/attention_cpu.h"
#include "cpp/cpu/batch_masks.h"
#include "cpp/cpu/bias_tile.h"
#include "cpp/cpu/capture_gradients.h"
#include "cpp/cpu/dropout_tile.h"
#include "cpp/cpu/element_types.h"
#include "cpp/cpu/key_rows.h"
#include "cpp/cpu/operand_args.h"
#include "cpp/cpu/pack_transposed.h"
#include "cpp/cpu/query_rows.h"
#include "cpp/cpu/simd_f32x8.h"
#include "cpp/cpu/softmax_backward.h"
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

// The deterministic backward cuts each (batch, KV head)'s KV tiles into chunks, each with its own float32 copy of dQ:
// enough chunks for kDeterministicItems (batch, KV head, chunk) items, to keep a many-core machine busy, but at most
// kMaxDqChunks copies of dQ (the default backward holds one per thread).
constexpr int64_t kDeterministicItems = 64;
constexpr int64_t kMaxDqChunks = 8;

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
  void* const* capture_grads;  // the score_mod's floating-point captures' float32 gradients (flex_mods.h)
};

struct BackwardScratch {
  explicit BackwardScratch(const AttentionParams& p)
      : q(kTileQ * p.head_dim), q_t(p.head_dim * kTileQ), dout(kTileQ * p.head_dim_v), dout_t(p.head_dim_v * kTileQ),
        dots(kTileKV * kTileQ), probs(kTileKV * kTileQ), dscores(kTileKV * kTileQ), k(kTileKV * p.head_dim),
        v(kTileKV * p.head_dim_v), dk(kTileKV * p.head_dim), dv(kTileKV * p.head_dim_v),
        unmodded(p.flex.has_score_mod() ? kTileKV * kTileQ : 0), visible(kTileKV * kTileQ) {}
  std::vector<float> q, q_t, dout, dout_t;  // the Q tile row-major (a float32 copy, key_rows.h) and transposed
  std::vector<float> dots, probs, dscores;  // key-major [kTileKV, kTileQ]
  std::vector<float> k, v;                  // float32 copies of the K/V tile (key_rows.h)
  std::vector<float> dk, dv;                // this KV tile's gradients
  std::vector<float> unmodded;              // with a score_mod, the logits it was given, key-major (for DScore)
  std::vector<uint8_t> visible;             // the careful path's pairs a row sees, key-major (CarefulProducts)
  alignas(32) float lse2[kTileQ];           // lse in log2 units; +inf in the lanes past the tile so P = 0 there
  alignas(32) float delta[kTileQ];          // the tile rows' RowDeltas; 0 in the lanes past them
  TileKeyRanges<kTileQ> ranges;
  RowLogitInputs logits;
};

// Whether a tile pair with pairs a row does not see must take the careful path: some operand of its products (K or V,
// kv_finite says; the rows' Q and dO, their lse and delta) is NaN or inf, which the dense products would carry into
// the rows and keys that do not see it as 0 x NaN.
inline bool NeedsCarefulProducts(bool kv_finite, const MatrixB& q_rows, const MatrixB& dout_rows, const float* lse2,
                                 const float* delta, int64_t rows, int64_t d, int64_t dv) {
  for (int64_t r = 0; r < rows; ++r) {
    if (std::isnan(lse2[r]) || !std::isfinite(delta[r])) return true;  // lse2 = +inf: a row that sees no key
  }
  return !(kv_finite && AllFinite(q_rows, rows, d) && AllFinite(dout_rows, rows, dv));
}

// The careful path's dV += P^T dO, dK += dS^T Q and dQ += dS K over the pairs a row sees only (plain loops: only tiles
// with a non-finite operand and masked pairs take it).
inline void CarefulProducts(const uint8_t* visible, const float* probs, const float* dscores, int64_t row_stride,
                            const MatrixB& k_tile, const MatrixB& q_rows, const MatrixB& dout_rows, int64_t keys,
                            int64_t rows, int64_t d, int64_t dv, float* dk, float* dv_out, float* dq,
                            int64_t dq_stride) {
  for (int64_t c = 0; c < keys; ++c) {
    for (int64_t r = 0; r < rows; ++r) {
      if (!visible[c * row_stride + r]) continue;
      const float p = probs[c * row_stride + r], ds = dscores[c * row_stride + r];
      const float* q = q_rows.data + r * q_rows.row_stride;
      const float* dout = dout_rows.data + r * dout_rows.row_stride;
      const float* k = k_tile.data + c * k_tile.row_stride;
      for (int64_t j = 0; j < dv; ++j) dv_out[c * dv + j] += p * dout[j];
      for (int64_t j = 0; j < d; ++j) {
        dk[c * d + j] += ds * q[j];
        dq[r * dq_stride + j] += ds * k[j];
      }
    }
  }
}

// delta: the call's RowDeltas, [B, H, Sq]; dq_part: the float32 [B, Sq, H, D] partial dQ this tile's contribution is
// added to; dbias_copy: the float32 copy of dbias it adds dS to (bias_tile.h; null without a bias); capture_grads: the
// float32 partial gradients of the score_mod's captures it adds to (indexed by capture, null for those without one;
// null without capture gradients).
template <typename T, typename Variant>
void BackwardQTile(const BackwardArgs<T>& args, BackwardScratch& s, const RowMask& mask, const TokenMask& tokens,
                   const KeyTokenBounds& key_tokens, const MatrixB& k_tile, const MatrixB& v_tile, bool kv_finite,
                   const float* delta, int64_t b, int64_t h, int64_t first_row, int64_t key0, int64_t keys,
                   float* dq_part, float* dbias_copy, float* const* capture_grads) {
  const AttentionParams& p = args.params;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  const int64_t rows = std::min(kTileQ, p.seqlen_q - first_row);
  const int8_t block_state = args.flex.TileState(b, h, first_row, rows, key0, keys);
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
  // A block mask: a pair of tiles whose blocks hide every pair adds nothing (P = 0) and is skipped, unless an operand
  // is non-finite, whose NaN would enter as 0 x NaN (as without the block mask); one whose blocks keep every pair takes
  // no mask_mod.
  if (block_state == kBlockHidden &&
      !NeedsCarefulProducts(kv_finite, q_rows, dout_rows, s.lse2, s.delta, rows, d, dv)) {
    return;
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
  if (args.flex.has_score()) std::copy(scores, scores + keys * kTileQ, s.unmodded.data());
  if (args.flex.active()) {
    args.flex.Apply(kLog2e, scores, kTileQ, b, h, first_row, rows, key0, keys, block_state == kBlockVisible);
  }
  const bool all_see = s.ranges.AllSee(key0, key0 + keys, key_tokens);
  if (!all_see) s.ranges.MaskScores(scores, kTileQ, key0, keys, lanes);
  // Masked pairs (and -inf logits) must add nothing even where an operand is non-finite: which pairs a row sees, kept
  // before the probabilities replace the scores.
  const bool careful =
      !all_see && NeedsCarefulProducts(kv_finite, q_rows, dout_rows, s.lse2, s.delta, rows, d, dv);
  uint8_t* visible = s.visible.data();
  if (careful) {
    for (int64_t c = 0; c < keys; ++c) {
      for (int64_t r = 0; r < kTileQ; ++r) visible[c * kTileQ + r] = r < rows && scores[c * kTileQ + r] != -INFINITY;
    }
  }
  RecomputeProbabilities(scores, s.lse2, kTileQ, keys, lanes, probs);

  // dS^T = P^T * (dP^T - delta) * dLogit/dDot, with dP^T = V dO^T.
  TileGemm(keys, lanes, dv, {v_tile.data, v_tile.row_stride, 1}, {s.dout_t.data(), kTileQ}, {dscores, kTileQ},
           Accumulate::kNo);
  // With a bias or a score_mod, dS is first taken in logit units (through the score_mod's DScore, for dbias), then
  // scaled to the dot's.
  const bool linear_scale_later = kIsLinear<Variant> && (args.bias.active() || args.flex.has_score());
  if (args.dropout.active()) ApplyDropout(args.dropout, b, h, first_row, rows, key0, keys, kTileQ, dscores);
  SoftmaxGradient(probs, s.delta, kIsLinear<Variant> && !linear_scale_later ? p.scale : 1.0f, kTileQ, keys, lanes,
                  dscores);
  // A pair a row does not see has dS = 0 (its P is 0) whatever dP and delta hold: the captures and dbias get 0 there,
  // and the careful products skip it.
  if (careful) {
    for (int64_t i = 0; i < keys * kTileQ; ++i) dscores[i] = visible[i] ? dscores[i] : 0.0f;
  }
  if (args.flex.has_score()) {
    // dS in the modified logits to the captures, then through the score_mod to the logits it was given.
    if (capture_grads != nullptr) {
      args.flex.DCaptures(kLog2e, s.unmodded.data(), dscores, capture_grads, kTileQ, b, h, first_row, rows, key0,
                          keys);
    }
    args.flex.DScore(kLog2e, s.unmodded.data(), dscores, kTileQ, b, h, first_row, rows, key0, keys);
  }
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
  float* dq = dq_part + ((b * p.seqlen_q + first_row) * p.num_heads + h) * d;
  if (careful) {
    CarefulProducts(visible, probs, dscores, kTileQ, k_tile, q_rows, dout_rows, keys, rows, d, dv, s.dk.data(),
                    s.dv.data(), dq, p.num_heads * d);
    return;
  }
  TileGemm(keys, dv, rows, {probs, kTileQ, 1}, dout_rows, {s.dv.data(), dv}, Accumulate::kYes);
  TileGemm(keys, d, rows, {dscores, kTileQ, 1}, q_rows, {s.dk.data(), d}, Accumulate::kYes);
  TileGemm(rows, d, keys, {dscores, 1, kTileQ}, k_tile, {dq, p.num_heads * d}, Accumulate::kYes);
}

// Writes the KV tile's dK and dV and adds its dQ contributions to dq_part, heads and Q tiles in ascending order.
template <typename T, typename Variant>
void BackwardKVTile(const BackwardArgs<T>& args, BackwardScratch& s, const std::vector<QTileReach>& q_tile_reach,
                    const float* delta, const WorkItem& item, float* dq_part, float* dbias_copy,
                    float* const* capture_grads) {
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
  const bool kv_finite = AllFinite(k_tile, keys, d) && AllFinite(v_tile, keys, dv);
  for (int64_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    for (int64_t t = 0; t < q_tiles; ++t) {
      if (!Meets(p, q_tile_reach[b * q_tiles + t], args.kv_tile_tokens, b, item.tile)) continue;
      BackwardQTile<T, Variant>(args, s, mask, tokens, key_tokens, k_tile, v_tile, kv_finite, delta, b, h,
                                t * kTileQ, key0, keys, dq_part, dbias_copy, capture_grads);
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
  // The captures' gradients: a part per worker, or with deterministic per item (the items of a run add to the same
  // elements).
  CaptureGradients capture_grads(p.flex, p.deterministic ? static_cast<int64_t>(items.size()) : workers);
  ParallelForWorkers(scheduler, static_cast<int64_t>(items.size()), workers, [&](int64_t worker, int64_t i) {
    const WorkItem& item = items[i];
    float* const* captures = capture_grads.Part(p.deterministic ? i : worker);
    std::vector<float>& dq_part = dq_parts[p.deterministic ? item.tile : worker];
    if (!p.deterministic && dq_part.empty()) dq_part.assign(dq_size, 0.0f);
    float* dbias_copy = args.bias.active() ? dbias_copies.data() + BiasGradientCopy(p, runs, item.batch, item.head,
                                                                                    item.tile) * bias_elements
                                           : nullptr;
    const int64_t* start = run_starts.data() + item.batch * (runs + 1);
    for (int64_t t = start[item.tile]; t < start[item.tile + 1]; ++t) {
      BackwardKVTile<T, Variant>(args, scratch[worker], q_tile_reach, delta.data(),
                                 {item.batch, item.head, t, item.cost}, dq_part.data(), dbias_copy, captures);
    }
  });
  capture_grads.Sum(scheduler, args.capture_grads);
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

Status AttentionBackward(const AttentionParams& params, const BackwardBuffers& buffers, TaskScheduler* scheduler) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(params, Backend::kCpu));
  TE_JAX_RETURN_IF_ERROR(ValidateBackwardParams(params, Backend::kCpu));
  TE_JAX_RETURN_IF_ERROR(ValidateSeqlens(params, buffers.q_seqlens, buffers.kv_seqlens));
  FlexTiles flex;
  TE_JAX_RETURN_IF_ERROR(LoadFlexTiles(params.flex, buffers.flex_captures, buffers.dropout, &flex));
  const std::vector<KeyTokenBounds> kv_tile_tokens = KVTileTokens(params, TokenOperandsOf(buffers));
  DispatchDType(params.dtype, [&](auto dtype_tag) {
    using T = decltype(dtype_tag);
    const BackwardArgs<T> args{OperandArgsOf<T>(params, buffers, kv_tile_tokens, flex),
                               static_cast<const T*>(buffers.out),
                               buffers.lse,
                               static_cast<const T*>(buffers.dout),
                               buffers.dlse,
                               static_cast<T*>(buffers.dq),
                               static_cast<T*>(buffers.dk),
                               static_cast<T*>(buffers.dv),
                               buffers.dbias,
                               buffers.flex_capture_grads};
    DispatchVariant(params.softcap > 0.0f, params.has_alibi, [&](auto variant_tag) {
      Backward<T, decltype(variant_tag)>(params, args, scheduler);
    });
  });
  return Status::Ok();
}

}  // namespace te_jax::cpu
