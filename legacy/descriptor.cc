#include "legacy/descriptor.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpp/core/bias.h"
#include "legacy/wire_format.h"

namespace te_jax::legacy {

std::string PackDescriptor(const AttentionParams& p) {
  Writer w;
  w.Put<uint32_t>(kDescriptorMagic);
  w.Put<uint16_t>(kDescriptorVersion);
  w.Put<uint16_t>(static_cast<uint16_t>(kDescriptorSize));
  for (int64_t v : {p.batch, p.seqlen_q, p.seqlen_kv, p.num_heads, p.num_kv_heads, p.head_dim, p.head_dim_v,
                    p.window_left, p.window_right, p.page_size, p.num_pages}) {
    w.Put<int64_t>(v);
  }
  w.Put<float>(p.scale);
  w.Put<float>(p.softcap);
  w.Put<uint8_t>(static_cast<uint8_t>(p.dtype));
  w.Put<uint8_t>(static_cast<uint8_t>(p.mask_type));
  w.Put<uint8_t>(p.has_alibi ? 1 : 0);
  w.Put<uint8_t>((p.deterministic ? kFlagDeterministic : 0) | (p.has_segment_ids ? kFlagSegmentIds : 0) |
                 (p.has_positions ? kFlagPositions : 0) | (p.has_bias ? kFlagBias : 0) |
                 (p.has_sinks ? kFlagSinks : 0));
  w.Put<uint8_t>(static_cast<uint8_t>(p.engine));
  w.Put<uint8_t>(static_cast<uint8_t>(p.bias_dtype));
  w.Put<uint8_t>(p.bias_broadcast);
  w.Put<uint32_t>(p.dropout_threshold);
  w.Put<uint8_t>(static_cast<uint8_t>(p.kv_format));
  w.Put<int64_t>(p.kv_descale_blocks);
  w.Put<int64_t>(p.kv_descale_heads);
  w.Put<uint8_t>(static_cast<uint8_t>(p.q_format));
  w.Put<uint32_t>(Fnv1a(w.bytes().data(), w.bytes().size()));
  return w.bytes();
}

Status UnpackDescriptor(const char* data, size_t size, AttentionParams* p) {
  if (data == nullptr || size < 8) {
    return Status::InvalidArgument("legacy descriptor is truncated: " + std::to_string(size) +
                                   " bytes, the header alone needs 8");
  }
  Reader header(data, size);
  const uint32_t magic = header.Get<uint32_t>();
  const uint16_t version = header.Get<uint16_t>();
  const uint16_t declared_size = header.Get<uint16_t>();
  if (magic != kDescriptorMagic) {
    return Status::InvalidArgument("legacy descriptor has a wrong magic number: not a te_jax descriptor");
  }
  if (version != kDescriptorVersion) {
    return Status::InvalidArgument("legacy descriptor version " + std::to_string(version) +
                                   " is not supported; this build reads version " +
                                   std::to_string(kDescriptorVersion));
  }
  if (declared_size != kDescriptorSize || size != kDescriptorSize) {
    return Status::InvalidArgument("legacy descriptor size mismatch: got " + std::to_string(size) +
                                   " bytes (header says " + std::to_string(declared_size) + "), expected " +
                                   std::to_string(kDescriptorSize));
  }
  Reader r(data + 8, size - 8);
  AttentionParams out;
  int64_t* dims[] = {&out.batch,     &out.seqlen_q,     &out.seqlen_kv,    &out.num_heads, &out.num_kv_heads,
                     &out.head_dim,  &out.head_dim_v,   &out.window_left,  &out.window_right,
                     &out.page_size, &out.num_pages};
  for (int64_t* d : dims) *d = r.Get<int64_t>();
  out.scale = r.Get<float>();
  out.softcap = r.Get<float>();
  const uint8_t dtype = r.Get<uint8_t>();
  const uint8_t mask_type = r.Get<uint8_t>();
  const uint8_t has_alibi = r.Get<uint8_t>();
  const uint8_t flags = r.Get<uint8_t>();
  const uint8_t engine = r.Get<uint8_t>();
  const uint8_t bias_dtype = r.Get<uint8_t>();
  const uint8_t bias_broadcast = r.Get<uint8_t>();
  const uint32_t dropout_threshold = r.Get<uint32_t>();
  const uint8_t kv_format = r.Get<uint8_t>();
  out.kv_descale_blocks = r.Get<int64_t>();
  out.kv_descale_heads = r.Get<int64_t>();
  const uint8_t q_format = r.Get<uint8_t>();
  const uint32_t checksum = r.Get<uint32_t>();
  if (checksum != Fnv1a(data, kDescriptorSize - 4)) {
    return Status::InvalidArgument("legacy descriptor checksum mismatch: the bytes were corrupted");
  }
  if (dtype >= kNumDTypes || mask_type >= kNumMaskTypes || has_alibi > 1 || engine >= kNumEngines ||
      bias_dtype >= kNumDTypes || bias_broadcast > kBroadcastAll || kv_format >= kNumKvFormats ||
      q_format >= kNumKvFormats) {
    return Status::InvalidArgument("legacy descriptor has an out-of-range enum field (dtype " +
                                   std::to_string(dtype) + ", mask_type " + std::to_string(mask_type) +
                                   ", has_alibi " + std::to_string(has_alibi) + ", engine " + std::to_string(engine) +
                                   ", bias_dtype " + std::to_string(bias_dtype) + ", bias_broadcast " +
                                   std::to_string(bias_broadcast) + ", kv_format " + std::to_string(kv_format) + ")");
  }
  if ((flags & ~kKnownFlags) != 0) {
    return Status::InvalidArgument("legacy descriptor field flags has unknown bits set (" + std::to_string(flags) +
                                   "); only bits 0 (deterministic), 1 (has_segment_ids), 2 (has_positions), 3 "
                                   "(has_bias) and 4 (has_sinks) are defined");
  }
  out.dtype = static_cast<DType>(dtype);
  out.mask_type = static_cast<MaskType>(mask_type);
  out.has_alibi = has_alibi == 1;
  out.engine = static_cast<Engine>(engine);
  out.deterministic = (flags & kFlagDeterministic) != 0;
  out.has_segment_ids = (flags & kFlagSegmentIds) != 0;
  out.has_positions = (flags & kFlagPositions) != 0;
  out.has_bias = (flags & kFlagBias) != 0;
  out.has_sinks = (flags & kFlagSinks) != 0;
  out.bias_dtype = static_cast<DType>(bias_dtype);
  out.bias_broadcast = bias_broadcast;
  out.dropout_threshold = dropout_threshold;
  out.kv_format = static_cast<KvFormat>(kv_format);
  out.q_format = static_cast<KvFormat>(q_format);
  *p = out;
  return Status::Ok();
}

}  // namespace te_jax::legacy
