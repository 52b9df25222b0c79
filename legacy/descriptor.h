// The opaque descriptor of the legacy custom calls: an AttentionParams packed into bytes by the nanobind module at
// lowering time and decoded by the legacy handlers at run time. It is versioned, length-checked and checksummed, so a
// truncated, oversized or garbled descriptor is refused with a message instead of being read as parameters.
//
// Wire format, little-endian, no padding:
//   u32 magic "TEJD" | u16 version | u16 total size | i64 x 11 (batch, seqlen_q, seqlen_kv, num_heads, num_kv_heads,
//   head_dim, head_dim_v, window_left, window_right, page_size, num_pages) | f32 scale | f32 softcap | u8 dtype |
//   u8 mask_type | u8 has_alibi | u8 flags | u8 engine | u8 bias_dtype | u8 bias_broadcast | u32 dropout_threshold |
//   u8 kv_format | i64 kv_descale_blocks | i64 kv_descale_heads | u8 q_format | u32 FNV-1a checksum of every byte
//   before it
// flags: bit 0 deterministic, bit 1 has_segment_ids, bit 2 has_positions, bit 3 has_bias, bit 4 has_sinks; the other
// bits must be 0.
// Version 2 turned version 1's reserved zero byte into flags; version 3 added the engine (cpp/core/engine.h); version 4 the
// flag bits 1 and 2 and, with them, the four packed-sequence operands of every call (legacy/legacy_buffers.h);
// version 5 the bias (flag bit 3, its dtype and broadcast bits, cpp/core/bias.h), its operand and the backward's dbias;
// version 6 the dropout threshold (cpp/core/attention_params.h) and the dropout operand (key and offsets) of every call;
// version 7 the paged KV cache's page_size and num_pages (cpp/core/attention_params.h) and the page_table operand of every
// call (legacy/legacy_buffers.h); version 8 flag bit 4 (attention sinks) and the sinks operand of every call; version 9
// the FP8 KV cache's kv_format and descale dims (cpp/core/kv_format.h) and the kv_descale operand of every call;
// version 10 FP8 attention's q_format (cpp/core/attention_params.h).
#pragma once

#include <cstddef>
#include <string>

#include "cpp/core/attention_params.h"
#include "cpp/core/status.h"

namespace te_jax::legacy {

inline constexpr uint32_t kDescriptorMagic = 0x444A4554;  // "TEJD" read as little-endian u32
inline constexpr uint16_t kDescriptorVersion = 10;
inline constexpr uint8_t kFlagDeterministic = 1 << 0;
inline constexpr uint8_t kFlagSegmentIds = 1 << 1;
inline constexpr uint8_t kFlagPositions = 1 << 2;
inline constexpr uint8_t kFlagBias = 1 << 3;
inline constexpr uint8_t kFlagSinks = 1 << 4;
inline constexpr uint8_t kKnownFlags = kFlagDeterministic | kFlagSegmentIds | kFlagPositions | kFlagBias | kFlagSinks;
inline constexpr size_t kDescriptorSize = 4 + 2 + 2 + 11 * 8 + 4 + 4 + 7 + 4 + 1 + 2 * 8 + 1 + 4;

std::string PackDescriptor(const AttentionParams& params);

// Decodes and checks the framing (magic, version, size, checksum, enum ranges). The parameter values themselves are
// checked by ValidateAttentionParams, which the backends run on either path.
Status UnpackDescriptor(const char* data, size_t size, AttentionParams* params);

}  // namespace te_jax::legacy
