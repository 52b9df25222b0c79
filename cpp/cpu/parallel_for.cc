#include "cpp/cpu/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace te_jax::cpu {
namespace {

struct LoopState {
  explicit LoopState(int64_t n, const std::function<void(int64_t)>* body) : n(n), body(body) {}
  const int64_t n;
  const std::function<void(int64_t)>* body;  // valid until `done` reaches n
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Drain() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      (*body)(i);
      if (done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

class ThreadPoolScheduler final : public TaskScheduler {
 public:
  explicit ThreadPoolScheduler(int64_t num_threads) {
    for (int64_t t = 0; t < num_threads; ++t) workers_.emplace_back([this] { Work(); });
  }
  ~ThreadPoolScheduler() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  int64_t NumThreads() const override { return static_cast<int64_t>(workers_.size()) + 1; }
  void Schedule(std::function<void()> task) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    wake_.notify_one();
  }

 private:
  void Work() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

void ParallelFor(TaskScheduler* scheduler, int64_t n, const std::function<void(int64_t)>& body) {
  if (n <= 0) return;
  auto state = std::make_shared<LoopState>(n, &body);
  const int64_t helpers = scheduler ? std::min<int64_t>(scheduler->NumThreads(), n) - 1 : 0;
  for (int64_t t = 0; t < helpers; ++t) scheduler->Schedule([state] { state->Drain(); });
  state->Drain();
  std::unique_lock<std::mutex> lock(state->mu);
  state->all_done.wait(lock, [&] { return state->done.load() == n; });
}

TaskScheduler* DefaultTaskScheduler() {
  static ThreadPoolScheduler* pool = [] {
    const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
    return new ThreadPoolScheduler(cores - 1);  // leaked on purpose: joining threads at exit races with XLA's teardown
  }();
  return pool;
}

}  // namespace te_jax::cpu
