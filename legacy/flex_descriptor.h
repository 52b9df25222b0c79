// The score_mod / mask_mod part of a legacy call (FlexSpec, cpp/core/flex_mods.h): a second framed block after the
// descriptor (descriptor.h) in the opaque bytes, present only for a call with mods, so a call without them carries
// the descriptor alone, unchanged.
//
// Wire format, little-endian, no padding:
//   u32 magic "TEJF" | u32 total size | u16 n, n bytes: the score_mod's library | u16 n, n bytes: the mask_mod's |
//   i64 batch_fold | i64 score_captures | i64 capture_gradients | i64 block_q | i64 block_kv | u16 captures | per capture: u8 rank, i64 x rank (its shape) |
//   u32 FNV-1a checksum of every byte before it
#pragma once

#include <cstddef>
#include <string>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"

namespace te_jax::legacy {

inline constexpr uint32_t kFlexDescriptorMagic = 0x464A4554;  // "TEJF" read as little-endian u32

// A legacy call's opaque bytes: the descriptor, then the flex block when params.flex.active().
std::string PackOpaque(const AttentionParams& params);

// Decodes both parts and checks their framing; bytes after the descriptor must be a whole flex block.
Status UnpackOpaque(const char* data, size_t size, AttentionParams* params);

}  // namespace te_jax::legacy
