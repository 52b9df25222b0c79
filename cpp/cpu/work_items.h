// The items the CPU kernels' workers take (worker_loop.h), most expensive first.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace te_jax::cpu {

// A work item and its estimated cost: items run most expensive first, so the long causal rows do not end up alone on
// one thread at the end. `tile` is a Q tile (forward), a KV tile or, in the deterministic backward, a chunk of them.
struct WorkItem {
  int64_t batch, head, tile, cost;
};

inline void SortByCostDescending(std::vector<WorkItem>* items) {
  std::stable_sort(items->begin(), items->end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
}

}  // namespace te_jax::cpu
