// Decode attention (few query positions, long key sequences): mma.sync m16n8k16, ldmatrix and a ring of stages that
// cp.async fills (TMA on sm_90 on), so it runs on every arch from sm_80. Bound by reading K and V, not by the tensor
// cores, so the design is about bytes:
//   - GQA packing: a CTA's tile rows are query heads of one K/V head x query positions (kernel_args.h DecodeArgs), so
//     each K/V byte is read once per group, not once per query head;
//   - split-KV: the key tiles of a (batch, K/V head) are split across CTAs (blockIdx.x) so that small batches still
//     fill the GPU; each split writes its partial output and log-sum-exp, and combine.cuh merges them;
//   - within a CTA the warps split each stage's keys (one 16-row tile: 16 keys per warp) or its rows (four row tiles),
//     and the epilogue merges the warps' partial softmax states.
// Masks, variants, lengths and non-finite values follow the sm80 forward (kernels/sm80/attention_fwd.cuh): tiles
// outside the rows' key ranges are never read, tiles inside every row's range skip the per-element mask, and a CTA
// whose straddling tiles may have put NaN where no row sees it runs again with the careful product.
// An FP8 KV cache (KvElement E4M3 or E5M2, cpp/core/kv_format.h) halves the bytes: the stages hold its raw bytes as
// 16-bit tiles of byte pairs, the products run in f16 on them (primitives/fp8_tile.h: q converted once to f16 in the
// order its K fragments take, P packed to f16, V's fragments coming out as even and odd columns), and the descales
// scale the logits and the output (Fp8Scales below).
#pragma once

#include "cpp/core/kv_format.h"
#include "cpp/core/kv_rows.h"
#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/nonfinite_tile.h"
#include "cpp/cuda/kernels/common/online_softmax.h"
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/kernels/primitives/dependent_launch.h"
#include "cpp/cuda/kernels/primitives/fp8_tile.h"
#include "cpp/cuda/kernels/primitives/padded_tile.h"
#include "cpp/cuda/kernels/primitives/pipeline.h"
#include "cpp/cuda/kernels/primitives/swizzled_tile.h"
#include "cpp/cuda/kernels/primitives/warp_gemm.h"
#include "cpp/cuda/kernels/primitives/xor_swizzled_tile.h"

namespace te_jax::cuda::decode {

// Asynchronously copies the rows of one K/V head (`head_offset` elements into each row of `row_stride` elements) of a
// paged call's tile of kRows keys into a tile (builds without TMA stages); row_of(r) is key r's row in the pool
// (cpp/core/kv_rows.h), -1 for a key past the length (zero-filled, as are columns past cols). A contiguous call's rows are
// consecutive: its tiles' AsyncLoad (primitives/async_load_rows.h) copies them, and a paged call gives its bits.
template <int kThreads, typename Tile, typename RowOf>
__device__ __forceinline__ void AsyncLoadKeys(const Tile& tile, const uint16_t* base, RowOf row_of, int64_t row_stride,
                                              int head_offset, int cols, int tid) {
  constexpr int kChunksPerRow = Tile::kCols / 8;
  constexpr int kChunks = Tile::kRows * kChunksPerRow;
  // tid through an empty asm: the compiler cannot see that the chunks' offsets repeat from tile to tile, so it
  // computes them here instead of keeping them live through the main loop (which spilled at d = 256).
  asm volatile("" : "+r"(tid));
  // A fixed trip count (tid < kThreads), so the loops unroll completely.
  constexpr int kIters = (kChunks + kThreads - 1) / kThreads;
  // Every row of a group of chunks before the group's copies: a paged call's rows come from shared memory, and read
  // one by one between the copies, each copy waited for its read (H200, b 8 x 16 queries x 8k, one CTA an SM: paged
  // 0.78 of contiguous). Up to d = 128 the group is all of a thread's chunks (8); above, the four-row-tile kernel has
  // no register to spare (255 at d = 256: a group of two spills), so one row at a time.
  constexpr int kGroup = kIters <= 8 ? kIters : 1;
  // Where the CTA's threads cover whole rows, a thread's chunks are one column of rows kRowStep apart, so chunk i's
  // row and column follow from tid by a shift and a mask and its shared-memory address by an immediate; a signed
  // division per chunk put ~100 instructions between a stage's barrier and its first copy (SASS, d = 128).
  constexpr bool kColumnOfRows = kThreads % kChunksPerRow == 0 && kChunks % kThreads == 0;
  constexpr int kRowStep = kThreads / kChunksPerRow;
  const unsigned thread = static_cast<unsigned>(tid);
  auto row_of_chunk = [&](int i) {
    if constexpr (kColumnOfRows) return static_cast<int>(thread / kChunksPerRow) + i * kRowStep;
    return (tid + i * kThreads) / kChunksPerRow;
  };
  auto col_of_chunk = [&](int i) {
    if constexpr (kColumnOfRows) return static_cast<int>(thread % kChunksPerRow) * 8;
    return (tid + i * kThreads) % kChunksPerRow * 8;
  };
  auto exists = [&](int i) { return i < kIters && (kChunks % kThreads == 0 || tid + i * kThreads < kChunks); };
#pragma unroll
  for (int i0 = 0; i0 < kIters; i0 += kGroup) {
    int rows[kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) rows[j] = exists(i0 + j) ? row_of(row_of_chunk(i0 + j)) : -1;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (!exists(i0 + j)) break;
      const int r = row_of_chunk(i0 + j), col = col_of_chunk(i0 + j);
      const bool valid = rows[j] >= 0 && col < cols;
      CpAsync16(tile.Address(r, col), valid ? base + rows[j] * row_stride + head_offset + col : base, valid);
    }
  }
}

// The K and V stages' tiles: XorSwizzledTile where rows are whole 128-byte groups (its copies ask the L2 for each
// sector once), else PaddedTile's padded rows (tile_size.h StageTileBytes).
template <int kRows, int kCols, bool kSwizzled = SwizzledStage(kCols)>
struct StageTileOf {
  using Type = XorSwizzledTile<kRows, kCols>;
};
template <int kRows, int kCols>
struct StageTileOf<kRows, kCols, false> {
  using Type = PaddedTile<kRows, kCols>;
};

// The query rows of a CTA: heads [head0, head0 + heads) of its K/V head's group at positions [pos0, pos0 + positions),
// row r being head r % heads_per_block at position r / heads_per_block. Rows outside that rectangle are padding.
struct RowBlock {
  int b, kv_head, split;
  int head0, heads;
  int pos0, positions;
  int heads_per_block;

  __device__ __forceinline__ bool Valid(int r) const {
    return r % heads_per_block < heads && r / heads_per_block < positions;
  }
  __device__ __forceinline__ int Head(int r) const { return head0 + r % heads_per_block; }
  __device__ __forceinline__ int Position(int r) const { return pos0 + r / heads_per_block; }
};

__device__ __forceinline__ RowBlock RowBlockOfCta(const DecodeArgs& a) {
  const ShapeArgs& s = a.args.shape;
  const int group = s.num_heads / s.num_kv_heads;
  const int row_block = static_cast<int>(blockIdx.y) % a.row_blocks;
  const int head_block = row_block % a.head_blocks;
  RowBlock rb;
  rb.b = blockIdx.z;
  rb.kv_head = static_cast<int>(blockIdx.y) / a.row_blocks;
  rb.split = blockIdx.x;
  rb.heads_per_block = a.heads_per_block;
  rb.head0 = rb.kv_head * group + head_block * a.heads_per_block;
  rb.heads = min(a.heads_per_block, group - head_block * a.heads_per_block);
  rb.pos0 = row_block / a.head_blocks * a.positions_per_block;
  rb.positions = min(a.positions_per_block, s.seqlen_q - rb.pos0);
  return rb;
}

// Whether this build copies the K and V stages with TMA (sm_90 on): a few lanes of one warp issue a tile's boxes where
// cp.async took 16 copies a thread, the tensor map's 128-byte swizzle writing XorSwizzledTile's layout.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
inline constexpr bool kArchHasTma = true;
#else
inline constexpr bool kArchHasTma = false;
#endif

// The power of two just above a positive finite x, within float's normal range (2^-126 to 2^127).
__device__ __forceinline__ float PowerOfTwoAbove(float x) {
  return __int_as_float(min((__float_as_int(x) & 0x7F800000) + 0x00800000, 0x7F000000));
}

// kStages: the ring's depth (tile_size.h: the deep ring, or the shallow one that fits more CTAs on an SM). KvElement:
// the type of k and v, Element's or an FP8 format.
template <typename Element, int kD, int kDv, typename Variant, int kRowTiles, int kStages, typename KvElement>
struct DecodeKernel {
  static constexpr int kThreads = decode::kThreads;
  static constexpr int kRows = RowsOfTile(kRowTiles);
  static constexpr int kKeySlices = kWarps / kRowTiles;
  static constexpr int kSliceN = kBlockN / kKeySlices;  // keys per warp per stage
  static constexpr bool kFp8 = KvElement::kBytes == 1;
  using Product = typename ProductElement<Element, KvElement>::Type;  // the mma inputs' type: f16 with FP8 K/V
  static constexpr int kDP = PadKvDim(kD, KvElement::kBytes);
  static constexpr int kDvP = PadKvDim(kDv, KvElement::kBytes);
  // A K or V row's 16-bit columns (byte pairs with FP8), which the copies count.
  static constexpr int kKCols = kD * KvElement::kBytes / 2;
  static constexpr int kVCols = kDv * KvElement::kBytes / 2;
  using QTile = PaddedTile<kRows, kDP>;
  using KTile = typename StageTileOf<kBlockN, StageCols(kD, KvElement::kBytes)>::Type;
  using VTile = typename StageTileOf<kBlockN, StageCols(kDv, KvElement::kBytes)>::Type;
  using KOperand = typename KvOperand<KvElement, KTile>::Type;  // what the products read of a stage
  using VOperand = typename KvOperand<KvElement, VTile>::Type;
  static constexpr int kStageBytes = KTile::kBytes + VTile::kBytes;
  // TMA for the stages of this build's calls, contiguous and paged: stage tiles in XorSwizzledTile's layout.
  static constexpr bool kTmaStages = kArchHasTma && SwizzledStage(KTile::kCols) && SwizzledStage(VTile::kCols);
  // From a 1024-byte-aligned base (tile_size.h SmemBytes), the ring first, so its tiles start on the swizzle's atoms.
  static constexpr int kRingOffset = 0;
  static constexpr int kQOffset = kRingOffset + kStages * kStageBytes;
  static constexpr int kRowsOffset = RowsOffset(kD, kDv, kRowTiles, kStages, KvElement::kBytes);
  static constexpr int kKeyRowsOffset = kRowsOffset + kRows * 16;
  static constexpr int kKeyRowSlots = KeyRowSlots(kStages);
  static constexpr int kDescalesOffset = kKeyRowsOffset + kKeyRowSlots * kBlockN * 4;
  static constexpr int kQMaxOffset = kDescalesOffset + (kFp8 ? kKeyRowSlots * kBlockN * 8 : 0);
  static constexpr int kBarriersOffset = kQMaxOffset + (kFp8 ? 8 : 0);
  static constexpr int kSmemBytes = 1024 + kBarriersOffset + kStages * 8;
  static constexpr int kPitch = EpiloguePitch(kDvP);
  static_assert(kRowTiles * kKeySlices == kWarps && kSliceN % 16 == 0, "warps split a stage into 16-key multiples");
  static_assert(kSmemBytes == SmemBytes(kD, kDv, kRowTiles, kStages, KvElement::kBytes),
                "tile_size.h and the kernel disagree on shared memory");
  static_assert(kStageBytes % 1024 == 0 && KTile::kBytes % 1024 == 0 && kBarriersOffset % 8 == 0,
                "stage tiles start on 1024-byte swizzle atoms (TMA's swizzle, the bank groups, whole L2 sectors)");
  static_assert(!kFp8 || (kD % 16 == 0 && kDv % 16 == 0), "FP8 rows are whole 16-byte chunks");
  static_assert(kRowsOffset >= kQOffset + QTile::kBytes &&
                    kRowsOffset >= kWarps * 16 * (kPitch + 2) * 4 + kRows * (kKeySlices + 2) * 4,
                "the rows' ranges follow the q tile and the epilogue (Smem)");

  struct Smem {
    unsigned char* base;
    __device__ __forceinline__ QTile Q() const { return {reinterpret_cast<uint16_t*>(base + kQOffset)}; }
    __device__ __forceinline__ KTile K(int stage) const {
      return {reinterpret_cast<uint16_t*>(base + kRingOffset + stage * kStageBytes)};
    }
    __device__ __forceinline__ VTile V(int stage) const {
      return {reinterpret_cast<uint16_t*>(base + kRingOffset + stage * kStageBytes + KTile::kBytes)};
    }
    // Per row: its visible keys, its position on the mask's diagonal, its ALiBi slope.
    __device__ __forceinline__ int2* Ranges() const { return reinterpret_cast<int2*>(base + kRowsOffset); }
    __device__ __forceinline__ int* Positions() const { return reinterpret_cast<int*>(Ranges() + kRows); }
    __device__ __forceinline__ float* Slopes() const { return reinterpret_cast<float*>(Positions() + kRows); }
    // The ring of key-row tables: the pass's i-th tile's in slot i % kKeyRowSlots.
    __device__ __forceinline__ int* KeyRows(int i) const {
      return reinterpret_cast<int*>(base + kKeyRowsOffset) + i % kKeyRowSlots * kBlockN;
    }
    // FP8 with descales per page: each key's (k, v) descales, in the slot of its key-row table.
    __device__ __forceinline__ float2* Descales(int i) const {
      return reinterpret_cast<float2*>(base + kDescalesOffset) + i % kKeyRowSlots * kBlockN;
    }
    // FP8: the largest |q| of the tile, as the 16-bit magnitude's bits (ConvertQ).
    __device__ __forceinline__ unsigned* QMax() const { return reinterpret_cast<unsigned*>(base + kQMaxOffset); }
    // The stage's TMA copies complete on its barrier (kTmaStages).
    __device__ __forceinline__ uint32_t Full(int stage) const {
      return SmemAddress(base + kBarriersOffset) + stage * 8;
    }
    // The epilogue, over the rings and the q tile (tile_size.h RowsOffset): each warp's 16 x dv partial output, then
    // each warp's row maxima and sums, then per CTA row the warps' weights, 1 / sum and lse.
    __device__ __forceinline__ float* PartialOut(int warp) const {
      return reinterpret_cast<float*>(base + kRingOffset) + warp * 16 * kPitch;
    }
    __device__ __forceinline__ float* PartialMax() const { return PartialOut(kWarps); }
    __device__ __forceinline__ float* PartialSum() const { return PartialMax() + kWarps * 16; }
    __device__ __forceinline__ float* Weights() const { return PartialSum() + kWarps * 16; }
    __device__ __forceinline__ float* InvSum() const { return Weights() + kRows * kKeySlices; }
    __device__ __forceinline__ float* Lse() const { return InvSum() + kRows; }
  };

  static __device__ __forceinline__ void Run(const DecodeArgs& a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const Smem sm{smem_raw + (-SmemAddress(smem_raw) & 1023u)};
    const ForwardArgs& args = a.args;
    const ShapeArgs& s = args.shape;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row_tile = warp % kRowTiles, slice = warp / kRowTiles;
    const RowBlock rb = RowBlockOfCta(a);
    const BatchLengths len = ReadLengths(s, args.q_seqlens, args.kv_seqlens, rb.b);
    const RowMask mask = MakeMask(s, len);

    // The q rows: each 16-byte chunk from its own (position, head); padding rows and columns are zero-filled.
    const uint16_t* q = static_cast<const uint16_t*>(args.q);
    for (int c = tid; c < kRows * (kDP / 8); c += kThreads) {
      const int r = c / (kDP / 8), col = c % (kDP / 8) * 8;
      const bool valid = rb.Valid(r) && col < kD;
      const int64_t row = (static_cast<int64_t>(rb.b) * s.seqlen_q + rb.Position(r)) * s.num_heads + rb.Head(r);
      CpAsync16(sm.Q().Address(r, col), valid ? q + row * kD + col : q, valid);
    }
    CpAsyncCommit();
    for (int r = tid; r < kRows; r += kThreads) {
      const KeyRange keys = rb.Valid(r) ? mask.Keys(rb.Position(r)) : KeyRange{0, 0};
      sm.Ranges()[r] = make_int2(static_cast<int>(keys.begin), static_cast<int>(keys.end));
      sm.Positions()[r] = rb.Position(r) + static_cast<int>(mask.diag_offset);
      sm.Slopes()[r] = Variant::kHasAlibi && rb.Valid(r) ? args.alibi_slopes[rb.b * s.num_heads + rb.Head(r)] : 0.0f;
    }
    if (kFp8 && tid == 0) *sm.QMax() = 0u;

    // The split's key tiles: its share of the tiles any row of the CTA sees.
    const KeySpan span = KeysOfRows(mask, rb.pos0, rb.positions);
    const int tile_begin = max(span.FirstTile(kBlockN), rb.split * a.tiles_per_split);
    const int tile_end = min(span.EndTile(kBlockN), (rb.split + 1) * a.tiles_per_split);
    // An empty page pool has no rows to read: every page a sequence uses is outside it (the page check below says so).
    const bool empty_pool = a.page_size > 0 && a.num_pages == 0;
    const int tiles = tile_end > tile_begin && !empty_pool ? tile_end - tile_begin : 0;
    // Tiles [full_begin, full_end) are visible to every row: no per-element mask there.
    const int full_begin = span.all_rows_valid ? (span.full_begin + kBlockN - 1) / kBlockN : tile_end;
    const int full_end = span.all_rows_valid ? span.full_end / kBlockN : tile_end;

    // Where the keys' rows are (the row index is the same in k and v, whose rows differ in length).
    const KvRows key_rows{s.seqlen_kv, 0, 0, a.page_size, a.num_pages,
                          a.page_size > 0 ? s.seqlen_kv / a.page_size : 0, a.page_table};
    const int64_t k_stride = static_cast<int64_t>(s.num_kv_heads) * kKCols;
    const int64_t v_stride = static_cast<int64_t>(s.num_kv_heads) * kVCols;
    const uint16_t* k = static_cast<const uint16_t*>(args.k);
    const uint16_t* v = static_cast<const uint16_t*>(args.v);
    const bool paged = key_rows.paged();
    // FP8: the descales (cpp/core/kv_format.h). One (k, v) pair serves the CTA (per tensor or head, or a contiguous
    // call's batch entry) but where a paged call's pages have their own: then the row look-ups write each key's pair
    // beside its row. One pair's k descale folds into the logit scale where it is positive and finite (the softmax's
    // log2 scale must be > 0), else it multiplies the logits as per-key ones do (0 and NaN reach them as in the
    // dequantized product, and the mask then hides the keys a row does not see). One pair's v descale scales o where it
    // is finite, else it multiplies each probability as per-key ones do, a zero probability staying 0 (so a NaN or inf
    // reaches only the rows that see its keys, as in the dequantized product).
    const bool descale_per_key = kFp8 && paged && a.kv_descales.blocks > 1;
    float k_descale = 1.0f, v_descale = 1.0f;
    if (kFp8 && !descale_per_key) {
      const int64_t block = a.kv_descales.Block(paged, 0, rb.b);
      k_descale = a.kv_descales.K(block, rb.kv_head);
      v_descale = a.kv_descales.V(block, rb.kv_head);
    }
    constexpr float kFloatMax = 3.402823466e38f;
    const bool scores_times_descale = descale_per_key || !(k_descale > 0.0f && k_descale <= kFloatMax);
    const bool values_times_descale = descale_per_key || !(fabsf(v_descale) <= kFloatMax);
    // A build with TMA stages (the host encoded the maps: attention_cuda.cc): warp 0 copies each stage, which completes
    // on the stage's barrier; else every thread's cp.async copies, which it waits for by group. A contiguous call's
    // stage is one box of 64 rows, so it also holds the rows of the batch entry's K/V past its length up to the tile's
    // end (cp.async zero-fills them): no row sees those keys, and a non-finite value there (a cache never written) is
    // the careful pass's, like one in any key a row does not see. A paged call's boxes are runs of rows within a page
    // (tile_size.h PagedBoxRows) from the key-row table, so the same holds up to a box's end; a box past the length
    // gets zeros.
    if constexpr (kTmaStages) {
      if (tid == 0 && tiles > 0) {  // (no K/V rows: no maps)
        PrefetchTensorMap(&a.k_map);
        PrefetchTensorMap(&a.v_map);
        for (int stage = 0; stage < kStages; ++stage) MbarrierInit(sm.Full(stage), 2);  // k's and v's copies
        FenceMbarrierInit();  // before any copy names a barrier; the pass's first barrier publishes the inits
      }
    }
    // Bit `stage` of `phases`: the parity of the phase of the stage's barrier that its next tile completes.
    uint32_t phases = 0;
    // paged_attention's contract: a sequence that uses a page id outside the pool gets NaN in every output (its reads
    // clamped meanwhile). The splits of a row block share the check: each checks the pages of its share of the
    // sequence's keys, [split, split + 1) x tiles_per_split tiles, those of the tiles it reads as it looks up their rows
    // and the rest (keys no row of the CTA sees: a window) before its epilogue; a split's NaN lse makes the combine's
    // rows NaN, and one split checks every page. So a call reads no page-table entry but its look-ups, and no copy waits
    // on a check (that wait, and its barrier, came before the first copy).
    bool page_outside_pool = false;
    // The key-row table of the pass's i-th tile, each key's page checked: one thread per key (call with tid < kBlockN).
    // Paged calls only: a contiguous call's rows follow from the key (below), with no table to write, read and wait for.
    auto look_up_rows = [&](int i, int key_in_tile) {
      const int key = (tile_begin + i) * kBlockN + key_in_tile;
      int row = -1;
      if (key < len.kv_len) {
        const int32_t entry = key_rows.PageEntry(rb.b, key);
        page_outside_pool |= !key_rows.EntryInPool(entry);
        row = static_cast<int>(key_rows.RowInPage(entry, key));
      }
      sm.KeyRows(i)[key_in_tile] = row;
      if (descale_per_key) {  // the page's pair (its id clamped as the row's); a key past the length: zeros
        const int page = row / static_cast<int>(a.page_size);
        sm.Descales(i)[key_in_tile] = row < 0 ? make_float2(0.0f, 0.0f)
                                              : make_float2(a.kv_descales.K(page, rb.kv_head),
                                                            a.kv_descales.V(page, rb.kv_head));
      }
    };
    // The pages of keys [key_begin, key_end), a thread each.
    auto check_pages_of_keys = [&](int key_begin, int key_end) {
      for (int j = key_begin / a.page_size + tid; j * a.page_size < key_end; j += kThreads) {
        page_outside_pool |= !key_rows.PageInPool(rb.b, j);
      }
    };
    // The pass's i-th tile into its stage.
    auto load = [&](int i) {
      const int stage = i % kStages;
      if constexpr (kTmaStages) {
        // Warp 0's lanes copy the stage box by box (the stage tiles seen as the sm90 family's: the same layout), lane r
        // box r from its first key's row: a contiguous call's one 64-row box from the tile's first key in its batch
        // entry, a paged call's boxes within a page from the key-row table (a key past the length: a row past the
        // pool, zeros).
        if (warp == 0) {
          // lane through an empty asm, the entry from blockIdx: what follows is computed here, not kept live through
          // the main loop (which spilled at d 128 with four row tiles).
          int box_lane = lane;
          asm volatile("" : "+r"(box_lane));
          const int box_rows = paged ? PagedBoxRows(a.page_size) : kBlockN;
          int row = (tile_begin + i) * kBlockN, b = static_cast<int>(blockIdx.z);
          if (paged) {
            row = sm.KeyRows(i)[min(box_lane * box_rows, kBlockN - 1)];
            if (row < 0) row = static_cast<int>(a.num_pages * a.page_size);
            b = 0;
          }
          LoadTileBoxes(SwizzledTile<kBlockN, KTile::kCols>{SmemAddress(sm.K(stage).data)}, &a.k_map,
                        sm.Full(stage), rb.kv_head, row, b, box_rows, box_lane);
          LoadTileBoxes(SwizzledTile<kBlockN, VTile::kCols>{SmemAddress(sm.V(stage).data)}, &a.v_map,
                        sm.Full(stage), rb.kv_head, row, b, box_rows, box_lane);
        }
      } else if (paged) {
        const int* table = sm.KeyRows(i);
        const auto row_of = [table](int r) { return table[r]; };
        AsyncLoadKeys<kThreads>(sm.K(stage), k, row_of, k_stride, rb.kv_head * kKCols, kKCols, tid);
        AsyncLoadKeys<kThreads>(sm.V(stage), v, row_of, v_stride, rb.kv_head * kVCols, kVCols, tid);
      } else {
        // Consecutive rows, each thread's source one pointer that moves a fixed number of rows a chunk. tid through an
        // empty asm, as in AsyncLoadKeys: the chunks' offsets are computed here, not kept live through the main loop.
        int copy_tid = tid;
        asm volatile("" : "+r"(copy_tid));
        const int key0 = (tile_begin + i) * kBlockN;
        const int first_row = static_cast<int>(key_rows.Row(rb.b, key0)), end_row = first_row + len.kv_len - key0;
        sm.K(stage).template AsyncLoad<kThreads>(k + rb.kv_head * kKCols, k_stride, first_row, end_row, kKCols,
                                                 copy_tid);
        sm.V(stage).template AsyncLoad<kThreads>(v + rb.kv_head * kVCols, v_stride, first_row, end_row, kVCols,
                                                 copy_tid);
      }
    };
    // A tile's table is written kRowsLead tiles before the tile is multiplied: its copies, the first to read it, are
    // issued a barrier later.
    constexpr int kRowsLead = kKeyRowSlots - 1;

    Variant variant;  // its slope is set per row (the row's head)
    variant.scale = s.scale;
    variant.cap = s.softcap;
    variant.slope = 0.0f;
    // As in the sm80 forward: the plain scaled dot product keeps raw q.k and folds the scale into the exp2 FMA. (FP8:
    // with q's power of two and k's descale, once q is converted.)
    constexpr bool kRawScores = !Variant::kHasSoftcap && !Variant::kHasAlibi;
    float log2_scale = kRawScores ? s.scale * kLog2e : kLog2e;

    float o[1][kDvP / 8][4];
    OnlineSoftmax<kSliceN / 8> softmax;
    const int2* warp_ranges = sm.Ranges() + row_tile * 16;
    // FP8: P is packed to f16 as p * kPScale, times v descale / v_unit where the descales multiply the probabilities
    // (probabilities down to 2^-29 stay normal f16 numbers, the largest 2^15 < 65504), so o holds the output in units
    // of v_unit / kPScale. v_unit is the CTA's finite v descale, 1 for a non-finite one, or with per-key descales the
    // power of two just above the largest finite |descale| of the warp's keys in the last tile that had one (each
    // tile's ratio to the previous, exact and clamped to float's range, folding into o's rescale), which keeps every
    // packed value at most kPScale (for descales below 2^127).
    constexpr float kPScale = 32768.0f;
    float v_unit = 1.0f;

    auto pass = [&](auto careful) {
      constexpr bool kCareful = decltype(careful)::kValue;
      softmax.Reset();
      ZeroFragments(o);
      v_unit = values_times_descale ? 1.0f : v_descale;
      if (paged) {
        for (int c = tid; c < kRowsLead * kBlockN; c += kThreads) {
          if (c / kBlockN < tiles) look_up_rows(c / kBlockN, c % kBlockN);
        }
      }
      __syncthreads();  // the first tables, and (first pass) each row's key range, position and slope
#pragma unroll
      for (int i = 0; i < kStages - 1; ++i) {
        if (i < tiles) load(i);
        CpAsyncCommit();
      }
      if constexpr (kFp8 && !kCareful) {  // q to f16 while the first tiles land (the careful pass finds it so)
        CpAsyncWait<kStages - 1>();         // q's copies: the oldest group
        __syncthreads();
        const float q_unit = __int_as_float((127 + ConvertQ(sm, tid)) << 23);  // 2^e
        const float logit_unit = q_unit * (scores_times_descale ? 1.0f : k_descale);
        variant.scale = s.scale * logit_unit;
        if constexpr (kRawScores) log2_scale *= logit_unit;
      }
      for (int i = 0; i < tiles; ++i) {
        const int stage = i % kStages;
        if constexpr (kTmaStages) {
          MbarrierWait(sm.Full(stage), phases >> stage & 1u);
          phases ^= 1u << stage;
        }
        CpAsyncWait<kStages - 2>();  // (with TMA: the q tile's group)
        __syncthreads();  // tile i landed for everyone, and everyone is done with the stage the next load overwrites
        if (i + kStages - 1 < tiles) load(i + kStages - 1);
        CpAsyncCommit();
        if (paged && tid < kBlockN && i + kRowsLead < tiles) look_up_rows(i + kRowsLead, tid);
        const int tile = tile_begin + i, n0 = tile * kBlockN, key0 = n0 + slice * kSliceN;
        const bool interior = tile >= full_begin && tile < full_end;
        if constexpr (kCareful) {
          if (!interior && __syncthreads_or(ThreadSeesNonFinite<KvElement, kThreads>(sm.V(stage), tid))) {
            PoisonColumnsOfNonFiniteValues<KvElement>(o, warp_ranges, sm.V(stage), n0, key0, key0 + kSliceN, g, t,
                                                      [](int, int) { return true; });
            __syncthreads();  // every warp has read the values before they are zeroed
            ZeroNonFinite<KvElement, kThreads>(sm.V(stage), tid);
            FenceSharedForAsyncProxy();  // the zeroes before a later TMA copy overwrites the stage
            __syncthreads();
          }
        }
        const KTile k_slice{sm.K(stage).data + slice * kSliceN * KTile::kPitch};
        const VTile v_slice{sm.V(stage).data + slice * kSliceN * VTile::kPitch};

        float sc[1][kSliceN / 8][4];
        ZeroFragments(sc);
        WarpGemmABt<Product, 1, kDP, kSliceN>(sc, sm.Q(), row_tile * 16, KOperand{k_slice}, lane);
        // FP8 with per-key descales: this warp's keys' pairs (their column c of n8 block j: [8 j + c]).
        const float2* key_descales = sm.Descales(i) + slice * kSliceN + 2 * t;
        if (kFp8 && scores_times_descale) {
#pragma unroll
          for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float descale = descale_per_key ? key_descales[j * 8 + c].x : k_descale;
              sc[0][j][c] *= descale;
              sc[0][j][2 + c] *= descale;
            }
        }
        if (!kRawScores || !interior) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int local = row_tile * 16 + g + 8 * r;
            const int2 keys = sm.Ranges()[local];
            if constexpr (Variant::kHasAlibi) variant.slope = sm.Slopes()[local];  // the row's head's
            const int position = sm.Positions()[local];
#pragma unroll
            for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int col = key0 + j * 8 + 2 * t + c;
                float logit = sc[0][j][2 * r + c];
                if constexpr (!kRawScores) logit = variant.Logit(logit, position, col);
                sc[0][j][2 * r + c] = interior || (col >= keys.x && col < keys.y) ? logit : -__int_as_float(0x7f800000);
              }
          }
        }
        float rescale[2];
        softmax.Update(sc[0], log2_scale, rescale);
        if constexpr (kFp8) {
          if (descale_per_key) {
            float largest = 0.0f;
#pragma unroll
            for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const float descale = fabsf(key_descales[j * 8 + c].y);
                if (descale <= kFloatMax) largest = fmaxf(largest, descale);
              }
            largest = QuadMax(largest);
            if (largest > 0.0f) {
              const float unit = PowerOfTwoAbove(largest);
              const float ratio = fminf(v_unit / unit, kFloatMax);
              rescale[0] *= ratio;
              rescale[1] *= ratio;
              v_unit = unit;
            }
          }
          const float inv_unit = 1.0f / v_unit;  // (2^-127 at least: kPScale / v_unit could overflow)
#pragma unroll
          for (int j = 0; j < kSliceN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float descale = descale_per_key ? key_descales[j * 8 + c].y : v_descale;
              const float factor = values_times_descale ? descale * inv_unit * kPScale : kPScale;
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const float p = sc[0][j][2 * r + c];
                sc[0][j][2 * r + c] = p > 0.0f ? p * factor : p;
              }
            }
        }
#pragma unroll
        for (int j = 0; j < kDvP / 8; ++j) {
          o[0][j][0] *= rescale[0];
          o[0][j][1] *= rescale[0];
          o[0][j][2] *= rescale[1];
          o[0][j][3] *= rescale[1];
        }
#pragma unroll
        for (int kk = 0; kk < kSliceN / 16; ++kk) {
          uint32_t p[1][4];
          PackAFragment<Product>(sc[0], kk, p[0]);
          WarpMmaRegA<Product, 1, kDvP>(o, p, VOperand{v_slice}, kk * 16, 0, kDvP, lane);
        }
      }
      CpAsyncWait<0>();
    };

    pass(BoolConstant<false>{});
    const bool straddles = tiles > 0 && (!span.all_rows_valid || full_begin > tile_begin || full_end < tile_end);
    // The barrier also keeps the careful pass's first loads from overwriting a stage another warp still reads.
    if (straddles && __syncthreads_or(AnyNaN(o) || softmax.AnyNaN())) pass(BoolConstant<true>{});
    if (paged) {
      const int share_begin = rb.split * a.tiles_per_split * kBlockN;
      const int share_end = min(len.kv_len, (rb.split + 1) * a.tiles_per_split * kBlockN);
      if (tiles > 0) {
        check_pages_of_keys(share_begin, tile_begin * kBlockN);
        check_pages_of_keys(tile_end * kBlockN, share_end);
      } else {
        check_pages_of_keys(share_begin, share_end);
      }
    }
    // The barrier also frees the rings for the epilogue.
    const bool poisoned = __syncthreads_or(page_outside_pool) || len.invalid;
    AllowNextGrid();  // the combine, launched as a dependent, may start; it waits for this grid's partials
    Epilogue(a, sm, rb, poisoned, o, kFp8 ? v_unit / kPScale : 1.0f, softmax, warp, g, t, tid);
  }

  // FP8: q to f16 in place, for the f16 products: each 16-column chunk in the order the K fragments take
  // (PermutedChunkWord, primitives/fp8_tile.h), times 2^-e, e putting the CTA's largest |q| in [2^14, 2^15) (a bf16 q
  // may exceed f16's range, and a small one would lose bits to f16's subnormals; a power of two changes no other bit).
  // e follows the largest finite |q| (inf and NaN stay so whatever e is, and reach the logits as they would); 0 where
  // every q is 0 or non-finite. Every thread calls it once q has landed.
  static __device__ __forceinline__ int ConvertQ(const Smem& sm, int tid) {
    constexpr int kChunksPerRow = kDP / 16;
    const auto chunk = [&](int c) {
      return reinterpret_cast<uint4*>(sm.Q().At(c / kChunksPerRow, c % kChunksPerRow * 16));
    };
    // The magnitudes' bits of 16-bit floats order as their values, inf and NaN from kExponentBits up.
    const auto finite = [](uint32_t magnitude) { return magnitude < Element::kExponentBits ? magnitude : 0u; };
    unsigned largest = 0;
    for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
      const uint4* x = chunk(c);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t words[4] = {x[h].x, x[h].y, x[h].z, x[h].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          largest = max(largest, max(finite(words[w] & 0x7FFFu), finite(words[w] >> 16 & 0x7FFFu)));
        }
      }
    }
    largest = __reduce_max_sync(0xffffffffu, largest);
    if ((tid & 31) == 0) atomicMax(sm.QMax(), largest);
    __syncthreads();
    const float magnitude = Element::ToFloat(static_cast<uint16_t>(*sm.QMax()));
    const int e = magnitude > 0.0f ? max((__float_as_int(magnitude) >> 23) - 127 - 14, -126) : 0;
    const float down = __int_as_float((127 - e) << 23);
    for (int c = tid; c < kRows * kChunksPerRow; c += kThreads) {
      uint4* x = chunk(c);
      const uint32_t in[8] = {x[0].x, x[0].y, x[0].z, x[0].w, x[1].x, x[1].y, x[1].z, x[1].w};
      uint32_t out[8];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const uint32_t w = in[PermutedChunkWord(u)];
        out[u] = Float16::Pack(Element::ToFloat(static_cast<uint16_t>(w)) * down,
                               Element::ToFloat(static_cast<uint16_t>(w >> 16)) * down);
      }
      x[0] = make_uint4(out[0], out[1], out[2], out[3]);
      x[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
    return e;
  }

  // Merges the warps' softmax states row by row and writes the CTA's rows: out and lse when the call has one split,
  // else the split's partial output and lse for combine.cuh. A poisoned entry (invalid lengths, pages outside the
  // pool) gets NaN; a split's partial says so by a NaN lse, which the combine's merge carries to out and lse. o's
  // values are in units of o_unit (FP8: its v descales' and P's scale), and its columns as FragmentColumn says.
  static __device__ __forceinline__ void Epilogue(const DecodeArgs& a, const Smem& sm, const RowBlock& rb,
                                                  bool poisoned, const float (&o)[1][kDvP / 8][4], float o_unit,
                                                  const OnlineSoftmax<kSliceN / 8>& softmax, int warp, int g, int t,
                                                  int tid) {
    const ShapeArgs& s = a.args.shape;
    float* part = sm.PartialOut(warp);
#pragma unroll
    for (int j = 0; j < kDvP / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        part[(g + 8 * (e >> 1)) * kPitch + FragmentColumn<KvElement>(j, 2 * t + (e & 1))] = o[0][j][e] * o_unit;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = QuadSum(softmax.sum[r]);
      if (t == 0) {
        sm.PartialMax()[warp * 16 + g + 8 * r] = softmax.max[r];
        sm.PartialSum()[warp * 16 + g + 8 * r] = sum;
      }
    }
    __syncthreads();

    // Row r of the CTA is row r % 16 of the warps (r / 16) + kRowTiles * slice. Maxima are in log2 units; a warp that
    // saw no key of the row (max -inf) weighs 0.
    const bool direct = a.splits == 1;
    for (int r = tid; r < kRows; r += kThreads) {
      float m = -__int_as_float(0x7f800000);
#pragma unroll
      for (int sl = 0; sl < kKeySlices; ++sl) m = fmaxf(m, sm.PartialMax()[(r / 16 + kRowTiles * sl) * 16 + r % 16]);
      float l = 0.0f;
#pragma unroll
      for (int sl = 0; sl < kKeySlices; ++sl) {
        const int w = (r / 16 + kRowTiles * sl) * 16 + r % 16;
        const float weight = sm.PartialMax()[w] == -__int_as_float(0x7f800000) ? 0.0f : Exp2(sm.PartialMax()[w] - m);
        sm.Weights()[r * kKeySlices + sl] = weight;
        l += weight * sm.PartialSum()[w];
      }
      // One split: the sm80 forward's Finish (a row that sees keys and sums to 0, from -inf logits, gives 0 * inf).
      // A split's partial: a row none of whose keys are in the split (or all -inf) is an empty part, 0 and -inf.
      const int2 keys = sm.Ranges()[r];
      const bool empty = direct ? keys.x >= keys.y : l == 0.0f;
      float inv_sum = empty ? 0.0f : 1.0f / l;
      float lse = empty ? -__int_as_float(0x7f800000) : m * kLn2 + logf(l);
      // Sinks join the finished rows only (with splits, combine.cuh's).
      if (direct && a.args.sinks != nullptr && rb.Valid(r)) {
        MergeSink(a.args.sinks[static_cast<int64_t>(rb.b) * s.num_heads + rb.Head(r)], lse, inv_sum);
      }
      sm.InvSum()[r] = inv_sum;
      sm.Lse()[r] = lse;
    }
    __syncthreads();

    for (int e = tid; e < kRows * (kDv / 2); e += kThreads) {
      const int r = e / (kDv / 2), col = e % (kDv / 2) * 2;
      if (!rb.Valid(r)) continue;
      float x[2] = {0.0f, 0.0f};
#pragma unroll
      for (int sl = 0; sl < kKeySlices; ++sl) {
        const float weight = sm.Weights()[r * kKeySlices + sl];
        const float* src = sm.PartialOut(r / 16 + kRowTiles * sl) + (r % 16) * kPitch + col;
        x[0] += weight * src[0];
        x[1] += weight * src[1];
      }
      const float inv = sm.InvSum()[r];
      const int64_t row = (static_cast<int64_t>(rb.b) * s.seqlen_q + rb.Position(r)) * s.num_heads + rb.Head(r);
      if (direct) {
        const uint32_t packed = poisoned ? kPackedNaN : Element::Pack(x[0] * inv, x[1] * inv);
        *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(a.args.out) + row * kDv + col) = packed;
      } else {
        const int64_t split_row = static_cast<int64_t>(rb.split) * s.batch * s.seqlen_q * s.num_heads + row;
        *reinterpret_cast<float2*>(a.partial_out + split_row * kDv + col) = make_float2(x[0] * inv, x[1] * inv);
      }
    }
    for (int r = tid; r < kRows; r += kThreads) {
      if (!rb.Valid(r)) continue;
      const int64_t lse_row = (static_cast<int64_t>(rb.b) * s.num_heads + rb.Head(r)) * s.seqlen_q + rb.Position(r);
      const float lse = poisoned ? __int_as_float(0x7fffffff) : sm.Lse()[r];
      if (direct) {
        a.args.lse[lse_row] = lse;
      } else {
        a.partial_lse[static_cast<int64_t>(rb.split) * s.batch * s.num_heads * s.seqlen_q + lse_row] = lse;
      }
    }
  }
};

}  // namespace te_jax::cuda::decode
