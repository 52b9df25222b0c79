// Packed rows read as documents: one CTA derives the document table (layout in cpp/cuda/kernel_args.h) from the
// segment ids, so the sm90 forward's document kernel runs a packed row as the batch of its documents would run: each
// work one document's block of query rows against that document's keys alone (DocumentBlockOf), the tiles inside it
// without a per-element id test, the works longest first over every (batch entry, document). The reading holds, and
// the table's flag says so, only where the ids say what it assumes; otherwise the token kernel serves the call:
//   * the keys are the queries' tokens: Sq = Skv, kv ids = q ids and kv positions = q positions;
//   * each document is one run of equal ids: every run's nonzero id exceeds each nonzero id before it in the row (ids
//     that rise, runs of padding id 0 anywhere);
//   * with positions, they count up by one within each run (a mask on them is then the mask on the indices).
// Every pass is spread over the CTA's threads: the runs (each thread a few neighbouring tokens, a CTA-wide scan giving
// each run its index, the checks), the works per run (a scan giving each run its first work), each work found by a
// binary search over those and counted by its key tiles, then written at its place in the descending order (a counting
// sort on the tile count).
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
  static constexpr int kTokensPerThread = 8;  // neighbouring tokens, their loads in flight together
  static constexpr int kTile = kThreads * kTokensPerThread;
  static constexpr int kBuckets = 1024;       // the sort key, a work's key tiles, clamped to kBuckets - 1

  struct Shared {
    int ok;
    int warp_totals[kThreads / 32];
    int2 run_totals[kThreads / 32];  // FindRuns' scan
    int buckets[kBuckets];
  };

  static __device__ __forceinline__ int Max(int a, int b) { return a > b ? a : b; }
  struct AddOp {
    __device__ __forceinline__ int operator()(int a, int b) const { return a + b; }
  };
  // A tile's runs and largest nonzero id, scanned together.
  struct RunsOp {
    __device__ __forceinline__ int2 operator()(int2 a, int2 b) const { return make_int2(a.x + b.x, Max(a.y, b.y)); }
  };

  struct Tables {
    int32_t* header;
    int4* entries;
    int32_t* run_first;  // b x S + i of each run's first token
    int32_t* run_works;  // each run's first work; [runs]: the works
    int4* unsorted;      // the works in run order
  };

  // Pass one: the runs of equal ids of every row, their first tokens written in order; false where a check fails.
  static __device__ __forceinline__ bool FindRuns(const ShapeArgs& s, const TokenArgs& t, const Tables& tb,
                                                  Shared& sh, int& runs) {
    const int seqlen = s.seqlen_q;
    bool ok = true;
    runs = 0;
    for (int b = 0; b < s.batch; ++b) {
      const int64_t row = static_cast<int64_t>(b) * seqlen;
      const int32_t* ids = t.q_ids + row;
      const int32_t* kv_ids = t.kv_ids + row;
      const int32_t* pos = t.q_pos != nullptr ? t.q_pos + row : nullptr;
      const int32_t* kv_pos = t.kv_pos != nullptr ? t.kv_pos + row : nullptr;
      int id_max_before = kTokenMin;  // the largest nonzero id of the row's earlier tiles
      for (int t0 = 0; t0 < seqlen; t0 += kTile) {
        const int i0 = t0 + threadIdx.x * kTokensPerThread;
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
        int2 tile;
        const int2 earlier = BlockExclusiveScan<kThreads>(make_int2(count, id_max), make_int2(0, kTokenMin),
                                                          RunsOp{}, sh.run_totals, tile);
        int run = runs + earlier.x;
        int before = Max(id_max_before, earlier.y);
#pragma unroll
        for (int e = 1; e <= kTokensPerThread; ++e) {
          const int i = i0 - 1 + e;
          if (i >= seqlen) break;
          if (i == 0 || id[e - 1] != id[e]) {
            ok &= id[e] == 0 || id[e] > before;
            tb.run_first[run++] = static_cast<int>(row) + i;
          }
          if (id[e] != 0) before = Max(before, id[e]);
        }
        runs += tile.x;
        id_max_before = Max(id_max_before, tile.y);
      }
    }
    return ok;
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
    const DocumentTableLayout layout = DocumentTableLayout::Of(s.batch, seqlen);
    const Tables tb{t.documents, reinterpret_cast<int4*>(t.documents + layout.entries), t.documents + layout.run_first,
                    t.documents + layout.run_works, reinterpret_cast<int4*>(t.documents + layout.unsorted)};
    if (tid == 0) {
      sh.ok = s.seqlen_kv == seqlen && t.q_ids != nullptr;
      tb.header[2] = 0;  // the forward document kernel's work counter (kernel_args.h)
    }
    for (int k = tid; k < kBuckets; k += kThreads) sh.buckets[k] = 0;
    __syncthreads();
    const bool ids_given = sh.ok;
    int runs = 0;
    const bool ok = ids_given && FindRuns(s, t, tb, sh, runs);  // (every thread or none: the scans' barriers)
    if (!ok) sh.ok = 0;
    __syncthreads();  // the runs are written; every thread's checks are in
    if (!sh.ok) {
      if (tid == 0) tb.header[0] = tb.header[1] = 0;
      return;
    }
    const int works = CountWorks(tb, sh, runs, seqlen);
    __syncthreads();  // the runs' first works are written
    if (kKeyBlocks && works > DocumentWorksOfGrid(s.batch, seqlen, kBlockM)) {
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
    static_assert(kBuckets == kThreads, "a bucket per thread");
    const int bucket = kBuckets - 1 - tid;  // scanned from the most tiles down
    int unused;
    const int slot = BlockExclusiveScan<kThreads>(sh.buckets[bucket], 0, AddOp{}, sh.warp_totals, unused);
    sh.buckets[bucket] = slot;
    __syncthreads();  // the slots are set; the unsorted works are written

    // Pass four: each work at its count's next slot.
    for (int w = tid; w < works; w += kThreads) {
      const int4 entry = tb.unsorted[w];
      tb.entries[atomicAdd(&sh.buckets[SortKey(s, t, entry)], 1)] = entry;
    }
    if (tid == 0) {
      tb.header[0] = 1;
      tb.header[1] = works;
    }
  }
};

}  // namespace te_jax::cuda
