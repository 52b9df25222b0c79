// Packed rows read as documents: one CTA derives the document table (layout in cpp/cuda/kernel_args.h) from the
// segment ids, so the sm90 forward's document kernel runs a packed row as the batch of its documents would run: each
// work one document's block of query rows against that document's keys alone (DocumentBlockOf), the tiles inside it
// without a per-element id test, the works longest first over every (batch entry, document). The reading holds, and
// the table's flag says so, only where the ids say what it assumes; otherwise the token kernel serves the call:
//   * the keys are the queries' tokens: Sq = Skv, kv ids = q ids and kv positions = q positions;
//   * each document is one run of equal ids: every run's nonzero id exceeds each nonzero id before it in the row (ids
//     that rise, runs of padding id 0 anywhere);
//   * with positions, they count up by one within each run (a mask on them is then the mask on the indices).
// Three passes over the rows: runs and checks (a scan gives each run its index), the works' key tiles counted per
// length, then each work written at its place in the descending order (a counting sort on the tile count).
#pragma once

#include "cpp/cuda/kernels/common/block_range.h"
#include "cpp/cuda/kernels/common/token_mask.h"
#include "cpp/cuda/kernels/primitives/block_scan.h"

namespace te_jax::cuda {

template <int kBlockM, int kBlockN>
struct DocumentTableKernel {
  static constexpr int kThreads = kDocumentTableThreads;
  static constexpr int kBuckets = 1024;  // the sort key, a work's key tiles, clamped to kBuckets - 1

  struct Shared {
    int ok;
    int warp_totals[kThreads / 32];
    int buckets[kBuckets];
  };

  static __device__ __forceinline__ int Max(int a, int b) { return a > b ? a : b; }

  // Calls f(entry, tiles) for every work of the table's documents (their starts and counts written by pass one).
  template <typename F>
  static __device__ __forceinline__ void ForEachWork(const ShapeArgs& s, const TokenArgs& t, const int32_t* starts,
                                                     const int32_t* runs, F&& f) {
    const int seqlen = s.seqlen_q;
    for (int b = 0; b < s.batch; ++b) {
      const int32_t* row_starts = starts + static_cast<int64_t>(b) * seqlen;
      for (int r = threadIdx.x; r < runs[b]; r += kThreads) {
        const int first = row_starts[r];
        const int end = r + 1 < runs[b] ? row_starts[r + 1] : seqlen;
        const bool padding = t.q_ids[static_cast<int64_t>(b) * seqlen + first] == 0;
        for (int m0 = first; m0 < end; m0 += kBlockM) {
          const int4 entry = make_int4(b, m0, padding ? end : first, end);
          const QueryBlockOfCta c = DocumentBlockOf<kBlockM, kBlockN>(s, t, entry, 0);
          f(entry, c.tile_end > c.tile_begin ? c.tile_end - c.tile_begin : 0);
        }
      }
    }
  }

  static __device__ __forceinline__ void Run(const ForwardArgs& args) {
    __shared__ Shared sh;
    const ShapeArgs& s = args.shape;
    const TokenArgs& t = args.tokens;
    const int tid = threadIdx.x, seqlen = s.seqlen_q;
    int32_t* table = t.documents;
    int4* entries = reinterpret_cast<int4*>(table + kDocumentTableHeaderInts);
    int32_t* starts = table + kDocumentTableHeaderInts + 4 * DocumentTableEntries(s.batch, seqlen);
    int32_t* runs = starts + static_cast<int64_t>(s.batch) * seqlen;
    if (tid == 0) sh.ok = s.seqlen_kv == seqlen && t.q_ids != nullptr;
    for (int k = tid; k < kBuckets; k += kThreads) sh.buckets[k] = 0;
    __syncthreads();
    if (!sh.ok) {
      if (tid == 0) table[0] = table[1] = 0;
      return;
    }

    // Pass one, a batch entry at a time: each thread a chunk of its tokens.
    const int chunk = (seqlen + kThreads - 1) / kThreads;
    const int lo = min(seqlen, tid * chunk), hi = min(seqlen, lo + chunk);
    bool ok = true;
    for (int b = 0; b < s.batch; ++b) {
      const int64_t row = static_cast<int64_t>(b) * seqlen;
      const int32_t* ids = t.q_ids + row;
      const int32_t* pos = t.q_pos != nullptr ? t.q_pos + row : nullptr;
      auto starts_run = [&](int i) { return i == 0 || ids[i - 1] != ids[i]; };
      int count = 0, id_max = kTokenMin;
      for (int i = lo; i < hi; ++i) {
        const int id = ids[i];
        ok &= t.kv_ids[row + i] == id;
        if (pos != nullptr) {
          ok &= t.kv_pos[row + i] == pos[i];
          if (!starts_run(i)) ok &= static_cast<int64_t>(pos[i]) == static_cast<int64_t>(pos[i - 1]) + 1;
        }
        count += starts_run(i);
        if (id != 0) id_max = Max(id_max, id);
      }
      int row_runs, unused;
      int run = BlockExclusiveScan<kThreads>(count, 0, [](int a, int c) { return a + c; }, sh.warp_totals, row_runs);
      int before = BlockExclusiveScan<kThreads>(id_max, kTokenMin, [](int a, int c) { return a > c ? a : c; },
                                                sh.warp_totals, unused);
      for (int i = lo; i < hi; ++i) {
        const int id = ids[i];
        if (starts_run(i)) {
          ok &= id == 0 || id > before;
          starts[row + run++] = i;
        }
        if (id != 0) before = Max(before, id);
      }
      if (tid == 0) runs[b] = row_runs;
    }
    if (!ok) sh.ok = 0;
    __syncthreads();  // the starts and counts are written; every thread's checks are in
    if (!sh.ok) {
      if (tid == 0) table[0] = table[1] = 0;
      return;
    }

    // Pass two: the works per key-tile count; then each count's first slot, the longest first.
    ForEachWork(s, t, starts, runs, [&](int4, int tiles) { atomicAdd(&sh.buckets[min(tiles, kBuckets - 1)], 1); });
    __syncthreads();
    static_assert(kBuckets == kThreads, "a bucket per thread");
    const int bucket = kBuckets - 1 - tid;  // scanned from the most tiles down
    int works;
    const int slot =
        BlockExclusiveScan<kThreads>(sh.buckets[bucket], 0, [](int a, int c) { return a + c; }, sh.warp_totals, works);
    sh.buckets[bucket] = slot;
    __syncthreads();

    // Pass three: each work at its count's next slot.
    ForEachWork(s, t, starts, runs, [&](int4 entry, int tiles) {
      entries[atomicAdd(&sh.buckets[min(tiles, kBuckets - 1)], 1)] = entry;
    });
    if (tid == 0) {
      table[0] = 1;
      table[1] = works;
    }
  }
};

}  // namespace te_jax::cuda
