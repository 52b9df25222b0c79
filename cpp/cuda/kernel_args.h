// The parameter blocks the CUDA kernels take by value. Compiled by the host compiler (the launcher fills them) and by
// NVRTC (the kernels read them), so both sides see one layout: only pointers, 32/64-bit integers and floats.
#pragma once

#include "cpp/core/flex_mods.h"
#include "cpp/core/host_device.h"
#include "cpp/core/kv_format.h"
#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif

namespace te_jax::cuda {

// Shapes and options shared by every kernel of a call. Layouts as in cpp/core/attention_params.h.
struct ShapeArgs {
  int32_t batch;
  int32_t seqlen_q;
  int32_t seqlen_kv;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t mask_type;     // cpp/core/mask_type.h; masks are run-time data, not template parameters (one kernel for all)
  int32_t window_left;   // -1: unbounded
  int32_t window_right;  // -1: unbounded
  float scale;
  float softcap;
};

// Packed sequences: the segment ids and positions as given (null when absent), the mask they carry, and the
// token tables that the tokens kernels (kernels/common/token_tables.cuh) derive from them into the call's workspace
// before the attention kernels read them. Tables are int32, per batch entry, one granule = kTokenGranule tokens:
//   q_rows [B][Sq][4]: id (0: the row sees nothing), the inclusive kv-position bounds lo and hi, the position;
//   keys [B][Skv][2]: id (0: no row sees the key), position;
//   q_summary [B][Gq][8], kv_summary [B][Gkv][8]: a granule's TokenSummary;
//   q_span [B][Gq][2]: the kv granules [begin, end) any row of the q granule may see; kv_span [B][Gkv][2] the converse.
// With positions the index-based mask of ShapeArgs is off (no_mask, no window) and `causal` and the window here act on
// positions; without them the index-based mask stays and the rows' bounds are unbounded.
inline constexpr int kTokenGranule = 64;
inline constexpr int kTokenSummaryInts = 8;
inline constexpr int kTokenTableThreads = 128;  // threads per block of the token-table kernels: a warp per granule

// Packed rows read as documents (the sm90 document kernels, kernels/common/document_tables.cuh): the document table
// the table kernel (a CTA of kDocumentTableThreads per kDocumentTableChunk tokens of a row) derives from the ids into
// the workspace, int32 (DocumentTableLayout):
//   [0]: 1 where the ids and positions allow the reading (document_tables.cuh says when), else 0; [1]: the number of
//   works E; [2]: the forward document kernel's work counter, which the table kernel zeroes; [3]: the table kernel's
//   finished chunks, zeroed before it;
//   then DocumentTableEntries entries of 4 ints {b, m0, first, end}, the first E of them the works, longest first:
//   query rows [m0, min(m0 + block_m, end)) of batch entry b's document of rows and keys [first, end) (first = end for
//   a run of id 0, whose rows see nothing);
//   then the table kernel's scratch: each run's first token (b x S + i), each run's first work (the runs' works summed
//   before it, and after the last run their total), the works in run order, and a summary per chunk.
inline constexpr int kDocumentTableThreads = 256;
inline constexpr int kDocumentTableChunk = 2048;
inline constexpr int kDocumentTableHeaderInts = 4;
// Entries the table has room for: a document of n rows has ceil(n / block_m) blocks, at most n / 64 + 1.
TE_JAX_HOST_DEVICE constexpr int64_t DocumentTableEntries(int64_t batch, int64_t seqlen) {
  return batch * ((seqlen + 63) / 64 + seqlen);
}
// The sm90 backward's document kernel runs a CTA per work and (kv) head: its grid has room for the works of documents
// of 2 x block rows on average (a block per block of the row, and one more per 2 x block rows for the blocks a
// document's end cuts short); a call with more works is left to the token tables.
TE_JAX_HOST_DEVICE constexpr int64_t DocumentWorksOfGrid(int64_t batch, int64_t seqlen, int64_t block) {
  return batch * ((seqlen + block - 1) / block + (seqlen + 2 * block - 1) / (2 * block));
}

// Where each part of the document table lies, in ints from its start (int4 parts at multiples of 4).
struct DocumentTableLayout {
  int64_t entries, run_first, run_works, unsorted, chunks, ints;

  static TE_JAX_HOST_DEVICE constexpr int64_t Chunks(int64_t batch, int64_t seqlen) {
    return batch * ((seqlen + kDocumentTableChunk - 1) / kDocumentTableChunk);
  }

  static TE_JAX_HOST_DEVICE constexpr DocumentTableLayout Of(int64_t batch, int64_t seqlen) {
    DocumentTableLayout l{};
    const int64_t capacity = DocumentTableEntries(batch, seqlen);
    l.entries = kDocumentTableHeaderInts;
    l.run_first = l.entries + 4 * capacity;
    l.run_works = l.run_first + batch * seqlen;
    l.unsorted = (l.run_works + batch * seqlen + 1 + 3) / 4 * 4;
    l.chunks = l.unsorted + 4 * capacity;
    l.ints = l.chunks + 4 * Chunks(batch, seqlen);
    return l;
  }
};

struct TokenArgs {
  const int32_t* q_ids;
  const int32_t* kv_ids;
  const int32_t* q_pos;
  const int32_t* kv_pos;
  int32_t causal;
  int32_t window_left;
  int32_t window_right;
  int32_t* q_rows;
  int32_t* keys;
  int32_t* q_summary;
  int32_t* kv_summary;
  int32_t* q_span;
  int32_t* kv_span;
  // The sm90 forward's document table (above), where its module has the document kernel; else null.
  int32_t* documents;
};

// Attention dropout (kernels/common/dropout.h): the dropout operand (uint32 [6]: the PRNG key's two words,
// then the global (b, h, i, j) of the call's element [0, 0, 0, 0]), the drop threshold and 1 / the keep probability.
struct DropoutArgs {
  const uint32_t* operand;
  uint32_t threshold;
  float keep_scale;
};

// The additive logit bias: the operand as given, [B|1, H|1, Sq|1, Skv|1] in the module's bias element type
// (LogitsVariant::Bias), 16-byte aligned; element (b, h, i, j) at b * batch_stride + h * head_stride + i *
// query_stride + j * key_stride, each stride 0 along a broadcast dim (cpp/core/bias.h's BiasLayout). Zeros without a bias.
struct BiasArgs {
  const void* data;
  int64_t batch_stride;
  int64_t head_stride;
  int32_t query_stride;
  int32_t key_stride;
  int64_t elements;  // of the operand: reads stay below it
};

struct ForwardArgs {
  ShapeArgs shape;
  const void* q;
  const void* k;
  const void* v;
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  const float* alibi_slopes;
  void* out;
  float* lse;
  const float* sinks;  // [B, H], merged into each finished row (cpp/core/sink.h); null without sinks
  TokenArgs tokens;  // read only by kernels built with tokens (LogitsVariant::kHasTokens)
  DropoutArgs dropout;  // read only by kernels built with dropout (LogitsVariant::kHasDropout)
  BiasArgs bias;     // read only by kernels built with a bias (LogitsVariant::kHasBias)
  // FP8 q, k and v (the sm90 FP8 forward): float32 [3, H], q's, k's and v's descales per query head (k's and v's
  // those of its kv head); null otherwise.
  const float* fp8_descales;
};

// A CUtensorMap (cuda.h), opaque: 128 bytes, 128-byte aligned. Kernels built by NVRTC see no cuda.h, so they take it as
// this; the host encodes a CUtensorMap and copies it in (tensor_maps.h checks the sizes agree).
struct alignas(128) TensorMap {
  uint64_t opaque[16];
};

// The decode kernels' parameters (kernels/decode/): the forward's, and the launch geometry the host chose. A CTA
// (blockIdx x = split, y = K/V head x row block, z = batch) packs heads_per_block query heads of one K/V head times
// positions_per_block query positions into the rows of its tile (row r: position r / heads_per_block, head
// r % heads_per_block of its block) and reads keys tiles [split * tiles_per_split, (split + 1) * tiles_per_split).
// With one split it writes out and lse; with more, each split writes its partial result (its keys' normalised output
// and log-sum-exp) to the workspace, and the combine kernel merges them.
struct DecodeArgs {
  ForwardArgs args;
  int32_t heads_per_block;
  int32_t positions_per_block;
  int32_t head_blocks;  // row blocks of a K/V head: head_blocks x ceil(Sq / positions_per_block)
  int32_t row_blocks;
  int32_t splits;
  int32_t tiles_per_split;
  float* partial_out;  // [splits][B][Sq][H][Dv]
  float* partial_lse;  // [splits][B][H][Sq]
  // A paged KV cache (page_size > 0; cpp/core/kv_rows.h): k and v are pools of num_pages pages, read through page_table.
  const int32_t* page_table;
  int64_t page_size;
  int64_t num_pages;
  // An FP8 KV cache's descales (kernels built with an FP8 KvElement read them; cpp/core/kv_format.h).
  KvDescales kv_descales;
  // On sm_90 on where the K and V stages are swizzled tiles (attention_decode.cuh kTmaStages): k and v as tensor maps
  // (tensor_maps.h; an FP8 cache's as 16-bit byte pairs) whose copies fill the stages, of 64-row boxes of [B, Skv] rows, or (paged) of the pool's rows in
  // boxes within a page (decode/tile_size.h PagedBoxRows). The parameter is __grid_constant__, so TMA reads the maps in
  // place.
  TensorMap k_map;
  TensorMap v_map;
};

// The sm90 forward's parameters: the forward's, and TMA tensor maps of q, k and v as 4-D tensors [B][S][H][D] (innermost
// first: D, H, S, B), each copied box by box as 64 columns x the tile's rows of one (batch, head); with a bias, its map
// as a 3-D tensor [B' H'][Sq'][Skv'] (sm90/bias_tile.h).
struct TmaForwardArgs {
  ForwardArgs args;
  TensorMap q;
  TensorMap k;
  TensorMap v;
  TensorMap bias;  // read only by kernels built with a bias (sm90/bias_tile.h)
  // The persistent kernels' count of the works their CTAs have taken: a word of the workspace, zeroed before the launch
  // (attention_fwd.cuh's PrefetchWork).
  unsigned* next_work;
};

// The length guard (kernels/common/length_guard.cuh) around an engine that trusts its run-time lengths: before it,
// clamped copies of the lengths and per-batch invalid flags go to `guarded`; after it, the rows and keys the lengths
// cut get te_jax's values and the outputs of invalid batch entries NaN. Outputs of the other direction are null.
inline constexpr int kLengthGuardRowsPerBlock = 32;  // query rows (and keys) per block of the contract kernel

struct LengthGuardArgs {
  ShapeArgs shape;
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  int32_t* guarded;  // [3][batch]: clamped q lengths, clamped kv lengths, 1 where the batch's lengths were invalid
  int32_t head_dim;
  int32_t head_dim_v;
  uint16_t* out;  // forward
  float* lse;
  uint16_t* dq;  // backward
  uint16_t* dk;
  uint16_t* dv;
};

struct BackwardArgs {
  ShapeArgs shape;
  const void* q;
  const void* k;
  const void* v;
  const void* out;
  const float* lse;
  const void* dout;
  const float* dlse;
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  const float* alibi_slopes;
  void* dq;
  void* dk;
  void* dv;
  // float [B, H, Sq] scratch for delta_i - dlse_i = rowsum(dout * out) - dlse. It aliases dq (dq's bytes are at least
  // twice as many): the preprocess kernel writes it, the dk/dv kernel reads it, and only then the dq kernel, which
  // recomputes its own rows' delta, overwrites the buffer with dq.
  float* delta_scratch;
  // The non-deterministic backward's float [B, Sq, H, D] dq accumulator (the call's workspace); null otherwise.
  float* dq_accum;
  TokenArgs tokens;  // read only by kernels built with tokens (LogitsVariant::kHasTokens)
  DropoutArgs dropout;  // read only by kernels built with dropout (LogitsVariant::kHasDropout)
  BiasArgs bias;     // read only by kernels built with a bias (LogitsVariant::kHasBias), like the two below
  // dbias, bias's shape and dtype. Where no dim of it is summed (each of its elements is one (b, h, i, j)), the dk/dv
  // kernel writes it directly, every element once; otherwise it adds to dbias_accum, a float32 copy of bias's shape in
  // the workspace (zeroed by the preprocess kernel), which the bias-gradient kernel then converts (null: direct).
  void* dbias;
  float* dbias_accum;
};

// The sm90 backward's parameters (both kernels): the backward's, and TMA tensor maps of q, k, v and dout as for the
// forward, each copied in boxes of 64 columns x 64 rows of one (batch, head).
struct TmaBackwardArgs {
  BackwardArgs args;
  TensorMap q;
  TensorMap k;
  TensorMap v;
  TensorMap dout;
  TensorMap bias;  // read only by kernels built with a bias (sm90/bias_tile.h)
};

// score_mod / mask_mod (te_jax.flex): the captured arrays a mod's generated struct reads, as its Bind takes them
// (te_jax/flex/codegen.py), the score_mod's first, then the mask_mod's (a block mask's blocks after them, also in
// block_mask). A kernel built with mods (LogitsVariant::Mods) takes WithFlex<its arguments>, so the arguments of
// every other kernel keep their size.

struct KernelCapture {
  const void* data;
  int64_t shape[kMaxKernelCaptureRank];
  int64_t strides[kMaxKernelCaptureRank];  // in elements
};

// A block mask of the mask_mod (te_jax/block_mask.py): int8 blocks [B' or 1, H or 1, rows, cols] of kBlockHidden /
// kBlockPartial / kBlockVisible over blocks of block_q queries and block_kv keys (a broadcast dim's stride 0); blocks
// null without one.
struct BlockMaskArgs {
  const int8_t* blocks;
  int64_t batch_stride;
  int64_t head_stride;
  int32_t block_q;
  int32_t block_kv;
  int32_t rows;
  int32_t cols;
};

struct FlexArgs {
  KernelCapture captures[kMaxKernelCaptures];
  BlockMaskArgs block_mask;
  // The backward: the float32 gradients of the score_mod's captures, zeroed by the host; null for a capture without one.
  float* grads[kMaxKernelCaptures];
  // Where they fit in the dk/dv kernel's scratch (sm90/tile_size.h: CaptureGradientScratchBytes), each CTA adds them
  // up there first: capture i's at float gradient_scratch[i] of it (-1: none), gradient_elements[i] of them;
  // gradient_scratch_floats in all (0: the kernel adds to memory directly).
  int32_t gradient_scratch[kMaxKernelCaptures];
  int32_t gradient_elements[kMaxKernelCaptures];
  int32_t gradient_scratch_floats;
  int32_t batch_fold;  // vmap's examples folded into the batch: the mods see (b + its offset) / batch_fold
  // The global (b, h, q, kv) of the call's element [0, 0, 0, 0] (words 2-5 of the dropout operand, in device memory:
  // a shard's call computes them), which the mods' indices start from.
  const uint32_t* offsets;
};

template <typename Args>
struct WithFlex : Args {
  FlexArgs flex;
};

}  // namespace te_jax::cuda
