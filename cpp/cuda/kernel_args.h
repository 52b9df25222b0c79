// The parameter blocks the CUDA kernels take by value. Compiled by the host compiler (the launcher fills them) and by
// NVRTC (the kernels read them), so both sides see one layout: only pointers, 32/64-bit integers and floats.
#pragma once

#include "cpp/host_device.h"
#if !defined(__CUDACC_RTC__)
#include <cstdint>
#endif

namespace te_jax::cuda {

// Shapes and options shared by every kernel of a call. Layouts as in cpp/attention_params.h.
struct ShapeArgs {
  int32_t batch;
  int32_t seqlen_q;
  int32_t seqlen_kv;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t mask_type;     // cpp/mask_type.h; masks are run-time data, not template parameters (one kernel for all)
  int32_t window_left;   // -1: unbounded
  int32_t window_right;  // -1: unbounded
  float scale;
  float softcap;
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
};

// The length guard (kernels/common/length_guard.cuh) of an engine that reads run-time lengths without checking them:
// it writes clamped copies and per-batch invalid flags to `guarded`, and after the engine ran, NaN over every output
// of a batch whose lengths were out of range.
struct LengthGuardArgs {
  const int32_t* q_seqlens;
  const int32_t* kv_seqlens;
  int32_t* guarded;  // [3][batch]: clamped q lengths, clamped kv lengths, 1 where the batch's lengths were invalid
  int32_t batch;
  int32_t seqlen_q;
  int32_t seqlen_kv;
  int32_t num_outputs;
  void* outputs[4];               // batch-major tensors
  int64_t output_batch_bytes[4];  // bytes of one batch entry of each (a multiple of 4)
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
};

}  // namespace te_jax::cuda
