#include "cpp/cuda/cudnn/cudnn_sdpa_graph.h"

#include <cudnn_frontend.h>

#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpp/cuda/cudnn/cudnn_library.h"
#include "cpp/cuda/cudnn/cudnn_mask.h"

namespace te_jax::cuda::cudnn {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor uids: the variant pack binds device pointers by these.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqLenQ, kSeqLenKv };

// te_jax's [B, S, H, D] row-major buffer as cuDNN's [B, H, S, D] tensor.
fe::graph::Tensor_attributes Bshd(const char* name, Uid uid, int64_t b, int64_t s, int64_t h, int64_t d) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({b, h, s, d})
      .set_stride({s * h * d, d, h * d, 1});
}

// lse float32 [B, H, Sq] is cuDNN's softmax "Stats" [B, H, Sq, 1]: max + ln(sum exp(s - max)) over the unmasked keys,
// the natural-log log-sum-exp of the scaled logits (docs/operations/Attention.md; base 2 only with
// set_stats_use_log2, which we leave off). Packed BHSD, the only Stats layout the backward reads before cuDNN 9.26.
fe::graph::Tensor_attributes Lse(const AttentionParams& p) {
  return fe::graph::Tensor_attributes()
      .set_name("lse")
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({p.batch, p.num_heads, p.seqlen_q, 1})
      .set_stride({p.num_heads * p.seqlen_q, p.seqlen_q, 1, 1});
}

// q_seqlens / kv_seqlens int32 [B] as cuDNN's seq_len tensors [B, 1, 1, 1].
fe::graph::Tensor_attributes SeqLen(const char* name, Uid uid, int64_t batch) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_data_type(fe::DataType_t::INT32)
      .set_dim({batch, 1, 1, 1})
      .set_stride({1, 1, 1, 1});
}

template <typename Attributes>
void ApplyMask(fe::graph::Graph& graph, const AttentionParams& p, Attributes& attributes) {
  const CudnnMask mask = CudnnMaskFor(p);
  if (mask.padding) {
    attributes.set_padding_mask(true)
        .set_seq_len_q(graph.tensor(SeqLen("q_seqlens", kSeqLenQ, p.batch)))
        .set_seq_len_kv(graph.tensor(SeqLen("kv_seqlens", kSeqLenKv, p.batch)));
  }
  if (mask.left_bound.has_value() || mask.right_bound.has_value()) {
    attributes.set_diagonal_alignment(mask.bottom_right ? fe::DiagonalAlignment_t::BOTTOM_RIGHT
                                                        : fe::DiagonalAlignment_t::TOP_LEFT);
  }
  // Both fit in int: CheckCudnnContract keeps the lengths below 2^31 and CudnnMaskFor drops wider bounds.
  if (mask.right_bound.has_value()) attributes.set_diagonal_band_right_bound(static_cast<int>(*mask.right_bound));
  if (mask.left_bound.has_value()) attributes.set_diagonal_band_left_bound(static_cast<int>(*mask.left_bound));
}

std::shared_ptr<fe::graph::Graph> NewGraph(const AttentionParams& p, int sm_version) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(p.dtype == DType::kBFloat16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  // The arch the graph is validated and planned for, from the driver, so the frontend need not ask the CUDA runtime.
  graph->set_sm_version(sm_version);
  // The graph lives as long as the process (the engine's cache never drops one), so command buffers recorded from
  // its executions need no CUDA user objects keeping its plans alive.
  graph->set_cuda_graph_retention(fe::CudaGraphRetention_t::NONE);
  return graph;
}

void DefineForward(fe::graph::Graph& graph, const AttentionParams& p) {
  const TensorPtr q = graph.tensor(Bshd("q", kQ, p.batch, p.seqlen_q, p.num_heads, p.head_dim));
  const TensorPtr k = graph.tensor(Bshd("k", kK, p.batch, p.seqlen_kv, p.num_kv_heads, p.head_dim));
  const TensorPtr v = graph.tensor(Bshd("v", kV, p.batch, p.seqlen_kv, p.num_kv_heads, p.head_dim_v));
  auto attributes = fe::graph::SDPA_attributes().set_name("te_jax_forward").set_generate_stats(true);
  attributes.set_attn_scale(p.scale);
  ApplyMask(graph, p, attributes);
  auto [out, lse] = graph.sdpa(q, k, v, attributes);
  const fe::graph::Tensor_attributes out_layout = Bshd("out", kO, p.batch, p.seqlen_q, p.num_heads, p.head_dim_v);
  out->set_output(true).set_uid(kO).set_dim(out_layout.get_dim()).set_stride(out_layout.get_stride());
  const fe::graph::Tensor_attributes lse_layout = Lse(p);
  lse->set_output(true)
      .set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim(lse_layout.get_dim())
      .set_stride(lse_layout.get_stride());
}

void DefineBackward(fe::graph::Graph& graph, const AttentionParams& p) {
  const TensorPtr q = graph.tensor(Bshd("q", kQ, p.batch, p.seqlen_q, p.num_heads, p.head_dim));
  const TensorPtr k = graph.tensor(Bshd("k", kK, p.batch, p.seqlen_kv, p.num_kv_heads, p.head_dim));
  const TensorPtr v = graph.tensor(Bshd("v", kV, p.batch, p.seqlen_kv, p.num_kv_heads, p.head_dim_v));
  const TensorPtr out = graph.tensor(Bshd("out", kO, p.batch, p.seqlen_q, p.num_heads, p.head_dim_v));
  const TensorPtr dout = graph.tensor(Bshd("dout", kDO, p.batch, p.seqlen_q, p.num_heads, p.head_dim_v));
  const TensorPtr lse = graph.tensor(Lse(p));
  auto attributes = fe::graph::SDPA_backward_attributes().set_name("te_jax_backward");
  attributes.set_attn_scale(p.scale);
  // cuDNN's deterministic backward (on Hopper a dP workspace of B * H * Sq * Skv * 2 bytes, ~rounded up to tiles).
  attributes.set_deterministic_algorithm(p.deterministic);
  ApplyMask(graph, p, attributes);
  auto [dq, dk, dv] = graph.sdpa_backward(q, k, v, out, dout, lse, attributes);
  const auto bind = [](const TensorPtr& t, const fe::graph::Tensor_attributes& layout) {
    t->set_output(true).set_uid(layout.get_uid()).set_dim(layout.get_dim()).set_stride(layout.get_stride());
  };
  bind(dq, Bshd("dq", kDQ, p.batch, p.seqlen_q, p.num_heads, p.head_dim));
  bind(dk, Bshd("dk", kDK, p.batch, p.seqlen_kv, p.num_kv_heads, p.head_dim));
  bind(dv, Bshd("dv", kDV, p.batch, p.seqlen_kv, p.num_kv_heads, p.head_dim_v));
}

std::string Where(const AttentionParams& p, int sm_version) {
  return "cuDNN " + CudnnVersionString(LoadedCudnnVersion()) + " on sm_" + std::to_string(sm_version) + " (" +
         (p.dtype == DType::kBFloat16 ? "bfloat16" : "float16") + ", head_dim " + std::to_string(p.head_dim) +
         ", head_dim_v " + std::to_string(p.head_dim_v) + ")";
}

// The frontend's refusals (unsupported configuration, no engine or plan) are the engine's answer to Supports; a
// failed CUDA or cuDNN call is an error.
Status FromBuild(fe::error_t error, const char* stage, const AttentionParams& p, int sm_version) {
  if (error.is_good()) return Status::Ok();
  const std::string message = Where(p, sm_version) + " cannot run this call (" + stage + "): " + error.get_message();
  switch (error.get_code()) {
    case fe::error_code_t::CUDA_API_FAILED:
    case fe::error_code_t::CUDNN_BACKEND_API_FAILED:
    case fe::error_code_t::INVALID_CUDA_DEVICE:
    case fe::error_code_t::HANDLE_ERROR:
      return Status::Internal(message);
    default:
      return Status::InvalidArgument(message);
  }
}

Status Execute(const SdpaGraph& graph, std::unordered_map<int64_t, void*>& pack, void* workspace,
               cudnnContext* handle, const char* what) {
  try {
    fe::error_t error = graph.graph->execute(handle, pack, workspace);
    if (error.is_bad()) return Status::Internal(std::string("cuDNN ") + what + " failed: " + error.get_message());
  } catch (const std::exception& e) {
    return Status::Internal(std::string("cuDNN ") + what + " failed: " + e.what());
  }
  return Status::Ok();
}

}  // namespace

Status BuildSdpaGraph(const AttentionParams& p, Direction direction, int sm_version, cudnnContext* handle,
                      SdpaGraph* out) {
  // The shim throws where a symbol or library is missing; nothing may escape into XLA.
  try {
    std::shared_ptr<fe::graph::Graph> graph = NewGraph(p, sm_version);
    if (direction == Direction::kForward) {
      DefineForward(*graph, p);
    } else {
      DefineBackward(*graph, p);
    }
    TE_JAX_RETURN_IF_ERROR(FromBuild(graph->validate(), "validate", p, sm_version));
    TE_JAX_RETURN_IF_ERROR(FromBuild(graph->build_operation_graph(handle), "operation graph", p, sm_version));
    TE_JAX_RETURN_IF_ERROR(FromBuild(graph->create_execution_plans({fe::HeurMode_t::A}), "heuristics", p, sm_version));
    TE_JAX_RETURN_IF_ERROR(FromBuild(graph->check_support(), "support check", p, sm_version));
    TE_JAX_RETURN_IF_ERROR(
        FromBuild(graph->build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "plan build", p, sm_version));
    int64_t workspace_bytes = 0;
    TE_JAX_RETURN_IF_ERROR(FromBuild(graph->get_workspace_size(workspace_bytes), "workspace size", p, sm_version));
    out->graph = std::move(graph);
    out->workspace_bytes = workspace_bytes;
  } catch (const std::exception& e) {
    return Status::Internal(Where(p, sm_version) + ": building the graph failed: " + e.what());
  }
  return Status::Ok();
}

Status ExecuteSdpaForward(const SdpaGraph& graph, const AttentionParams& p, const ForwardBuffers& b,
                          cudnnContext* handle) {
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(b.q)}, {kK, const_cast<void*>(b.k)}, {kV, const_cast<void*>(b.v)},
      {kO, b.out},                  {kStats, b.lse},
  };
  if (CudnnMaskFor(p).padding) {
    pack[kSeqLenQ] = const_cast<int32_t*>(b.q_seqlens);
    pack[kSeqLenKv] = const_cast<int32_t*>(b.kv_seqlens);
  }
  return Execute(graph, pack, b.workspace, handle, "attention forward");
}

Status ExecuteSdpaBackward(const SdpaGraph& graph, const AttentionParams& p, const BackwardBuffers& b,
                           cudnnContext* handle) {
  std::unordered_map<int64_t, void*> pack = {
      {kQ, const_cast<void*>(b.q)},      {kK, const_cast<void*>(b.k)},
      {kV, const_cast<void*>(b.v)},      {kO, const_cast<void*>(b.out)},
      {kDO, const_cast<void*>(b.dout)},  {kStats, const_cast<float*>(b.lse)},
      {kDQ, b.dq},                       {kDK, b.dk},
      {kDV, b.dv},
  };
  if (CudnnMaskFor(p).padding) {
    pack[kSeqLenQ] = const_cast<int32_t*>(b.q_seqlens);
    pack[kSeqLenKv] = const_cast<int32_t*>(b.kv_seqlens);
  }
  return Execute(graph, pack, b.workspace, handle, "attention backward");
}

}  // namespace te_jax::cuda::cudnn
