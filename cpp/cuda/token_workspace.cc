#include "cpp/cuda/token_workspace.h"

namespace te_jax::cuda {
namespace {

constexpr int64_t kAlign = 256;

int64_t RoundUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
int64_t Granules(int64_t n) { return (n + kTokenGranule - 1) / kTokenGranule; }

// Bytes of each table, in workspace order: q_rows, keys, q_summary, kv_summary, q_span, kv_span.
void TableBytes(const AttentionParams& p, int64_t (&bytes)[6]) {
  const int64_t gq = p.batch * Granules(p.seqlen_q), gkv = p.batch * Granules(p.seqlen_kv);
  bytes[0] = p.batch * p.seqlen_q * 4 * 4;
  bytes[1] = gkv * kTokenGranule * 2 * 4;  // whole granules per batch entry (BatchTokens, kernels/common/token_mask.h)
  bytes[2] = gq * kTokenSummaryInts * 4;
  bytes[3] = gkv * kTokenSummaryInts * 4;
  bytes[4] = gq * 2 * 4;
  bytes[5] = gkv * 2 * 4;
}

}  // namespace

int64_t TokenTablesOffset(int64_t offset) { return RoundUp(offset); }

int64_t TokenTablesBytes(const AttentionParams& p) {
  if (!UsesTokens(p)) return 0;
  int64_t bytes[6];
  TableBytes(p, bytes);
  int64_t total = 0;
  for (const int64_t b : bytes) total += RoundUp(b);
  return total;
}

int64_t DocumentTableBytes(const AttentionParams& p) {
  // The table indexes a call's tokens with 32-bit ints.
  if (!p.has_segment_ids || p.seqlen_q != p.seqlen_kv || p.batch * p.seqlen_q > INT32_MAX) return 0;
  return RoundUp(DocumentTableLayout::Of(p.batch, p.seqlen_q).ints * 4);
}

TokenArgs MakeTokenArgs(const AttentionParams& p, const int32_t* q_ids, const int32_t* kv_ids, const int32_t* q_pos,
                        const int32_t* kv_pos, void* tables) {
  TokenArgs t{};
  if (!UsesTokens(p)) return t;
  if (p.has_segment_ids) {
    t.q_ids = q_ids;
    t.kv_ids = kv_ids;
  }
  if (p.has_positions) {
    t.q_pos = q_pos;
    t.kv_pos = kv_pos;
    t.causal = p.mask_type == MaskType::kCausal ? 1 : 0;
    t.window_left = static_cast<int32_t>(p.window_left);
    t.window_right = static_cast<int32_t>(p.window_right);
  }
  int64_t bytes[6];
  TableBytes(p, bytes);
  int32_t** tables_in_order[6] = {&t.q_rows, &t.keys, &t.q_summary, &t.kv_summary, &t.q_span, &t.kv_span};
  char* at = static_cast<char*>(tables);
  for (int i = 0; i < 6; ++i) {
    *tables_in_order[i] = reinterpret_cast<int32_t*>(at);
    at += RoundUp(bytes[i]);
  }
  return t;
}

}  // namespace te_jax::cuda
