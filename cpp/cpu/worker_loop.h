// ParallelFor with worker identities: items are handed out in order to at most NumThreads() workers, and a worker id
// is held by one thread at a time, so a body may keep per-worker state (scratch tiles, a private dQ accumulator)
// indexed by it without locks.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>

#include "cpp/cpu/parallel_for.h"

namespace te_jax::cpu {

inline int64_t NumWorkers(TaskScheduler* scheduler, int64_t items) {
  const int64_t threads = scheduler ? scheduler->NumThreads() : 1;
  return std::max<int64_t>(1, std::min(threads, items));
}

inline void ParallelForWorkers(TaskScheduler* scheduler, int64_t items, int64_t workers,
                               const std::function<void(int64_t worker, int64_t item)>& body) {
  std::atomic<int64_t> next{0};
  ParallelFor(scheduler, workers, [&](int64_t worker) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      body(worker, i);
    }
  });
}

}  // namespace te_jax::cpu
