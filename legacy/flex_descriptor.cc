#include "legacy/flex_descriptor.h"

#include <cstdint>
#include <vector>

#include "legacy/descriptor.h"
#include "legacy/wire_format.h"

namespace te_jax::legacy {
namespace {

std::string PackFlex(const FlexSpec& f) {
  Writer w;
  for (const std::string* library : {&f.score_library, &f.mask_library}) {
    w.Put<uint16_t>(static_cast<uint16_t>(library->size()));
    w.PutBytes(*library);
  }
  w.Put<int64_t>(f.batch_fold);
  w.Put<int64_t>(f.score_captures);
  w.Put<int64_t>(f.capture_gradients);
  w.Put<int64_t>(f.block_q);
  w.Put<int64_t>(f.block_kv);
  w.Put<uint16_t>(static_cast<uint16_t>(f.num_captures()));
  for (const std::vector<int64_t>& shape : f.capture_shapes) {
    w.Put<uint8_t>(static_cast<uint8_t>(shape.size()));
    for (int64_t extent : shape) w.Put<int64_t>(extent);
  }
  const std::string& body = w.bytes();
  Writer block;
  block.Put<uint32_t>(kFlexDescriptorMagic);
  block.Put<uint32_t>(static_cast<uint32_t>(4 + 4 + body.size() + 4));
  block.PutBytes(body);
  block.Put<uint32_t>(Fnv1a(block.bytes().data(), block.bytes().size()));
  return block.bytes();
}

Status UnpackFlex(const char* data, size_t size, FlexSpec* f) {
  Reader header(data, size);
  const uint32_t magic = header.Get<uint32_t>();
  const uint32_t declared_size = header.Get<uint32_t>();
  if (header.overrun() || magic != kFlexDescriptorMagic) {
    return Status::InvalidArgument("legacy descriptor size mismatch: got " + std::to_string(kDescriptorSize + size) +
                                   " bytes, expected " + std::to_string(kDescriptorSize) + " (or that and a "
                                   "score_mod/mask_mod block, which the bytes after the descriptor are not)");
  }
  if (declared_size != size || size < 12) {
    return Status::InvalidArgument("legacy score_mod/mask_mod block size mismatch: got " + std::to_string(size) +
                                   " bytes (header says " + std::to_string(declared_size) + ")");
  }
  if (Reader(data + size - 4, 4).Get<uint32_t>() != Fnv1a(data, size - 4)) {
    return Status::InvalidArgument("legacy score_mod/mask_mod block checksum mismatch: the bytes were corrupted");
  }
  Reader r(data + 8, size - 12);
  FlexSpec out;
  out.score_library = r.GetBytes(r.Get<uint16_t>());
  out.mask_library = r.GetBytes(r.Get<uint16_t>());
  out.batch_fold = r.Get<int64_t>();
  out.score_captures = r.Get<int64_t>();
  out.capture_gradients = r.Get<int64_t>();
  out.block_q = r.Get<int64_t>();
  out.block_kv = r.Get<int64_t>();
  const uint16_t captures = r.Get<uint16_t>();
  for (uint16_t i = 0; i < captures && !r.overrun(); ++i) {
    std::vector<int64_t> shape(r.Get<uint8_t>());
    for (int64_t& extent : shape) extent = r.Get<int64_t>();
    out.capture_shapes.push_back(shape);
  }
  if (r.overrun() || r.position() != size - 12) {
    return Status::InvalidArgument("legacy score_mod/mask_mod block: its fields do not fill its " +
                                   std::to_string(size) + " bytes");
  }
  *f = out;
  return Status::Ok();
}

}  // namespace

std::string PackOpaque(const AttentionParams& params) {
  return PackDescriptor(params) + (params.flex.active() ? PackFlex(params.flex) : std::string());
}

Status UnpackOpaque(const char* data, size_t size, AttentionParams* params) {
  if (size <= kDescriptorSize) return UnpackDescriptor(data, size, params);
  TE_JAX_RETURN_IF_ERROR(UnpackDescriptor(data, kDescriptorSize, params));
  return UnpackFlex(data + kDescriptorSize, size - kDescriptorSize, &params->flex);
}

}  // namespace te_jax::legacy
