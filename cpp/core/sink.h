// Attention sinks: one logit per head that joins every row's softmax denominator and carries no value,
// out_i = sum_j exp(s_ij) v_j / (exp(sink) + sum_j exp(s_ij)). The sink is a key set of its own whose lse is the sink
// and whose out is 0, so a finished row takes it in by lse, as te_jax.merge_states merges two parts:
// lse' = log(exp(lse) + exp(sink)), out' = out * exp(lse - lse'). Every forward (the CPU tile, each CUDA family, the
// decode combine) calls this on its finished rows, in float, before out is rounded to its dtype.
#pragma once

#include "cpp/core/host_device.h"

#if !defined(__CUDACC_RTC__)
#include <cmath>
#endif

namespace te_jax {

// `lse` (natural log) and `out_scale` (the factor the row's accumulator gets) of a finished row, merged with `sink`.
// A row that saw no key (lse -inf, out_scale 0) gets lse = sink and out 0; a sink of -inf changes nothing; a NaN in
// either makes both NaN, as the formula does (the kernels still write 0 for a row that saw no key).
TE_JAX_HOST_DEVICE void MergeSink(float sink, float& lse, float& out_scale) {
  if (lse != lse || sink != sink) {
    lse = out_scale = lse + sink;
    return;
  }
  const float larger = fmaxf(lse, sink);
  if (larger < -3.40282347e+38f) return;  // both -inf (below the lowest float): neither part has any weight
  // log(exp(a) + exp(b)) = max + log1p(exp(-|a - b|)); equal parts (also both +inf) add log 2.
  const float gap = lse == sink ? 0.0f : fabsf(lse - sink);
  const float merged = larger + log1pf(expf(-gap));
  if (merged != lse) out_scale *= expf(lse - merged);  // merged == lse: the sink adds nothing (or lse is +inf)
  lse = merged;
}

}  // namespace te_jax
