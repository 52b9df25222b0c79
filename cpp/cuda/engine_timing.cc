#include "cpp/cuda/engine_timing.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cpp/core/bias.h"
#include "cpp/cuda/attention_cuda.h"
#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/kernel_registry.h"

namespace te_jax::cuda {
namespace {

Status Check(const DriverApi* driver, CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return Status::Ok();
  return Status::Internal(std::string("te_jax engine timing: ") + what + " failed: " + driver->ErrorString(r));
}

// The scratch device memory of one measurement, freed (and the primary context released) on every path out.
class Scratch {
 public:
  Scratch(const DriverApi* driver, CUdevice device) : driver_(driver), device_(device) {}
  ~Scratch() {
    if (stream_ != nullptr) driver_->cuStreamSynchronize(stream_);
    for (CUdeviceptr p : allocations_) driver_->cuMemFree(p);
    for (CUevent e : events_) driver_->cuEventDestroy(e);
    if (stream_ != nullptr) driver_->cuStreamDestroy(stream_);
    if (pushed_) {
      CUcontext popped;
      driver_->cuCtxPopCurrent(&popped);
    }
    if (retained_) driver_->cuDevicePrimaryCtxRelease(device_);
  }

  // JAX runs on each device's primary context; make it current on this (lowering) thread for the measurement.
  Status Enter() {
    CUcontext context = nullptr;
    TE_JAX_RETURN_IF_ERROR(Check(driver_, driver_->cuDevicePrimaryCtxRetain(&context, device_), "cuDevicePrimaryCtxRetain"));
    retained_ = true;
    TE_JAX_RETURN_IF_ERROR(Check(driver_, driver_->cuCtxPushCurrent(context), "cuCtxPushCurrent"));
    pushed_ = true;
    return Check(driver_, driver_->cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  }

  // `bytes` of device memory (at least one byte, so every buffer has an address), filled with the 16-bit pattern.
  Status Alloc(int64_t bytes, void** ptr) {
    CUdeviceptr p = 0;
    const size_t size = static_cast<size_t>(std::max<int64_t>(bytes, 4));
    const CUresult r = driver_->cuMemAlloc(&p, size);
    if (r != CUDA_SUCCESS) {
      return Status::Unavailable("te_jax engine timing could not allocate " + std::to_string(size) +
                                 " bytes of scratch on the GPU: " + driver_->ErrorString(r));
    }
    allocations_.push_back(p);
    *ptr = reinterpret_cast<void*>(p);
    return Status::Ok();
  }

  Status Fill16(void* ptr, int64_t count, uint16_t value) {
    return Check(driver_, driver_->cuMemsetD16Async(reinterpret_cast<CUdeviceptr>(ptr), value, count, stream_),
                 "cuMemsetD16Async");
  }
  Status Fill32(void* ptr, int64_t count, uint32_t value) {
    return Check(driver_, driver_->cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(ptr), value, count, stream_),
                 "cuMemsetD32Async");
  }

  Status Event(CUevent* event) {
    TE_JAX_RETURN_IF_ERROR(Check(driver_, driver_->cuEventCreate(event, CU_EVENT_DEFAULT), "cuEventCreate"));
    events_.push_back(*event);
    return Status::Ok();
  }

  CUstream stream() const { return stream_; }

 private:
  const DriverApi* driver_;
  CUdevice device_;
  CUstream stream_ = nullptr;
  bool retained_ = false, pushed_ = false;
  std::vector<CUdeviceptr> allocations_;
  std::vector<CUevent> events_;
};

// A finite value in both 16-bit formats (bf16 2^-1.., fp16 0.125), and float 0 for lse, dlse and the slopes.
constexpr uint16_t kFill = 0x3000;

}  // namespace

Status DeviceDescription(std::string* name, int* driver_version) {
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  CUdevice device = 0;
  std::string arch;
  TE_JAX_RETURN_IF_ERROR(CurrentDeviceArch(&device, &arch));
  char buffer[256] = {};
  TE_JAX_RETURN_IF_ERROR(Check(driver, driver->cuDeviceGetName(buffer, sizeof(buffer) - 1, device), "cuDeviceGetName"));
  *name = buffer;
  return Check(driver, driver->cuDriverGetVersion(driver_version), "cuDriverGetVersion");
}

Status TimeAttention(const AttentionParams& p, Direction direction, double* milliseconds) {
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  CUdevice device = 0;
  std::string arch;
  TE_JAX_RETURN_IF_ERROR(CurrentDeviceArch(&device, &arch));
  JitReport report;
  TE_JAX_RETURN_IF_ERROR(Prepare(p, direction, &report));

  Scratch scratch(driver, device);
  TE_JAX_RETURN_IF_ERROR(scratch.Enter());
  const int64_t q_elems = p.batch * p.seqlen_q * p.num_heads * p.head_dim;
  const int64_t k_elems = p.batch * p.seqlen_kv * p.num_kv_heads * p.head_dim;
  const int64_t v_elems = p.batch * p.seqlen_kv * p.num_kv_heads * p.head_dim_v;
  const int64_t o_elems = p.batch * p.seqlen_q * p.num_heads * p.head_dim_v;
  const int64_t rows = p.batch * p.num_heads * p.seqlen_q;
  void *q, *k, *v, *out, *lse, *q_seqlens, *kv_seqlens, *alibi, *workspace;
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * q_elems, &q));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * k_elems, &k));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * v_elems, &v));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * o_elems, &out));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * rows, &lse));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * p.batch, &q_seqlens));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * p.batch, &kv_seqlens));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * p.batch * p.num_heads, &alibi));
  const bool forward = direction == Direction::kForward;
  const int64_t workspace_bytes = forward ? ForwardWorkspaceBytes(p) : BackwardWorkspaceBytes(p);
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(workspace_bytes, &workspace));
  for (auto [ptr, count] : {std::pair<void*, int64_t>{q, q_elems}, {k, k_elems}, {v, v_elems}, {out, o_elems}}) {
    TE_JAX_RETURN_IF_ERROR(scratch.Fill16(ptr, count, kFill));
  }
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(lse, rows, 0));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(q_seqlens, p.batch, static_cast<uint32_t>(p.seqlen_q)));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(kv_seqlens, p.batch, static_cast<uint32_t>(p.seqlen_kv)));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(alibi, p.batch * p.num_heads, 0));
  // Packed sequences: one document (every id 1), every position 0; both sides read prefixes of the same buffers.
  const int64_t tokens = p.batch * std::max(p.seqlen_q, p.seqlen_kv);
  void *ids, *positions;
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * tokens, &ids));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * tokens, &positions));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(ids, tokens, 1));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(positions, tokens, 0));
  void* dropout;  // the key (0, 0) at offsets (0, 0, 0, 0)
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(6 * 4, &dropout));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill32(dropout, 6, 0));
  // A bias of the call's shape (zeros) and its gradient; one unread element without a bias.
  const int64_t bias_bytes = (p.has_bias ? MakeBiasLayout(p).elements() : 1) * DTypeSize(p.bias_dtype);
  void *bias, *dbias;
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(bias_bytes, &bias));
  TE_JAX_RETURN_IF_ERROR(scratch.Alloc(bias_bytes, &dbias));
  TE_JAX_RETURN_IF_ERROR(scratch.Fill16(bias, bias_bytes / 2, 0));

  ForwardBuffers fb;
  fb.q = q;
  fb.k = k;
  fb.v = v;
  fb.q_seqlens = static_cast<const int32_t*>(q_seqlens);
  fb.kv_seqlens = static_cast<const int32_t*>(kv_seqlens);
  fb.alibi_slopes = static_cast<const float*>(alibi);
  fb.sinks = fb.alibi_slopes;  // zeros [B, H]: sinks of 0 (the off-by-one softmax) cost what any sinks cost
  fb.q_segment_ids = fb.kv_segment_ids = static_cast<const int32_t*>(ids);
  fb.q_positions = fb.kv_positions = static_cast<const int32_t*>(positions);
  fb.dropout = static_cast<const uint32_t*>(dropout);
  fb.bias = bias;
  fb.out = out;
  fb.lse = static_cast<float*>(lse);
  fb.workspace = workspace;
  fb.workspace_bytes = workspace_bytes;
  BackwardBuffers bb;
  if (!forward) {
    void *dout, *dlse, *dq, *dk, *dv;
    TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * o_elems, &dout));
    TE_JAX_RETURN_IF_ERROR(scratch.Alloc(4 * rows, &dlse));
    TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * q_elems, &dq));
    TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * k_elems, &dk));
    TE_JAX_RETURN_IF_ERROR(scratch.Alloc(2 * v_elems, &dv));
    TE_JAX_RETURN_IF_ERROR(scratch.Fill16(dout, o_elems, kFill));
    TE_JAX_RETURN_IF_ERROR(scratch.Fill32(dlse, rows, 0));
    bb.q = q;
    bb.k = k;
    bb.v = v;
    bb.out = out;
    bb.lse = static_cast<const float*>(lse);
    bb.dout = dout;
    bb.dlse = static_cast<const float*>(dlse);
    bb.q_seqlens = fb.q_seqlens;
    bb.kv_seqlens = fb.kv_seqlens;
    bb.alibi_slopes = fb.alibi_slopes;
    bb.q_segment_ids = bb.kv_segment_ids = fb.q_segment_ids;
    bb.q_positions = bb.kv_positions = fb.q_positions;
    bb.dropout = fb.dropout;
    bb.bias = bias;
    bb.dbias = dbias;
    bb.dq = dq;
    bb.dk = dk;
    bb.dv = dv;
    bb.workspace = workspace;
    bb.workspace_bytes = workspace_bytes;
  }
  auto run = [&]() { return forward ? AttentionForward(p, fb, scratch.stream()) : AttentionBackward(p, bb, scratch.stream()); };

  CUevent start, stop;
  TE_JAX_RETURN_IF_ERROR(scratch.Event(&start));
  TE_JAX_RETURN_IF_ERROR(scratch.Event(&stop));
  // Back-to-back batches, as a training step dispatches them: `calls` per batch, sized to ~10 ms from a first
  // estimate (the GPU clock also ramps up during the warm-up), best batch taken.
  auto batch = [&](int calls, double* ms_per_call) -> Status {
    TE_JAX_RETURN_IF_ERROR(Check(driver, driver->cuEventRecord(start, scratch.stream()), "cuEventRecord"));
    for (int i = 0; i < calls; ++i) TE_JAX_RETURN_IF_ERROR(run());
    TE_JAX_RETURN_IF_ERROR(Check(driver, driver->cuEventRecord(stop, scratch.stream()), "cuEventRecord"));
    TE_JAX_RETURN_IF_ERROR(Check(driver, driver->cuStreamSynchronize(scratch.stream()), "cuStreamSynchronize"));
    float ms = 0.0f;
    TE_JAX_RETURN_IF_ERROR(Check(driver, driver->cuEventElapsedTime(&ms, start, stop), "cuEventElapsedTime"));
    *ms_per_call = ms / calls;
    return Status::Ok();
  };
  double estimate = 0.0;
  TE_JAX_RETURN_IF_ERROR(batch(3, &estimate));
  const int calls = static_cast<int>(std::clamp(std::ceil(10.0 / std::max(estimate, 1e-3)), 3.0, 200.0));
  double best = estimate;
  for (int repeat = 0; repeat < 3; ++repeat) {
    double ms = 0.0;
    TE_JAX_RETURN_IF_ERROR(batch(calls, &ms));
    best = std::min(best, ms);
  }
  *milliseconds = best;
  return Status::Ok();
}

}  // namespace te_jax::cuda
