// The cuDNN engine's entry points and its graph cache: one built graph per (device, direction, params), kept for the
// life of the process. Lowering (Prepare, Supports) builds; an execution looks its graph up under a shared lock and
// builds only on a miss (a persistent compilation-cache hit skipped lowering in this process).
//
// What is unverified (to be checked on a GPU; te_jax's own kernels meet all of it):
//  - Padded query rows (i >= q_seqlens[b]) and rows with no visible key for data-dependent reasons (kv_seqlens[b] = 0;
//    padding_causal_bottom_right with q_seqlens[b] > kv_seqlens[b]; a left window with rows past kv_seqlens[b] + left):
//    whether cuDNN writes out = 0 and lse = -inf there, and dq = 0 in the backward, or leaves them unwritten or NaN.
//    TransformerEngine zero-fills padded output rows itself after cuDNN, which suggests they are not written. Such
//    rows' unwritten `out` would also reach the backward's rowsum(dO * O).
//  - Keys j >= kv_seqlens[b] whose v holds NaN or inf: their probability is 0, but a kernel that multiplies the masked
//    columns of a tile (0 * NaN) instead of skipping them would turn the row into NaN. te_jax never reads them.
//  - dk / dv of keys no row sees (padded keys): expected 0.
//  - NaN or inf in visible inputs: expected to propagate per IEEE, as in te_jax's kernels; nothing is done about it.
#include "cpp/cuda/cudnn/cudnn_attention.h"

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <tuple>

#include "cpp/core/validate.h"
#include "cpp/cuda/cudnn/cudnn_contract.h"
#include "cpp/cuda/cudnn/cudnn_library.h"
#include "cpp/cuda/cudnn/cudnn_mask.h"
#include "cpp/cuda/cudnn/cudnn_sdpa_graph.h"
#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/length_guard.h"

namespace te_jax::cuda::cudnn {
namespace {

// The device of the calling thread's current context (XLA's, at execution), else device 0, and its arch.
struct Device {
  CUdevice ordinal = 0;
  int sm_version = 0;  // e.g. 90
};

Status CurrentDevice(Device* device) {
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  if (driver->cuCtxGetDevice(&device->ordinal) != CUDA_SUCCESS) {
    const CUresult r = driver->cuDeviceGet(&device->ordinal, 0);
    if (r != CUDA_SUCCESS) return Status::Unavailable("no CUDA device: " + driver->ErrorString(r));
  }
  int major = 0, minor = 0;
  CUresult r = driver->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device->ordinal);
  if (r == CUDA_SUCCESS) {
    r = driver->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device->ordinal);
  }
  if (r != CUDA_SUCCESS) return Status::Internal("cuDeviceGetAttribute failed: " + driver->ErrorString(r));
  device->sm_version = major * 10 + minor;
  return Status::Ok();
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Everything a graph depends on: every params field (data pointers are not params), the direction and the device.
struct GraphKey {
  CUdevice device;
  int direction;
  int64_t batch, seqlen_q, seqlen_kv, num_heads, num_kv_heads, head_dim, head_dim_v, window_left, window_right;
  int dtype, mask_type, engine;
  uint32_t scale, softcap;
  bool has_alibi, deterministic;

  auto Tie() const {
    return std::tie(device, direction, batch, seqlen_q, seqlen_kv, num_heads, num_kv_heads, head_dim, head_dim_v,
                    window_left, window_right, dtype, mask_type, engine, scale, softcap, has_alibi, deterministic);
  }
  bool operator<(const GraphKey& o) const { return Tie() < o.Tie(); }
};

GraphKey KeyOf(CUdevice device, const AttentionParams& p, Direction direction) {
  const bool backward = direction == Direction::kBackward;
  return GraphKey{device,
                  backward ? 1 : 0,
                  p.batch,
                  p.seqlen_q,
                  p.seqlen_kv,
                  p.num_heads,
                  p.num_kv_heads,
                  p.head_dim,
                  p.head_dim_v,
                  p.window_left,
                  p.window_right,
                  static_cast<int>(p.dtype),
                  static_cast<int>(p.mask_type),
                  static_cast<int>(p.engine),
                  Bits(p.scale),
                  Bits(p.softcap),
                  p.has_alibi,
                  backward && p.deterministic};  // the forward graph is the same either way
}

// A build's outcome. Refusals (InvalidArgument) are kept like graphs, so asking again costs a lookup; other errors
// (a failed CUDA call) are not, so the next call retries.
struct CacheEntry {
  Status status;
  SdpaGraph graph;
};

class GraphCache {
 public:
  const CacheEntry* Find(const GraphKey& key) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : it->second.get();
  }

  // Builds under one mutex (a graph is built once even when several threads miss together). Entries are never
  // removed, so the returned pointer stays valid.
  Status GetOrBuild(const GraphKey& key, const AttentionParams& p, Direction direction, const Device& device,
                    const CacheEntry** entry) {
    if ((*entry = Find(key)) != nullptr) return Status::Ok();
    std::lock_guard<std::mutex> build_lock(build_mu_);
    if ((*entry = Find(key)) != nullptr) return Status::Ok();
    auto built = std::make_unique<CacheEntry>();
    {
      HandleLease lease;
      TE_JAX_RETURN_IF_ERROR(LeaseHandle(device.ordinal, HandleUse::kBuild, &lease));
      built->status = BuildSdpaGraph(p, direction, device.sm_version, lease.get(), &built->graph);
    }
    if (!built->status.ok() && built->status.code() != StatusCode::kInvalidArgument) return built->status;
    std::unique_lock<std::shared_mutex> lock(mu_);
    *entry = (entries_[key] = std::move(built)).get();
    return Status::Ok();
  }

 private:
  std::shared_mutex mu_;
  std::mutex build_mu_;
  std::map<GraphKey, std::unique_ptr<const CacheEntry>> entries_;
};

GraphCache& Cache() {
  static GraphCache cache;
  return cache;
}

// The built graph of this call on the current device (building it on a miss), with the device it is for.
Status GetGraph(const AttentionParams& p, Direction direction, const SdpaGraph** graph, Device* device) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(p, Backend::kCuda));
  TE_JAX_RETURN_IF_ERROR(CheckCudnnContract(p));
  TE_JAX_RETURN_IF_ERROR(LoadCudnn());
  TE_JAX_RETURN_IF_ERROR(CurrentDevice(device));
  const CacheEntry* entry = nullptr;
  TE_JAX_RETURN_IF_ERROR(Cache().GetOrBuild(KeyOf(device->ordinal, p, direction), p, direction, *device, &entry));
  TE_JAX_RETURN_IF_ERROR(entry->status);
  *graph = &entry->graph;
  return Status::Ok();
}

Status CheckWorkspace(const char* what, int64_t have, int64_t need) {
  if (have >= need) return Status::Ok();
  return Status::InvalidArgument(std::string("the cuDNN ") + what + "'s workspace has " + std::to_string(have) +
                                 " bytes; this call needs " + std::to_string(need));
}

Status CheckSeqlens(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens) {
  if (CudnnMaskFor(p).padding && (q_seqlens == nullptr || kv_seqlens == nullptr)) {
    return Status::InvalidArgument("a padding mask needs the q_seqlens and kv_seqlens buffers");
  }
  return Status::Ok();
}

// With a padding mask cuDNN reads the run-time lengths as they come: the workspace starts with the length guard's
// clamped copies (cpp/cuda/length_guard.h), and cuDNN's own workspace follows.
int64_t GuardBytes(const AttentionParams& p) { return CudnnMaskFor(p).padding ? LengthGuardBytes(p) : 0; }

int64_t WorkspaceBytes(const AttentionParams& p, Direction direction) {
  const SdpaGraph* graph = nullptr;
  Device device;
  return GetGraph(p, direction, &graph, &device).ok() ? GuardBytes(p) + graph->workspace_bytes : 0;
}

// Runs `execute(buffers)` between the length guard's two steps when the mask reads run-time lengths: cuDNN gets the
// clamped lengths and the rest of the workspace, and te_jax's values land on the rows and keys the lengths cut.
template <typename Buffers, typename Execute>
Status RunGuarded(const AttentionParams& p, const Buffers& b, int64_t cudnn_bytes, const char* what, CUstream stream,
                  Execute execute) {
  TE_JAX_RETURN_IF_ERROR(CheckWorkspace(what, b.workspace_bytes, GuardBytes(p) + cudnn_bytes));
  if (!CudnnMaskFor(p).padding) return execute(b);
  TE_JAX_RETURN_IF_ERROR(CheckSeqlens(p, b.q_seqlens, b.kv_seqlens));
  int32_t* guarded = static_cast<int32_t*>(b.workspace);
  TE_JAX_RETURN_IF_ERROR(GuardLengths(p, b.q_seqlens, b.kv_seqlens, guarded, stream));
  Buffers inner = b;
  inner.q_seqlens = guarded;
  inner.kv_seqlens = guarded + p.batch;
  inner.workspace = static_cast<char*>(b.workspace) + GuardBytes(p);
  inner.workspace_bytes = b.workspace_bytes - GuardBytes(p);
  TE_JAX_RETURN_IF_ERROR(execute(inner));
  return EnforceLengthContract(p, guarded, b, stream);
}

// An execution: the graph of this call (built at lowering), the device's execute handle on XLA's stream, and
// `execute` (ExecuteSdpaForward or ExecuteSdpaBackward) inside the length guard.
template <typename Buffers>
Status RunOnGraph(const AttentionParams& p, const Buffers& b, Direction direction, CUstream stream,
                  Status (*execute)(const SdpaGraph&, const AttentionParams&, const Buffers&, cudnnContext*)) {
  const SdpaGraph* graph = nullptr;
  Device device;
  TE_JAX_RETURN_IF_ERROR(GetGraph(p, direction, &graph, &device));
  HandleLease lease;
  TE_JAX_RETURN_IF_ERROR(LeaseHandle(device.ordinal, HandleUse::kExecute, &lease));
  TE_JAX_RETURN_IF_ERROR(SetStream(lease, stream));
  return RunGuarded(p, b, graph->workspace_bytes, direction == Direction::kForward ? "forward" : "backward", stream,
                    [&](const Buffers& inner) { return execute(*graph, p, inner, lease.get()); });
}

}  // namespace

void SetLibrarySearchPaths(std::vector<std::string> cudnn_paths, std::vector<std::string> cudart_paths) {
  SetCudnnSearchPaths(std::move(cudnn_paths), std::move(cudart_paths));
}

bool Built() { return true; }

Status Available() { return LoadCudnn(); }

std::string Version() { return LoadCudnn().ok() ? CudnnVersionString(LoadedCudnnVersion()) : ""; }

Status Supports(const AttentionParams& params, Direction direction) {
  const SdpaGraph* graph = nullptr;
  Device device;
  return GetGraph(params, direction, &graph, &device);
}

Status Prepare(const AttentionParams& params, Direction direction) {
  const SdpaGraph* graph = nullptr;
  Device device;
  TE_JAX_RETURN_IF_ERROR(GetGraph(params, direction, &graph, &device));
  if (CudnnMaskFor(params).padding) TE_JAX_RETURN_IF_ERROR(PrepareLengthGuard());
  // The execution handle too: cudnnCreate allocates device memory, which must not first happen while XLA captures
  // the call into a command buffer.
  HandleLease lease;
  return LeaseHandle(device.ordinal, HandleUse::kExecute, &lease);
}

int64_t ForwardWorkspaceBytes(const AttentionParams& params) { return WorkspaceBytes(params, Direction::kForward); }

int64_t BackwardWorkspaceBytes(const AttentionParams& params) { return WorkspaceBytes(params, Direction::kBackward); }

Status Forward(const AttentionParams& p, const ForwardBuffers& b, CUstream stream) {
  return RunOnGraph(p, b, Direction::kForward, stream, ExecuteSdpaForward);
}

Status Backward(const AttentionParams& p, const BackwardBuffers& b, CUstream stream) {
  return RunOnGraph(p, b, Direction::kBackward, stream, ExecuteSdpaBackward);
}

}  // namespace te_jax::cuda::cudnn
