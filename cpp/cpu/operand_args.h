// The operands both directions read, typed.
#pragma once

#include <cstdint>
#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/core/kv_rows.h"
#include "cpp/core/validate.h"
#include "cpp/cpu/batch_masks.h"
#include "cpp/cpu/bias_tile.h"
#include "cpp/cpu/dropout_tile.h"
#include "cpp/cpu/flex_tiles.h"
#include "cpp/cpu/tile_token_bounds.h"

namespace te_jax::cpu {

// TKv: k's and v's storage, T's unless an FP8 KV cache (the forward's).
template <typename T, typename TKv = T>
struct OperandArgs {
  const AttentionParams& params;
  const T* q;
  const TKv* k;
  const TKv* v;
  KvRows k_rows, v_rows;  // where k's and v's rows live (contiguous, or paged in the forward)
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  const float* alibi_slopes;
  TokenOperands tokens;
  const KeyTokenBounds* kv_tile_tokens;  // KVTileTokens; null without segment ids and positions
  BiasOperand bias;
  DropoutOperand dropout;
  const FlexTiles& flex;  // score_mod / mask_mod; inactive without them
  KvDescales kv_descales;  // an FP8 KV cache's; data null otherwise
};

// `kv_tile_tokens` and `flex` must outlive the result (it points into them).
template <typename T, typename TKv = T>
OperandArgs<T, TKv> OperandArgsOf(const AttentionParams& params, const AttentionOperands& o,
                                  const std::vector<KeyTokenBounds>& kv_tile_tokens, const FlexTiles& flex) {
  return {params,
          static_cast<const T*>(o.q),
          static_cast<const TKv*>(o.k),
          static_cast<const TKv*>(o.v),
          MakeKvRows(params, o.page_table, params.head_dim),
          MakeKvRows(params, o.page_table, params.head_dim_v),
          QuerySeqlensRead(params, o.q_seqlens),
          o.kv_seqlens,
          o.alibi_slopes,
          TokenOperandsOf(o),
          kv_tile_tokens.empty() ? nullptr : kv_tile_tokens.data(),
          MakeBiasOperand(params, o.bias),
          MakeDropoutOperand(params, o.dropout),
          flex,
          IsFp8(params.kv_format) ? KvDescales{o.kv_descale, params.kv_descale_blocks, params.kv_descale_heads}
                                  : KvDescales{}};
}

}  // namespace te_jax::cpu
