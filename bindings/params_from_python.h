// AttentionParams <-> Python dict (keys are the struct's field names), and Status -> Python exception, for the
// nanobind modules. Header-only so the CPU and CUDA modules share it without a shared library between them.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"
#include "cpp/core/validate.h"

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

// d[key] as T, or a ValueError naming the field (nanobind's own cast failure says only "std::bad_cast").
template <typename T>
T Field(const nb::dict& d, const char* key) {
  T value;
  if (!d.contains(key) || !nb::try_cast<T>(d[key], value)) {
    throw nb::value_error((std::string("attention parameter '") + key + "' is missing or out of range for its C++ type").c_str());
  }
  return value;
}

// A core dtype code (cpp/core/dtype.h) from Python, or a ValueError naming the field.
inline DType DTypeFromInt(int code, const char* name) {
  if (code < 0 || code >= kNumDTypes) {
    throw nb::value_error(
        (std::string(name) + " must be a core dtype code: float32 (0), bfloat16 (1) or float16 (2)").c_str());
  }
  return static_cast<DType>(code);
}

// "forward" -> true, "backward" -> false, anything else a ValueError.
inline bool IsForward(const std::string& direction) {
  if (direction != "forward" && direction != "backward") {
    throw nb::value_error(("direction must be 'forward' or 'backward', got '" + direction + "'").c_str());
  }
  return direction == "forward";
}

inline AttentionParams ParamsFromDict(const nb::dict& d) {
  auto i64 = [&](const char* key) { return Field<int64_t>(d, key); };
  AttentionParams p;
  p.batch = i64("batch");
  p.seqlen_q = i64("seqlen_q");
  p.seqlen_kv = i64("seqlen_kv");
  p.num_heads = i64("num_heads");
  p.num_kv_heads = i64("num_kv_heads");
  p.head_dim = i64("head_dim");
  p.head_dim_v = i64("head_dim_v");
  // Out-of-range enum codes are kept as they are so ValidateAttentionParams reports them.
  p.dtype = static_cast<DType>(Field<uint8_t>(d, "dtype"));
  p.mask_type = static_cast<MaskType>(Field<uint8_t>(d, "mask_type"));
  p.window_left = i64("window_left");
  p.window_right = i64("window_right");
  p.scale = Field<float>(d, "scale");
  p.softcap = Field<float>(d, "softcap");
  p.has_alibi = Field<bool>(d, "has_alibi");
  p.has_sinks = d.contains("has_sinks") && Field<bool>(d, "has_sinks");  // absent in older callers' parameters
  p.deterministic = Field<bool>(d, "deterministic");
  // Absent in the parameters of older callers (tests, tools): no packed sequences.
  p.has_segment_ids = d.contains("has_segment_ids") && Field<bool>(d, "has_segment_ids");
  p.has_positions = d.contains("has_positions") && Field<bool>(d, "has_positions");
  // Absent too in older callers' parameters: no bias (its placeholder's dtype and broadcast bits are the defaults).
  p.has_bias = d.contains("has_bias") && Field<bool>(d, "has_bias");
  if (d.contains("bias_dtype")) p.bias_dtype = static_cast<DType>(Field<uint8_t>(d, "bias_dtype"));
  if (d.contains("bias_broadcast")) p.bias_broadcast = Field<uint8_t>(d, "bias_broadcast");
  if (d.contains("dropout_threshold")) p.dropout_threshold = Field<uint32_t>(d, "dropout_threshold");
  // Absent too in older callers' parameters: contiguous k and v.
  if (d.contains("page_size")) p.page_size = i64("page_size");
  if (d.contains("num_pages")) p.num_pages = i64("num_pages");
  // Absent too in older callers' parameters: k and v in q's dtype.
  if (d.contains("kv_format")) p.kv_format = static_cast<KvFormat>(Field<uint8_t>(d, "kv_format"));
  if (d.contains("q_format")) p.q_format = static_cast<KvFormat>(Field<uint8_t>(d, "q_format"));
  if (d.contains("kv_descale_blocks")) p.kv_descale_blocks = i64("kv_descale_blocks");
  if (d.contains("kv_descale_heads")) p.kv_descale_heads = i64("kv_descale_heads");
  // Absent in the parameters of the CPU's callers (tests, tools): te_jax's own kernels.
  p.engine = d.contains("engine") ? static_cast<Engine>(Field<uint8_t>(d, "engine")) : Engine::kTe;
  // Absent too without score_mod / mask_mod (cpp/core/flex_mods.h).
  if (d.contains("score_mod_library")) p.flex.score_library = Field<std::string>(d, "score_mod_library");
  if (d.contains("mask_mod_library")) p.flex.mask_library = Field<std::string>(d, "mask_mod_library");
  if (d.contains("flex_batch_fold")) p.flex.batch_fold = i64("flex_batch_fold");
  if (d.contains("score_mod_captures")) p.flex.score_captures = i64("score_mod_captures");
  if (d.contains("score_mod_gradients")) p.flex.capture_gradients = i64("score_mod_gradients");
  if (d.contains("flex_block_q")) p.flex.block_q = i64("flex_block_q");
  if (d.contains("flex_block_kv")) p.flex.block_kv = i64("flex_block_kv");
  if (d.contains("flex_capture_shapes")) {
    p.flex.capture_shapes = Field<std::vector<std::vector<int64_t>>>(d, "flex_capture_shapes");
  }
  return p;
}

inline nb::dict DictFromParams(const AttentionParams& p) {
  nb::dict d;
  d["batch"] = p.batch;
  d["seqlen_q"] = p.seqlen_q;
  d["seqlen_kv"] = p.seqlen_kv;
  d["num_heads"] = p.num_heads;
  d["num_kv_heads"] = p.num_kv_heads;
  d["engine"] = static_cast<int>(p.engine);
  d["head_dim"] = p.head_dim;
  d["head_dim_v"] = p.head_dim_v;
  d["dtype"] = static_cast<int>(p.dtype);
  d["mask_type"] = static_cast<int>(p.mask_type);
  d["window_left"] = p.window_left;
  d["window_right"] = p.window_right;
  d["scale"] = p.scale;
  d["softcap"] = p.softcap;
  d["has_alibi"] = p.has_alibi;
  d["has_sinks"] = p.has_sinks;
  d["deterministic"] = p.deterministic;
  d["has_segment_ids"] = p.has_segment_ids;
  d["has_positions"] = p.has_positions;
  d["has_bias"] = p.has_bias;
  d["bias_dtype"] = static_cast<int>(p.bias_dtype);
  d["bias_broadcast"] = static_cast<int>(p.bias_broadcast);
  d["dropout_threshold"] = p.dropout_threshold;
  d["page_size"] = p.page_size;
  d["num_pages"] = p.num_pages;
  d["kv_format"] = static_cast<int>(p.kv_format);
  d["q_format"] = static_cast<int>(p.q_format);
  d["kv_descale_blocks"] = p.kv_descale_blocks;
  d["kv_descale_heads"] = p.kv_descale_heads;
  if (p.flex.active()) {  // absent without mods, as ParamsFromDict reads them
    d["score_mod_library"] = p.flex.score_library;
    d["mask_mod_library"] = p.flex.mask_library;
    d["flex_batch_fold"] = p.flex.batch_fold;
    d["score_mod_captures"] = p.flex.score_captures;
    d["score_mod_gradients"] = p.flex.capture_gradients;
    d["flex_block_q"] = p.flex.block_q;
    d["flex_block_kv"] = p.flex.block_kv;
    d["flex_capture_shapes"] = p.flex.capture_shapes;
  }
  return d;
}

}  // namespace te_jax::bindings
