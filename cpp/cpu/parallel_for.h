// A work-sharing loop for the CPU backend that borrows threads from whoever owns them (XLA's intra-op pool on the FFI
// path, te_jax's own pool on the legacy path) instead of starting its own, so the two never oversubscribe the cores.
#pragma once

#include <cstdint>
#include <functional>

namespace te_jax::cpu {

class TaskScheduler {
 public:
  virtual ~TaskScheduler() = default;
  virtual int64_t NumThreads() const = 0;
  virtual void Schedule(std::function<void()> task) = 0;
};

// Runs body(i) for every i in [0, n). The calling thread takes items too, so the loop completes even when every pool
// thread is busy (XLA may call a handler from a pool thread); tasks that start after the loop finished find no work.
void ParallelFor(TaskScheduler* scheduler, int64_t n, const std::function<void(int64_t)>& body);

// A process-wide pool of hardware_concurrency() - 1 threads, started on first use, for callers that have no pool.
TaskScheduler* DefaultTaskScheduler();

}  // namespace te_jax::cpu
