// Packed rows read as documents: the table kernel derives the document table (layout in cpp/cuda/kernel_args.h) from
// the segment ids, so the sm90 document kernels run a packed row as the batch of its documents would run: each work
// one document's block of rows against that document's rows alone (DocumentBlockOf), the tiles inside it without a
// per-element id test, the works longest first over every (batch entry, document). The reading holds, and the table's
// flag says so, only where the ids say what it assumes; otherwise the token kernels serve the call:
//   * the keys are the queries' tokens: Sq = Skv, kv ids = q ids and kv positions = q positions;
//   * each document is one run of equal ids: every run's nonzero id exceeds each nonzero id before it in the row (ids
//     that rise, runs of padding id 0 anywhere);
//   * with positions, they count up by one within each run (a mask on them is then the mask on the indices).
// A CTA per chunk of kDocumentTableChunk tokens of a row finds the chunk's runs (each thread a few neighbouring tokens,
// a CTA-wide scan giving each run its index in the chunk, the checks) and leaves them with the chunk's summary; the
// last CTA to finish (a counter in the header) joins the chunks (a scan of their runs, the checks across them) and
// orders the works: each run's first work (a scan of their blocks), each work found by a binary search over those and
// counted by its key tiles, then written at its place in the descending order (a counting sort on the tile count). The
// chunks spread over the GPU what one CTA did in turn: that CTA's time was its instructions issued.
#pragma once

#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/token_mask.h"
#include "cpp/cuda/kernels/primitives/block_scan.h"

namespace te_jax::cuda {

// The forward's works are blocks of kBlockM query rows, sorted by their key tiles of kBlockN; the backward's
// (kKeyBlocks) blocks of kBlockM keys, sorted by their query steps of kBlockN rows, and at most the works its grid has
// room for (DocumentWorksOfGrid; more leave the call to the token tables).
template <int kBlockM, int kBlockN, bool kKeyBlocks = false, typename Args = ForwardArgs>
struct DocumentTableKernel {
  static constexpr int kThreads = kDocumentTableThreads;
  // Neighbouring tokens per thread, their loads in flight together.
  static constexpr int kTokensPerThread = kDocumentTableChunk / kThreads;
  static constexpr int kBuckets = 1024;  // the sort key, a work's key tiles, clamped to kBuckets - 1
  static constexpr int kBucketsPerThread = kBuckets / kThreads;
  static_assert(kTokensPerThread * kThreads == kDocumentTableChunk && kBucketsPerThread * kThreads == kBuckets);

  struct Shared {
    int ok;
    int last;  // this CTA finished last
    int min_start;
    int warp_totals[kThreads / 32];
    int2 pair_totals[kThreads / 32];
    int buckets[kBuckets];
  };

  static __device__ __forceinline__ int Max(int a, int b) { return a > b ? a : b; }
  struct AddOp {
    __device__ __forceinline__ int operator()(int a, int b) const { return a + b; }
  };
  // A chunk's runs and largest nonzero id, scanned together.
  struct RunsOp {
    __device__ __forceinline__ int2 operator()(int2 a, int2 b) const { return make_int2(a.x + b.x, Max(a.y, b.y)); }
  };
  // The largest nonzero id of the chunks before, within a row: {row, id}, restarting at each row; row -1 is the
  // identity.
  struct RowMaxOp {
    __device__ __forceinline__ int2 operator()(int2 a, int2 b) const {
      return b.x == -1 ? a : a.x == b.x ? make_int2(b.x, Max(a.y, b.y)) : b;
    }
  };

  struct Tables {
    int32_t* header;
    int4* entries;
    int32_t* run_first;  // b x S + i of each run's first token
    int32_t* run_works;  // each run's first work; [runs]: the works. Before: the chunks' runs, at their tokens' places
    int4* unsorted;      // the works in run order
    int4* chunks;        // each chunk's {runs (then its first run), largest nonzero id, smallest starting one, ok}
  };

  // A CTA's chunk: its runs' first tokens into run_works at the chunk's place, the checks within it, and its summary.
  static __device__ __forceinline__ void FindRuns(const ShapeArgs& s, const TokenArgs& t, const Tables& tb,
                                                  Shared& sh, int chunks_per_row) {
    const int seqlen = s.seqlen_q, b = static_cast<int>(blockIdx.x) / chunks_per_row;
    const int c0 = (static_cast<int>(blockIdx.x) - b * chunks_per_row) * kDocumentTableChunk;
    const int64_t row = static_cast<int64_t>(b) * seqlen;
    const int32_t* ids = t.q_ids + row;
    const int32_t* kv_ids = t.kv_ids + row;
    const int32_t* pos = t.q_pos != nullptr ? t.q_pos + row : nullptr;
    const int32_t* kv_pos = t.kv_pos != nullptr ? t.kv_pos + row : nullptr;
    bool ok = true;
    const int i0 = c0 + threadIdx.x * kTokensPerThread;
    int id[kTokensPerThread + 1], p[kTokensPerThread + 1];
#pragma unroll
    for (int e = 0; e <= kTokensPerThread; ++e) {  // id[0], p[0]: the token before i0
      const int i = i0 - 1 + e;
      const bool in = i >= 0 && i < seqlen;
      id[e] = in ? ids[i] : 0;
      p[e] = in && pos != nullptr ? pos[i] : 0;
      if (e > 0 && in) {
        ok &= kv_ids[i] == id[e];
        if (pos != nullptr) ok &= kv_pos[i] == p[e];
      }
    }
    int count = 0, id_max = kTokenMin;
#pragma unroll
    for (int e = 1; e <= kTokensPerThread; ++e) {
      const int i = i0 - 1 + e;
      if (i >= seqlen) break;
      const bool starts = i == 0 || id[e - 1] != id[e];
      if (!starts && pos != nullptr) ok &= static_cast<int64_t>(p[e]) == static_cast<int64_t>(p[e - 1]) + 1;
      count += starts;
      if (id[e] != 0) id_max = Max(id_max, id[e]);
    }
    int2 chunk;
    const int2 earlier = BlockExclusiveScan<kThreads>(make_int2(count, id_max), make_int2(0, kTokenMin), RunsOp{},
                                                      sh.pair_totals, chunk);
    int run = earlier.x, before = earlier.y, min_start = kTokenMax;
#pragma unroll
    for (int e = 1; e <= kTokensPerThread; ++e) {
      const int i = i0 - 1 + e;
      if (i >= seqlen) break;
      if (i == 0 || id[e - 1] != id[e]) {
        ok &= id[e] == 0 || id[e] > before;
        if (id[e] != 0) min_start = min(min_start, id[e]);
        tb.run_works[row + c0 + run++] = static_cast<int>(row) + i;
      }
      if (id[e] != 0) before = Max(before, id[e]);
    }
    if (!ok) sh.ok = 0;
    if (min_start != kTokenMax) atomicMin(&sh.min_start, min_start);
    __threadfence();  // the runs are in memory before the counter says this chunk is done
    __syncthreads();
    if (threadIdx.x == 0) {
      tb.chunks[blockIdx.x] = make_int4(chunk.x, chunk.y, sh.min_start, sh.ok);
      __threadfence();
      sh.last = atomicAdd(&tb.header[3], 1) == static_cast<int>(gridDim.x) - 1;
    }
    __syncthreads();
  }

  // The last CTA: each chunk's first run (its summary's runs replaced by it) and the checks across chunks (a chunk's
  // smallest starting id above every id of the row's chunks before it); then every run's first token in order into
  // run_first, each run found by a binary search over the chunks' first runs. Returns the runs, or -1 where a check
  // fails.
  static __device__ __forceinline__ int JoinChunks(const Tables& tb, Shared& sh, int chunks_per_row, int seqlen) {
    const int chunks = static_cast<int>(gridDim.x);
    bool ok = true;
    int runs = 0;
    int2 row_max = make_int2(-1, kTokenMin);  // the last chunk scanned so far: its row, the row's largest id to it
    for (int c0 = 0; c0 < chunks; c0 += kThreads) {
      const int c = c0 + threadIdx.x;
      const int4 sum = c < chunks ? __ldcg(&tb.chunks[c]) : make_int4(0, kTokenMin, kTokenMax, 1);
      const int row = c < chunks ? c / chunks_per_row : -1;
      int total;
      int2 last;
      const int first_run = runs + BlockExclusiveScan<kThreads>(sum.x, 0, AddOp{}, sh.warp_totals, total);
      int2 before = BlockExclusiveScan<kThreads>(make_int2(row, sum.y), make_int2(-1, kTokenMin), RowMaxOp{},
                                                 sh.pair_totals, last);
      before = RowMaxOp{}(row_max, before);
      ok &= sum.w != 0 && (sum.z == kTokenMax || before.x != row || sum.z > before.y);
      if (c < chunks) tb.chunks[c].x = first_run;
      runs += total;
      row_max = RowMaxOp{}(row_max, last);
    }
    if (!ok) sh.ok = 0;
    __syncthreads();  // the chunks' first runs are written; every check is in
    if (!sh.ok) return -1;
    for (int r = threadIdx.x; r < runs; r += kThreads) {
      int lo = 0, hi = chunks - 1;  // the last chunk whose first run is <= r: the one holding it
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (tb.chunks[mid].x <= r) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      const int b = lo / chunks_per_row;
      const int64_t at = static_cast<int64_t>(b) * seqlen + (lo - b * chunks_per_row) * kDocumentTableChunk;
      tb.run_first[r] = __ldcg(&tb.run_works[at + r - tb.chunks[lo].x]);
    }
    __syncthreads();  // run_first is written; run_works is free
    return runs;
  }

  // Run r's tokens [first, end) of batch entry b.
  static __device__ __forceinline__ void RunOf(const Tables& tb, int r, int runs, int seqlen, int& b, int& first,
                                               int& end) {
    const int at = tb.run_first[r];
    b = at / seqlen;
    first = at - b * seqlen;
    const int next = r + 1 < runs ? tb.run_first[r + 1] : -1;
    end = next >= 0 && next / seqlen == b ? next - b * seqlen : seqlen;
  }

  // Pass two: each run's first work (its blocks of kBlockM rows, the runs' before it summed); returns the works.
  static __device__ __forceinline__ int CountWorks(const Tables& tb, Shared& sh, int runs, int seqlen) {
    int works = 0;
    for (int r0 = 0; r0 < runs; r0 += kThreads) {
      const int r = r0 + threadIdx.x;
      int blocks = 0;
      if (r < runs) {
        int b, first, end;
        RunOf(tb, r, runs, seqlen, b, first, end);
        blocks = (end - first + kBlockM - 1) / kBlockM;
      }
      int total;
      const int before = BlockExclusiveScan<kThreads>(blocks, 0, AddOp{}, sh.warp_totals, total);
      if (r < runs) tb.run_works[r] = works + before;
      works += total;
    }
    if (threadIdx.x == 0) tb.run_works[runs] = works;
    return works;
  }

  // Work w's entry: the run holding it found by a binary search over the runs' first works.
  static __device__ __forceinline__ int4 WorkEntry(const TokenArgs& t, const Tables& tb, int w, int runs, int seqlen) {
    int lo = 0, hi = runs - 1;  // the last run whose first work is <= w
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tb.run_works[mid] <= w) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    int b, first, end;
    RunOf(tb, lo, runs, seqlen, b, first, end);
    const bool padding = t.q_ids[static_cast<int64_t>(b) * seqlen + first] == 0;
    return make_int4(b, first + (w - tb.run_works[lo]) * kBlockM, padding ? end : first, end);
  }

  static __device__ __forceinline__ int SortKey(const ShapeArgs& s, const TokenArgs& t, int4 entry) {
    const QueryBlockOfCta c = DocumentBlockOf<kBlockM, kBlockN>(s, t, entry, 0);
    int tiles = c.tile_end - c.tile_begin;
    if constexpr (kKeyBlocks) {
      const RowSpan rows = RowsOfKeys(c.mask, entry.y, entry.y + kBlockM);
      tiles = rows.end > rows.begin ? (rows.end + kBlockN - 1) / kBlockN - rows.begin / kBlockN : 0;
    }
    return min(max(tiles, 0), kBuckets - 1);
  }

  static __device__ __forceinline__ void Run(const Args& args) {
    __shared__ Shared sh;
    const ShapeArgs& s = args.shape;
    const TokenArgs& t = args.tokens;
    const int tid = threadIdx.x, seqlen = s.seqlen_q;
    const int chunks_per_row = (seqlen + kDocumentTableChunk - 1) / kDocumentTableChunk;
    const DocumentTableLayout layout = DocumentTableLayout::Of(s.batch, seqlen);
    const Tables tb{t.documents,
                    reinterpret_cast<int4*>(t.documents + layout.entries),
                    t.documents + layout.run_first,
                    t.documents + layout.run_works,
                    reinterpret_cast<int4*>(t.documents + layout.unsorted),
                    reinterpret_cast<int4*>(t.documents + layout.chunks)};
    if (s.seqlen_kv != seqlen || t.q_ids == nullptr) {  // (never launched so: DocumentTableBytes)
      if (blockIdx.x == 0 && tid == 0) tb.header[0] = tb.header[1] = 0;
      return;
    }
    if (tid == 0) {
      sh.ok = 1;
      sh.min_start = kTokenMax;
    }
    for (int k = tid; k < kBuckets; k += kThreads) sh.buckets[k] = 0;
    __syncthreads();
    FindRuns(s, t, tb, sh, chunks_per_row);
    if (!sh.last) return;
    const int runs = JoinChunks(tb, sh, chunks_per_row, seqlen);
    const int works = runs < 0 ? 0 : CountWorks(tb, sh, runs, seqlen);
    __syncthreads();  // the runs' first works are written
    if (runs < 0 || (kKeyBlocks && works > DocumentWorksOfGrid(s.batch, seqlen, kBlockM))) {
      if (tid == 0) tb.header[0] = tb.header[1] = 0;
      return;
    }

    // Pass three: each work's entry, counted by its key tiles; then each count's first slot, the longest first.
    for (int w = tid; w < works; w += kThreads) {
      const int4 entry = WorkEntry(t, tb, w, runs, seqlen);
      tb.unsorted[w] = entry;
      atomicAdd(&sh.buckets[SortKey(s, t, entry)], 1);
    }
    __syncthreads();
    int counts[kBucketsPerThread], sum = 0;  // this thread's buckets, scanned from the most tiles down
#pragma unroll
    for (int k = 0; k < kBucketsPerThread; ++k) {
      counts[k] = sh.buckets[kBuckets - 1 - (tid * kBucketsPerThread + k)];
      sum += counts[k];
    }
    int unused;
    int slot = BlockExclusiveScan<kThreads>(sum, 0, AddOp{}, sh.warp_totals, unused);
#pragma unroll
    for (int k = 0; k < kBucketsPerThread; ++k) {
      sh.buckets[kBuckets - 1 - (tid * kBucketsPerThread + k)] = slot;
      slot += counts[k];
    }
    __syncthreads();  // the slots are set; the unsorted works are written

    // Pass four: each work at its count's next slot.
    for (int w = tid; w < works; w += kThreads) {
      const int4 entry = tb.unsorted[w];
      tb.entries[atomicAdd(&sh.buckets[SortKey(s, t, entry)], 1)] = entry;
    }
    if (tid == 0) {
      tb.header[0] = 1;
      tb.header[1] = works;
      tb.header[2] = 0;  // the forward document kernel's work counter (kernel_args.h)
    }
  }
};

}  // namespace te_jax::cuda
