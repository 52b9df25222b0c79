// AttentionParams <-> Python dict (keys are the struct's field names), and Status -> Python exception, for the
// nanobind modules. Header-only so the CPU and CUDA modules share it without a shared library between them.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>

#include "cpp/attention_params.h"
#include "cpp/status.h"
#include "cpp/validate.h"

namespace te_jax::bindings {

namespace nb = nanobind;

// InvalidArgument becomes ValueError; anything else RuntimeError.
inline void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  if (status.code() == StatusCode::kInvalidArgument) throw nb::value_error(status.message().c_str());
  throw std::runtime_error(status.message());
}

inline Backend BackendFromInt(int backend) {
  if (backend != static_cast<int>(Backend::kCpu) && backend != static_cast<int>(Backend::kCuda)) {
    throw nb::value_error("backend must be 0 (cpu) or 1 (cuda)");
  }
  return static_cast<Backend>(backend);
}

inline AttentionParams ParamsFromDict(const nb::dict& d) {
  auto i64 = [&](const char* key) { return nb::cast<int64_t>(d[key]); };
  AttentionParams p;
  p.batch = i64("batch");
  p.seqlen_q = i64("seqlen_q");
  p.seqlen_kv = i64("seqlen_kv");
  p.num_heads = i64("num_heads");
  p.num_kv_heads = i64("num_kv_heads");
  p.head_dim = i64("head_dim");
  p.head_dim_v = i64("head_dim_v");
  // Out-of-range enum codes are kept as they are so ValidateAttentionParams reports them.
  p.dtype = static_cast<DType>(nb::cast<uint8_t>(d["dtype"]));
  p.mask_type = static_cast<MaskType>(nb::cast<uint8_t>(d["mask_type"]));
  p.window_left = i64("window_left");
  p.window_right = i64("window_right");
  p.scale = nb::cast<float>(d["scale"]);
  p.softcap = nb::cast<float>(d["softcap"]);
  p.has_alibi = nb::cast<bool>(d["has_alibi"]);
  p.deterministic = nb::cast<bool>(d["deterministic"]);
  return p;
}

inline nb::dict DictFromParams(const AttentionParams& p) {
  nb::dict d;
  d["batch"] = p.batch;
  d["seqlen_q"] = p.seqlen_q;
  d["seqlen_kv"] = p.seqlen_kv;
  d["num_heads"] = p.num_heads;
  d["num_kv_heads"] = p.num_kv_heads;
  d["head_dim"] = p.head_dim;
  d["head_dim_v"] = p.head_dim_v;
  d["dtype"] = static_cast<int>(p.dtype);
  d["mask_type"] = static_cast<int>(p.mask_type);
  d["window_left"] = p.window_left;
  d["window_right"] = p.window_right;
  d["scale"] = p.scale;
  d["softcap"] = p.softcap;
  d["has_alibi"] = p.has_alibi;
  d["deterministic"] = p.deterministic;
  return d;
}

}  // namespace te_jax::bindings
