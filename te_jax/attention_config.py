"""The static configuration of one fused_attn call: a frozen, hashable dataclass passed to the primitives as a single
parameter, so jit caches and the lowering see exactly one description of the call."""

from __future__ import annotations

import dataclasses

import numpy as np

from te_jax.flex import ModSpec
from te_jax.flex.dtypes import is_float
from te_jax.mask_type import MaskType

# Element-type codes of the C++ core (cpp/core/dtype.h): never renumber.
DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype("bfloat16"): 1, np.dtype(np.float16): 2}
# cpp/core/kv_format.h: k and v of an FP8 KV cache (any other k dtype is q's: code 0).
KV_FORMAT_CODES = {np.dtype("float8_e4m3fn"): 1, np.dtype("float8_e5m2"): 2}


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  mask_type: MaskType
  window_left: int
  window_right: int
  scale: float
  softcap: float
  has_alibi: bool
  # Attention sinks: whether the sinks operand holds sink logits [B, H] the forward kernels merge into their rows
  # (cpp/core/sink.h; else zeros, unread). Context parallelism merges them after its blocks instead (te_jax/sinks.py).
  has_sinks: bool = False
  deterministic: bool = False  # backward only: a bitwise reproducible dq (see fused_attn)
  engine: str = "auto"  # "auto" | "te" | "cudnn" (te_jax/engine.py), resolved per platform at lowering
  # Whether the backward may receive a nonzero cotangent of lse (the user asked for lse, or context parallelism merges
  # partial results by it): an engine whose backward ignores dlse cannot serve such a backward.
  lse_cotangent: bool = False
  # Packed sequences: whether the token operands hold segment ids / positions (else zeros, unread).
  has_segment_ids: bool = False
  has_positions: bool = False
  # Additive logit bias: whether the bias operand holds one (else a float32 [1, 1, 1, 1] placeholder).
  has_bias: bool = False
  # Attention dropout: a probability is dropped when its 16-bit Philox number is below this (< 2^16;
  # te_jax/dropout.py: drop_threshold); 0: no dropout, the dropout operand is a placeholder.
  dropout_threshold: int = 0
  # Paged KV cache (te_jax.paged_attention; the forward primitive only: its VJP differentiates the gathered K/V): 0, k
  # and v are [B, Skv, Hkv, D(v)] and the page table operand a placeholder; else k and v are pools
  # [num_pages, page_size, Hkv, D(v)] read through the page table int32 [B, max_pages_per_seq], and Skv is the
  # capacity max_pages_per_seq * page_size.
  page_size: int = 0
  # FP8 attention (te_jax/fp8.py): q, k and v are the float32 dequantized values of FP8 operands; a backend without FP8
  # kernels refuses the call rather than attend at another precision (Backend.serves_fp8).
  fp8: bool = False
  # score_mod / mask_mod (docs/flex_attention.md), held by their key, so jit's cache key includes them. Their captures
  # are the primitives' last operands, the score_mod's first. vmap folds examples into the batch (example n of entry b
  # is entry b * N + n): the mods see b // flex_batch_fold, the product of the folded sizes.
  score_mod: ModSpec | None = None
  mask_mod: ModSpec | None = None
  flex_batch_fold: int = 1
  # A block mask of the mask_mod (te_jax/block_mask.py): its (block_q, block_kv); its blocks are the last capture.
  block_mask: tuple[int, int] | None = None

  @property
  def has_mods(self) -> bool:
    return self.score_mod is not None or self.mask_mod is not None

  @property
  def reads_offsets(self) -> bool:
    """Whether the kernels read the dropout operand's offsets, the global (b, h, i, j) of the call's first element:
    dropout's keep-mask and the mods see global indices, so a shard's call adds its own (te_jax/sharding.py)."""
    return self.dropout_threshold > 0 or self.has_mods

  @property
  def num_captures(self) -> int:
    return sum(len(m.capture_types) for m in (self.score_mod, self.mask_mod) if m is not None) + \
        (self.block_mask is not None)

  @property
  def capture_gradients(self) -> tuple[int, ...]:
    """The score_mod's captures that get a gradient (its floating-point ones): the backward returns a float32 array of
    each one's shape, in this order, after dq, dk, dv and dbias."""
    if self.score_mod is None:
      return ()
    return tuple(i for i, c in enumerate(self.score_mod.capture_types) if is_float(c.dtype))

  def flex_params(self, libraries: tuple[str, str], capture_shapes, direction: str) -> dict:
    """The core params' score_mod / mask_mod fields (cpp/core/flex_mods.h: FlexSpec): the paths of the libraries
    serving them ("" for none), the captures' shapes (tuples: the engine choice keys a cache by the params) and, in
    the backward, which captures get gradients (a bit per capture)."""
    gradients = sum(1 << i for i in self.capture_gradients) if direction == "backward" else 0
    return dict(score_mod_library=libraries[0], mask_mod_library=libraries[1],
                flex_batch_fold=int(self.flex_batch_fold),
                score_mod_captures=len(self.score_mod.capture_types) if self.score_mod else 0,
                score_mod_gradients=gradients,
                flex_block_q=self.block_mask[0] if self.block_mask else 0,
                flex_block_kv=self.block_mask[1] if self.block_mask else 0,
                flex_capture_shapes=tuple(tuple(map(int, shape)) for shape in capture_shapes))

  def ffi_attributes(self, engine_code: int, flex: dict) -> dict:
    """The typed attributes of the FFI custom call (see ffi/ffi_params.h: AttentionAttrs), with the engine the lowering
    resolved and the flex_params (whose capture shapes the handler reads from the operands)."""
    return dict(mask_type=np.int64(int(self.mask_type)), window_left=np.int64(self.window_left),
                window_right=np.int64(self.window_right), scale=np.float32(self.scale),
                softcap=np.float32(self.softcap), has_alibi=bool(self.has_alibi), has_sinks=bool(self.has_sinks),
                deterministic=bool(self.deterministic), engine=np.int64(engine_code),
                has_segment_ids=bool(self.has_segment_ids), has_positions=bool(self.has_positions),
                has_bias=bool(self.has_bias), dropout_threshold=np.int64(self.dropout_threshold),
                page_size=np.int64(self.page_size), score_mod_library=flex["score_mod_library"],
                mask_mod_library=flex["mask_mod_library"], flex_batch_fold=np.int64(flex["flex_batch_fold"]),
                score_mod_captures=np.int64(flex["score_mod_captures"]),
                score_mod_gradients=np.int64(flex["score_mod_gradients"]),
                flex_block_q=np.int64(flex["flex_block_q"]), flex_block_kv=np.int64(flex["flex_block_kv"]))

  def core_params(self, q_shape, k_shape, v_shape, dtype, engine_code: int = 0, bias_shape=(1, 1, 1, 1),
                  bias_dtype=np.float32, page_table_shape=None, kv_dtype=None, kv_descale_shape=(1, 1, 1)) -> dict:
    """The fields of the C++ AttentionParams for these shapes (the legacy descriptor and validation take them);
    engine_code 0 is te_jax's own kernels. bias_shape / bias_dtype: the bias operand's (the placeholder's by
    default); its size-1 dims are the broadcast bits of cpp/core/bias.h. page_table_shape: [B, max_pages_per_seq], needed
    when paged (Skv is then the capacity it gives, and k's leading dim the number of pages). kv_dtype: k's and v's (q's
    by default), kv_descale_shape the kv_descale operand's, [2, blocks, heads] for an FP8 KV cache. An FP8 dtype (q, k
    and v FP8: the CUDA FP8 kernel's call) is the q_format, the output bfloat16."""
    batch, seqlen_q, num_heads, head_dim = q_shape
    seqlen_kv, num_pages = k_shape[1], 0
    q_format = KV_FORMAT_CODES.get(np.dtype(dtype), 0)
    if q_format:
      dtype = np.dtype("bfloat16")
    if self.page_size:
      seqlen_kv, num_pages = page_table_shape[1] * self.page_size, k_shape[0]
    return dict(batch=batch, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, num_heads=num_heads, num_kv_heads=k_shape[2],
                head_dim=head_dim, head_dim_v=v_shape[3], dtype=DTYPE_CODES[np.dtype(dtype)],
                mask_type=int(self.mask_type), window_left=self.window_left, window_right=self.window_right,
                scale=float(self.scale), softcap=float(self.softcap), has_alibi=bool(self.has_alibi),
                has_sinks=bool(self.has_sinks), deterministic=bool(self.deterministic), engine=int(engine_code),
                has_segment_ids=bool(self.has_segment_ids), has_positions=bool(self.has_positions),
                has_bias=bool(self.has_bias), bias_dtype=DTYPE_CODES[np.dtype(bias_dtype)],
                bias_broadcast=sum(1 << axis for axis, extent in enumerate(bias_shape) if extent == 1),
                dropout_threshold=int(self.dropout_threshold), page_size=int(self.page_size), num_pages=int(num_pages),
                kv_format=KV_FORMAT_CODES.get(np.dtype(dtype if kv_dtype is None else kv_dtype), 0), q_format=q_format,
                kv_descale_blocks=int(kv_descale_shape[1]), kv_descale_heads=int(kv_descale_shape[2]))
