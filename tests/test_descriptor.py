"""The legacy opaque descriptor (legacy/descriptor.{h,cc}) through the extension's pack_descriptor/unpack_descriptor,
and the core validation through validate(). Malformed bytes must raise ValueError, never crash or decode.

Wire format, little-endian: u32 magic "TEJD" | u16 version (10) | u16 size | 11 x i64 (dims, window, page_size,
num_pages) | 2 x f32 | u8 dtype |
u8 mask_type | u8 has_alibi | u8 flags (bit 0: deterministic, bit 1: has_segment_ids,
bit 2: has_positions, bit 3: has_bias, bit 4: has_sinks) | u8 engine | u8 bias_dtype | u8 bias_broadcast |
u32 dropout_threshold | u8 kv_format | 2 x i64 (kv_descale blocks, heads) | u8 q_format | u32 FNV-1a.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

# A plain import: a core extension that fails to import must fail the run, not skip these tests.
from te_jax import _te_jax_cpu as te_jax_cpu

FORMAT = "<4sHH11q2f7BIB2qBI"
SIZE = struct.calcsize(FORMAT)
I64_FIELDS = ("batch", "seqlen_q", "seqlen_kv", "num_heads", "num_kv_heads", "head_dim", "head_dim_v", "window_left",
              "window_right", "page_size", "num_pages")

PARAMS = dict(batch=3, seqlen_q=37, seqlen_kv=65, num_heads=4, num_kv_heads=2, head_dim=32, head_dim_v=16, dtype=1,
              mask_type=5, window_left=4, window_right=-1, scale=0.125, softcap=2.5, has_alibi=True, has_sinks=True,
              deterministic=True, engine=0, has_segment_ids=False, has_positions=False, has_bias=True, bias_dtype=2,
              bias_broadcast=0b0101, dropout_threshold=0x9ABC, page_size=16, num_pages=40, kv_format=1,
              kv_descale_blocks=40, kv_descale_heads=2, q_format=2)
# PARAMS exercises every descriptor field; a paged call takes no bias or dropout, so validation starts from contiguous
# k and v.
CONTIGUOUS = dict(PARAMS, page_size=0, num_pages=0, kv_format=0, kv_descale_blocks=1, kv_descale_heads=1, q_format=0)
# A valid paged forward: k and v are pools of num_pages pages, seqlen_kv the capacity (4 pages of 16 per sequence).
PAGED = dict(CONTIGUOUS, seqlen_kv=64, page_size=16, num_pages=40, has_bias=False, bias_dtype=0, bias_broadcast=15,
             dropout_threshold=0)


def fnv1a(data: bytes) -> int:
  h = 2166136261
  for byte in data:
    h ^= byte
    h = (h * 16777619) & 0xFFFFFFFF
  return h


def craft(version=10, size=SIZE, magic=b"TEJD", flags=None, **overrides) -> bytes:
  """A descriptor with a correct checksum for arbitrary field values (PARAMS overridden by `overrides`); `flags`
  replaces the flags byte the params give."""
  p = dict(PARAMS, **overrides)
  if flags is None:
    flags = (int(p["deterministic"]) | int(p["has_segment_ids"]) << 1 | int(p["has_positions"]) << 2 |
             int(p["has_bias"]) << 3 | int(p["has_sinks"]) << 4)
  body = struct.pack(FORMAT[:-1], magic, version, size, *(p[n] for n in I64_FIELDS), p["scale"], p["softcap"],
                     p["dtype"], p["mask_type"], int(p["has_alibi"]), flags, p["engine"], p["bias_dtype"],
                     p["bias_broadcast"], p["dropout_threshold"], p["kv_format"], p["kv_descale_blocks"],
                     p["kv_descale_heads"], p["q_format"])
  return body + struct.pack("<I", fnv1a(body))


@pytest.fixture(scope="module")
def packed() -> bytes:
  return te_jax_cpu.pack_descriptor(PARAMS)


def test_size_and_layout(packed):
  assert te_jax_cpu.descriptor_size == SIZE == len(packed) == 137
  fields = struct.unpack(FORMAT, packed)
  assert fields[0] == b"TEJD" and fields[1] == 10 and fields[2] == SIZE
  assert fields[3:14] == tuple(PARAMS[n] for n in I64_FIELDS)
  assert fields[14:16] == (PARAMS["scale"], PARAMS["softcap"])
  assert fields[16:23] == (PARAMS["dtype"], PARAMS["mask_type"], 1, 1 | 8 | 16, PARAMS["engine"], PARAMS["bias_dtype"],
                           PARAMS["bias_broadcast"])
  assert fields[23] == PARAMS["dropout_threshold"]
  assert fields[24:28] == (PARAMS["kv_format"], PARAMS["kv_descale_blocks"], PARAMS["kv_descale_heads"],
                           PARAMS["q_format"])
  assert fields[28] == fnv1a(packed[:-4])
  # The Python encoder here agrees with the C++ one byte for byte.
  assert craft() == packed


@pytest.mark.parametrize("params", [
    PARAMS,
    dict(PARAMS, dtype=0, mask_type=0, has_alibi=False, window_left=-1, softcap=0.0, deterministic=False),
    dict(PARAMS, dtype=2, mask_type=2, batch=0, seqlen_q=0, window_left=0, window_right=0),
    dict(PARAMS, batch=2**40, seqlen_kv=2**62, window_right=2**31, scale=np.float32(1e-3).item(), page_size=2**33,
         num_pages=2**50),
], ids=["typical", "defaults", "zeros", "large"])
def test_round_trip(params):
  data = te_jax_cpu.pack_descriptor(params)
  back = te_jax_cpu.unpack_descriptor(data)
  assert set(back) == set(params)
  for key, value in params.items():
    if key in ("scale", "softcap"):
      assert back[key] == np.float32(value), key  # stored as float32
    else:
      assert back[key] == value, key
  assert te_jax_cpu.pack_descriptor(back) == data


def test_scale_is_rounded_to_float32():
  back = te_jax_cpu.unpack_descriptor(te_jax_cpu.pack_descriptor(dict(PARAMS, scale=0.1)))
  assert back["scale"] == float(np.float32(0.1)) != 0.1


def test_every_truncation_raises(packed):
  for n in range(len(packed)):
    with pytest.raises(ValueError, match="legacy descriptor"):
      te_jax_cpu.unpack_descriptor(packed[:n])


@pytest.mark.parametrize("extra", [1, 3, 4, 8, 96, 1000, 70000])
def test_oversize_raises(packed, extra):
  with pytest.raises(ValueError, match="size mismatch"):
    te_jax_cpu.unpack_descriptor(packed + b"\0" * extra)
  with pytest.raises(ValueError, match="size mismatch"):
    te_jax_cpu.unpack_descriptor(packed + packed[:extra])


@pytest.mark.parametrize("declared", [SIZE - 1, SIZE + 1, SIZE + 4, 0, 0xFFFF])
def test_consistent_but_wrong_declared_size_raises(declared):
  """Header size field changed with a recomputed checksum; payload padded/cut to match the declared size."""
  data = craft(size=declared)
  payload = (data[:-4] + b"\0" * max(0, declared - SIZE))[: max(declared - 4, 8)]
  payload += struct.pack("<I", fnv1a(payload))
  for candidate in (data, payload):
    with pytest.raises(ValueError, match="size mismatch"):
      te_jax_cpu.unpack_descriptor(candidate)


def test_every_single_byte_corruption_raises(packed):
  """Every byte, every non-zero XOR pattern (all 255 ways of flipping bits in it): 137 * 255 corruptions."""
  buf = bytearray(packed)
  failures = []
  for i in range(len(buf)):
    original = buf[i]
    for mask in range(1, 256):
      buf[i] = original ^ mask
      try:
        te_jax_cpu.unpack_descriptor(bytes(buf))
        failures.append((i, mask))
      except ValueError:
        pass
    buf[i] = original
  assert not failures, f"corruptions accepted (byte, xor): {failures[:10]}"
  te_jax_cpu.unpack_descriptor(bytes(buf))  # restored buffer still decodes


def test_corruption_messages(packed):
  def corrupt(i):
    b = bytearray(packed)
    b[i] ^= 0x01
    return bytes(b)

  with pytest.raises(ValueError, match="magic"):
    te_jax_cpu.unpack_descriptor(corrupt(0))
  with pytest.raises(ValueError, match="version"):
    te_jax_cpu.unpack_descriptor(corrupt(4))
  with pytest.raises(ValueError, match="size"):
    te_jax_cpu.unpack_descriptor(corrupt(6))
  for i in (8, 50, 80, 88, 96, 107, 108, 111):
    with pytest.raises(ValueError, match="checksum"):
      te_jax_cpu.unpack_descriptor(corrupt(i))


def test_fuzz_random_bytes():
  rng = np.random.default_rng(20240601)
  for _ in range(3000):
    n = int(rng.choice([rng.integers(0, 200), SIZE]))
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    with pytest.raises(ValueError):
      te_jax_cpu.unpack_descriptor(data)


def test_fuzz_valid_header_random_body():
  """Past the magic/version/size checks, random bodies must fail the checksum."""
  rng = np.random.default_rng(7)
  header = struct.pack("<4sHH", b"TEJD", 10, SIZE)
  for _ in range(3000):
    data = header + rng.integers(0, 256, SIZE - 8, dtype=np.uint8).tobytes()
    with pytest.raises(ValueError, match="checksum"):
      te_jax_cpu.unpack_descriptor(data)


def test_fuzz_random_fields_with_valid_checksum():
  """Correctly checksummed descriptors with random enum and flags bytes decode iff every enum is in range and no
  unknown flag is set."""
  rng = np.random.default_rng(11)
  for _ in range(2000):
    dtype, mask, alibi, flags, engine, bias_dtype, broadcast = (int(x) for x in rng.integers(0, 256, 7))
    if rng.random() < 0.5:  # make in-range values common too
      dtype, mask, alibi, flags, engine = dtype % 3, mask % 6, alibi % 2, flags % 32, engine % 2
      bias_dtype, broadcast = bias_dtype % 3, broadcast % 16
    data = craft(dtype=dtype, mask_type=mask, has_alibi=alibi, flags=flags, engine=engine, bias_dtype=bias_dtype,
                 bias_broadcast=broadcast)
    if dtype < 3 and mask < 6 and alibi < 2 and flags < 32 and engine < 2 and bias_dtype < 3 and broadcast < 16:
      back = te_jax_cpu.unpack_descriptor(data)
      assert (back["dtype"], back["mask_type"], back["has_alibi"], back["deterministic"], back["has_segment_ids"],
              back["has_positions"], back["has_bias"], back["has_sinks"], back["engine"], back["bias_dtype"],
              back["bias_broadcast"]) == (dtype, mask, bool(alibi), bool(flags & 1), bool(flags & 2), bool(flags & 4),
                                          bool(flags & 8), bool(flags & 16), engine, bias_dtype, broadcast)
    else:
      with pytest.raises(ValueError, match="out-of-range enum|flags has unknown bits"):
        te_jax_cpu.unpack_descriptor(data)


# 1: the format before the flags byte (its reserved byte is refused, not read as deterministic=False); 2: before the
# engine byte; 3: before the packed-sequence flags (and operands); 4: before the bias; 5: before dropout; 6: before
# the page table; 7: before the sinks operand; 8: before the FP8 KV cache; 9: before FP8 attention (q_format).
@pytest.mark.parametrize("version", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 0xFFFF])
def test_wrong_version_raises(version):
  with pytest.raises(ValueError, match=f"version {version} is not supported; this build reads version 10"):
    te_jax_cpu.unpack_descriptor(craft(version=version, flags=0))


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_is_flags_bit_0(deterministic):
  data = te_jax_cpu.pack_descriptor(dict(PARAMS, deterministic=deterministic))
  assert struct.unpack(FORMAT, data)[19] & 1 == int(deterministic)
  assert te_jax_cpu.unpack_descriptor(data)["deterministic"] is deterministic


@pytest.mark.parametrize("segment_ids,positions", [(False, False), (True, False), (False, True), (True, True)])
def test_packed_sequence_flags_are_bits_1_and_2(segment_ids, positions):
  data = te_jax_cpu.pack_descriptor(dict(PARAMS, has_segment_ids=segment_ids, has_positions=positions))
  assert struct.unpack(FORMAT, data)[19] == 1 | int(segment_ids) << 1 | int(positions) << 2 | 8 | 16
  back = te_jax_cpu.unpack_descriptor(data)
  assert (back["has_segment_ids"], back["has_positions"]) == (segment_ids, positions)


@pytest.mark.parametrize("has_sinks", [False, True])
def test_sinks_is_flags_bit_4(has_sinks):
  data = te_jax_cpu.pack_descriptor(dict(PARAMS, has_sinks=has_sinks))
  assert struct.unpack(FORMAT, data)[19] == 1 | 8 | int(has_sinks) << 4
  assert te_jax_cpu.unpack_descriptor(data)["has_sinks"] is has_sinks


@pytest.mark.parametrize("has_bias,dtype,broadcast", [(False, 0, 15), (True, 1, 0), (True, 0, 0b1001)])
def test_bias_is_flags_bit_3_then_its_dtype_and_broadcast_bytes(has_bias, dtype, broadcast):
  data = te_jax_cpu.pack_descriptor(dict(PARAMS, has_bias=has_bias, bias_dtype=dtype, bias_broadcast=broadcast))
  fields = struct.unpack(FORMAT, data)
  assert (fields[19] >> 3 & 1, fields[21], fields[22]) == (int(has_bias), dtype, broadcast)
  back = te_jax_cpu.unpack_descriptor(data)
  assert (back["has_bias"], back["bias_dtype"], back["bias_broadcast"]) == (has_bias, dtype, broadcast)


@pytest.mark.parametrize("threshold", [0, 1, 2**31, 2**32 - 1])
def test_dropout_threshold_is_a_u32_after_the_bias_bytes(threshold):
  data = te_jax_cpu.pack_descriptor(dict(PARAMS, dropout_threshold=threshold))
  assert struct.unpack(FORMAT, data)[23] == threshold
  assert te_jax_cpu.unpack_descriptor(data)["dropout_threshold"] == threshold


@pytest.mark.parametrize("field,value", [("bias_dtype", 3), ("bias_broadcast", 16), ("bias_broadcast", 255),
                                         ("kv_format", 3)])
def test_bias_fields_out_of_range_raise(field, value):
  with pytest.raises(ValueError, match=f"out-of-range enum.*{field} {value}"):
    te_jax_cpu.unpack_descriptor(craft(**{field: value}))


@pytest.mark.parametrize("flags", [0x20, 0x39, 0x80, 0xFF])
def test_unknown_flag_bits_raise(flags):
  with pytest.raises(ValueError, match=rf"legacy descriptor field flags has unknown bits set \({flags}\); only bits 0 "
                                       r"\(deterministic\), 1 \(has_segment_ids\), 2 \(has_positions\), 3 "
                                       r"\(has_bias\) and 4 \(has_sinks\) are defined"):
    te_jax_cpu.unpack_descriptor(craft(flags=flags))


def test_correct_version_crafted_decodes():
  assert te_jax_cpu.unpack_descriptor(craft())["mask_type"] == PARAMS["mask_type"]


@pytest.mark.parametrize("field,value", [("dtype", 3), ("dtype", 255), ("mask_type", 6), ("mask_type", 200),
                                         ("has_alibi", 2)])
def test_enum_out_of_range_with_valid_checksum_raises(field, value):
  with pytest.raises(ValueError, match="out-of-range enum"):
    te_jax_cpu.unpack_descriptor(craft(**{field: value}))


@pytest.mark.parametrize("field,value", [("dtype", 3), ("mask_type", 6)])
def test_validate_refuses_enum_out_of_range(field, value):
  with pytest.raises(ValueError, match=field):
    te_jax_cpu.validate(dict(CONTIGUOUS, **{field: value}), 0)


@pytest.mark.parametrize("overrides,match", [
    (dict(head_dim=12), "head_dim"), (dict(head_dim_v=264), "head_dim_v"), (dict(head_dim=0), "head_dim"),
    (dict(num_heads=3), "num_heads"), (dict(num_kv_heads=0), "num_kv_heads"), (dict(batch=-1), "batch"),
    (dict(seqlen_q=-1), "seqlen_q"), (dict(window_left=-2), "window_size"), (dict(window_right=-3), "window_size"),
    (dict(scale=0.0), "scale"), (dict(scale=float("nan")), "scale"), (dict(scale=1e39), "scale"),
    (dict(softcap=-1.0), "softcap"), (dict(softcap=float("inf")), "softcap"),
])
def test_validate_refuses_bad_values(overrides, match):
  with pytest.raises(ValueError, match=match):
    te_jax_cpu.validate(dict(CONTIGUOUS, **overrides), 0)


def test_validate_accepts_and_backend_rules():
  PARAMS = dict(CONTIGUOUS, has_sinks=False)  # noqa: N806 (the rules below are about contiguous k and v)
  te_jax_cpu.validate(PARAMS, 0)
  te_jax_cpu.validate(dict(PARAMS, has_sinks=True), 0)
  # Sinks are merged by te_jax's kernels; after cuDNN's the lowering merges them, so the cuDNN engine never gets them.
  with pytest.raises(ValueError, match="has_sinks goes with engine te only"):
    te_jax_cpu.validate(dict(PARAMS, has_sinks=True, engine=1), 1)
  no_bias = dict(PARAMS, has_bias=False, bias_dtype=0, bias_broadcast=15)
  te_jax_cpu.validate(dict(no_bias, dropout_threshold=0), 1)  # bf16 on CUDA is fine
  for engine in (0, 1):  # the shared rules take dropout on CUDA (the cuDNN engine's own contract refuses it)
    te_jax_cpu.validate(dict(no_bias, engine=engine), 1)
  with_bias = dict(PARAMS, dropout_threshold=0)  # bias [1, H, 1, Skv] of [3, 4, 37, 65], deterministic=True
  for engine in (0, 1):  # CUDA takes a bias (te_jax's kernels; cuDNN's contract refuses it when the engine is chosen)
    te_jax_cpu.validate(dict(with_bias, engine=engine), 1)
  # The CUDA backward sums dbias over broadcast dims with float atomics: deterministic=True needs a bias whose
  # gradient sums over no dim (full shape, or size-1 dims of extent 1). The CPU backward's sums are deterministic.
  with pytest.raises(ValueError, match=r"deterministic=True with a broadcast bias \(shape \[1, 4, 1, 65\] for "
                                       r"\[B, H, Sq, Skv\] = \[3, 4, 37, 65\]\) on the GPU.*full shape"):
    te_jax_cpu.validate(with_bias, 1, "backward")
  te_jax_cpu.validate(with_bias, 0, "backward")
  te_jax_cpu.validate(dict(with_bias, deterministic=False), 1, "backward")
  te_jax_cpu.validate(dict(with_bias, bias_broadcast=0), 1, "backward")
  te_jax_cpu.validate(dict(with_bias, batch=1, seqlen_q=1), 1, "backward")
  with pytest.raises(ValueError, match="float32"):
    te_jax_cpu.validate(dict(PARAMS, dtype=0), 1)  # CUDA refuses float32
  te_jax_cpu.validate(dict(PARAMS, dtype=0), 0)
  for backend in (-1, 2, 99):
    with pytest.raises(ValueError, match="backend"):
      te_jax_cpu.validate(PARAMS, backend)


def test_validate_paging():
  te_jax_cpu.validate(PAGED, 0)
  te_jax_cpu.validate(dict(PAGED, mask_type=3, num_pages=0), 0)  # padding; an empty pool (every length must be 0)
  for page_size in (8, 24, 256):
    te_jax_cpu.validate(dict(PAGED, page_size=page_size, seqlen_kv=3 * page_size), 0)
  # The CUDA backend reads pages in its decode kernels: up to 16 query positions (PAGED has 37).
  te_jax_cpu.validate(dict(PAGED, seqlen_q=16), 1)
  with pytest.raises(ValueError, match="the CUDA backend reads a paged KV cache in place for at most 16 query "
                                       "positions .* got seqlen_q=37"):
    te_jax_cpu.validate(PAGED, 1)
  with pytest.raises(ValueError, match="the backward takes no paged KV cache"):
    te_jax_cpu.validate(PAGED, 0, "backward")
  te_jax_cpu.validate(CONTIGUOUS, 0, "backward")
  with pytest.raises(ValueError, match="direction must be 'forward' or 'backward'"):
    te_jax_cpu.validate(PAGED, 0, "sideways")


def test_validate_fp8_kv_cache():
  """An FP8 KV cache: descales per tensor, head, or page (paged) / batch entry (contiguous); the forward only. Which
  FP8 calls the CUDA kernels serve is their module decision's (Fp8Refusal; tests/test_cuda_nvrtc_compile.py), not the
  core's."""
  fp8 = lambda params, blocks=1, heads=1: dict(params, kv_format=2, kv_descale_blocks=blocks, kv_descale_heads=heads)
  for blocks, heads in ((1, 1), (1, 2), (40, 1), (40, 2)):
    te_jax_cpu.validate(fp8(PAGED, blocks, heads), 0)
  te_jax_cpu.validate(fp8(CONTIGUOUS, 3, 2), 0)
  with pytest.raises(ValueError, match=r"blocks 1 or 3 \(the batch entries\) and heads 1 or 2, got \[2, 40, 2\]"):
    te_jax_cpu.validate(fp8(CONTIGUOUS, 40, 2), 0)
  with pytest.raises(ValueError, match=r"blocks 1 or 40 \(the pool's pages\) and heads 1 or 2, got \[2, 1, 4\]"):
    te_jax_cpu.validate(fp8(PAGED, 1, 4), 0)
  with pytest.raises(ValueError, match="must be the float32 \\[1, 1, 1\\] placeholder"):
    te_jax_cpu.validate(dict(CONTIGUOUS, kv_descale_heads=2), 0)
  with pytest.raises(ValueError, match=r"q_format must be as_q \(0\), e4m3 \(1\) or e5m2 \(2\), got codes 3 and 0"):
    te_jax_cpu.validate(dict(CONTIGUOUS, kv_format=3), 0)
  te_jax_cpu.validate(dict(fp8(PAGED, 40, 2), seqlen_q=1), 1)
  with pytest.raises(ValueError, match="the backward takes no FP8 KV cache"):
    te_jax_cpu.validate(fp8(CONTIGUOUS), 0, "backward")


def test_validate_fp8_attention():
  """FP8 q, k and v (q_format): the CUDA kernels alone take them as they are, with the descales operand [3, 1, H] and
  whole 16-key groups; the CPU backend is given the dequantized values."""
  plain = dict(CONTIGUOUS, has_bias=False, bias_dtype=0, bias_broadcast=15, dropout_threshold=0, has_alibi=False,
               seqlen_kv=64)
  fp8 = dict(plain, q_format=1, kv_format=1, kv_descale_heads=4)
  te_jax_cpu.validate(fp8, 1)
  with pytest.raises(ValueError, match="reach only the CUDA kernels as they are"):
    te_jax_cpu.validate(fp8, 0)
  with pytest.raises(ValueError, match="k and v in q's FP8 format"):
    te_jax_cpu.validate(dict(fp8, kv_format=2), 1)
  with pytest.raises(ValueError, match=r"must be float32 \[3, 1, H\] with H = 4 .* got \[3, 1, 2\]"):
    te_jax_cpu.validate(dict(fp8, kv_descale_heads=2), 1)
  with pytest.raises(ValueError, match="a multiple of 16 keys .* got seqlen_kv 65"):
    te_jax_cpu.validate(dict(fp8, seqlen_kv=65), 1)
  with pytest.raises(ValueError, match="the backward takes no FP8 q, k and v"):
    te_jax_cpu.validate(fp8, 1, "backward")


@pytest.mark.parametrize("overrides,match", [
    (dict(page_size=12, seqlen_kv=48), r"page_size must be 0 \(contiguous k and v\) or a multiple of 8 in \[8, 256\], "
     "got 12"),
    (dict(page_size=264, seqlen_kv=264), "page_size must be 0 .* got 264"),
    (dict(page_size=-8), "page_size must be 0 .* got -8"),
    (dict(page_size=0, num_pages=3), "num_pages must be 0 without a paged KV cache"),
    (dict(num_pages=-1), "num_pages >= 0"),
    (dict(seqlen_kv=40), "seqlen_kv .* a multiple of page_size 16 up to 2147483647"),
    (dict(seqlen_kv=2**31), "got num_pages=40 seqlen_kv=2147483648"),
    (dict(mask_type=0), "padding or padding_causal_bottom_right .* got no_mask"),
    (dict(mask_type=1), "got causal"),
    (dict(mask_type=2), "got causal_bottom_right"),
    (dict(mask_type=4), "got padding_causal$"),
    (dict(has_segment_ids=True), "takes no segment ids or positions"),
    (dict(has_positions=True), "takes no segment ids or positions"),
    (dict(has_bias=True, bias_broadcast=0), r"takes no bias \(has_bias must be false\)"),
    (dict(dropout_threshold=5), r"takes no dropout \(dropout_threshold must be 0\)"),
])
def test_validate_refuses_bad_paging(overrides, match):
  with pytest.raises(ValueError, match=match):
    te_jax_cpu.validate(dict(PAGED, **overrides), 0)


@pytest.mark.parametrize("threshold,ok", [(2**16 - 1, True), (2**16, False), (2**32 - 1, False)])
def test_validate_takes_a_16_bit_dropout_threshold(threshold, ok):
  params = dict(CONTIGUOUS, dropout_threshold=threshold)
  if ok:
    te_jax_cpu.validate(params, 0)
  else:
    with pytest.raises(ValueError, match=r"dropout_threshold must be below 2\^16 .* got " + str(threshold)):
      te_jax_cpu.validate(params, 0)


def test_values_unpack_accepts_but_validate_refuses():
  """Framing and values are checked separately: a well-framed descriptor with bad values decodes, then validate
  (which both custom-call paths run) refuses it."""
  params = te_jax_cpu.unpack_descriptor(craft(window_left=-7, head_dim=12))
  assert params["window_left"] == -7
  with pytest.raises(ValueError):
    te_jax_cpu.validate(params, 0)


@pytest.mark.parametrize("bad", [None, "TEJD", bytearray(96), memoryview(b"x" * 96), 96])
def test_unpack_wrong_python_type(bad):
  with pytest.raises(TypeError):
    te_jax_cpu.unpack_descriptor(bad)


def test_pack_missing_field_raises():
  params = dict(PARAMS)
  del params["softcap"]
  with pytest.raises((KeyError, TypeError, ValueError)):
    te_jax_cpu.pack_descriptor(params)


# The legacy handler itself, fed bad descriptors through a test-only primitive that lowers to the legacy forward target
# with arbitrary backend_config bytes: it must record a failure (never crash, never compute).
def _bad_descriptor_call(descriptor: bytes):
  import jax
  import jax.numpy as jnp
  from jax.extend.core import Primitive
  from jax.interpreters import mlir

  from te_jax._backends import backend_for

  prim = Primitive(f"te_jax_test_descriptor_{len(descriptor)}_{hash(descriptor) & 0xFFFF}")
  prim.multiple_results = True

  def abstract(q, k, v, *rest):
    return (jax.core.ShapedArray(q.shape[:3] + v.shape[3:], q.dtype),
            jax.core.ShapedArray((q.shape[0], q.shape[2], q.shape[1]), jnp.float32))

  prim.def_abstract_eval(abstract)
  mlir.register_lowering(prim, jax.ffi.ffi_lowering("te_jax_attention_forward_cpu_legacy", api_version=3,
                                                    backend_config=descriptor), platform="cpu")
  backend_for("cpu").ensure_registered()
  q = jnp.ones((1, 4, 2, 8), jnp.float32)
  k = jnp.ones((1, 4, 1, 8), jnp.float32)
  lens = jnp.array([4], jnp.int32)
  tokens = (jnp.zeros((1, 4), jnp.int32),) * 4  # q/kv segment ids and positions, unread (flags 0)
  bias = jnp.zeros((1, 1, 1, 1), jnp.float32)  # the no-bias placeholder
  dropout = jnp.zeros((6,), jnp.uint32)  # the no-dropout placeholder
  page_table = jnp.zeros((1, 1), jnp.int32)  # the contiguous k and v placeholder
  return jax.block_until_ready(jax.jit(lambda q, k: prim.bind(q, k, k, lens, lens, jnp.zeros((1, 2)), *tokens,
                                                              page_table, bias, dropout))(q, k))


MATCHING = dict(batch=1, seqlen_q=4, seqlen_kv=4, num_heads=2, num_kv_heads=1, head_dim=8, head_dim_v=8, dtype=0,
                mask_type=0, window_left=-1, window_right=-1, scale=0.5, softcap=0.0, has_alibi=False,
                deterministic=False)


@pytest.mark.parametrize("descriptor,match", [
    (b"", "truncated: 0 bytes"),
    (b"TEJD", "truncated: 4 bytes"),
    (b"x" * SIZE, "wrong magic"),
    (craft(version=1), "version 1"),
    (craft(mask_type=9), "out-of-range enum"),
    (craft(flags=0x20), "flags has unknown bits"),
    (te_jax_cpu.pack_descriptor(MATCHING)[:-1] + b"\0", "checksum"),
    (te_jax_cpu.pack_descriptor(MATCHING) + b"\0", "size mismatch"),
], ids=["empty", "header_only", "garbage", "version", "enum", "flags", "checksum", "oversize"])
def test_legacy_handler_refuses_bad_descriptor(descriptor, match, no_pending_legacy_failures):
  import te_jax

  _bad_descriptor_call(descriptor)
  with pytest.raises(te_jax.legacy_failures.LegacyCustomCallError,
                     match=r"te_jax_attention_forward_cpu_legacy: legacy descriptor.*" + match):
    te_jax.raise_legacy_failures()


def test_legacy_handler_validates_descriptor_values(no_pending_legacy_failures):
  """A well-framed descriptor with a refused value: the handler validates, fills the outputs with NaN, records it."""
  import te_jax

  out, lse = _bad_descriptor_call(te_jax_cpu.pack_descriptor(dict(MATCHING, window_left=-7)))
  assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
  with pytest.raises(te_jax.legacy_failures.LegacyCustomCallError, match="window_size"):
    te_jax.raise_legacy_failures()
  # The same call with the matching descriptor computes normally.
  out, _ = _bad_descriptor_call(te_jax_cpu.pack_descriptor(MATCHING))
  assert np.allclose(np.asarray(out), 1.0)
  te_jax.raise_legacy_failures()
