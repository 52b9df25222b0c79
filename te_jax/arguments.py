"""The checks of the attention APIs' arguments and the kernel operands built from them, shared by te_jax.fused_attn,
te_jax.paged_attention and te_jax.dot_product_attention. A check raises a TypeError or ValueError that names the
argument and the values it allows; an operand builder returns the argument as the primitives take it
(te_jax/_primitives.py), or the primitive's placeholder when the argument is absent."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import _primitives, flex
from te_jax.attention_config import DTYPE_CODES
from te_jax.dropout import check_rate, drop_threshold, key_words
from te_jax.fp8 import is_fp8
from te_jax.mask_type import MaskType

MAX_HEAD_DIM = 256  # cpp/core/limits.h: kMaxHeadDim
MAX_WINDOW = 2**31 - 1  # cpp/core/limits.h: kMaxWindow
_INT32 = np.iinfo(np.int32)


def as_array(x: Any, name: str, allow_sequence: bool = False):
  if allow_sequence and isinstance(x, (list, tuple)):
    x = np.asarray(x)
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
  return x


def is_int(x) -> bool:
  """A Python or NumPy integer, not a bool."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_bool(flag, name: str) -> None:
  if not isinstance(flag, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {flag!r}")


def is_head_dim(d: int) -> bool:
  """Whether the kernels take head dim d (cpp/core/validate.h)."""
  return 0 < d <= MAX_HEAD_DIM and d % 8 == 0


def check_qkv(q, k, v) -> None:
  """Shapes and dtypes: q, k and v in one of float32, bfloat16, float16, or k and v an FP8 KV cache (te_jax/fp8.py
  checked its dtypes and descales)."""
  kv_cache = is_fp8(k.dtype) and k.dtype == v.dtype
  for x, name, what in ((q, "q", "[B, Sq, H, D]"), (k, "k", "[B, Skv, Hkv, D]"), (v, "v", "[B, Skv, Hkv, Dv]")):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 {what}, got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) not in DTYPE_CODES and not (kv_cache and name != "q"):
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype or kv_cache):
    raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  if not q.shape[0] == k.shape[0] == v.shape[0]:
    raise ValueError(f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k and v must agree in [B, Skv, Hkv], got {tuple(k.shape)} and {tuple(v.shape)}")
  if k.shape[3] != q.shape[3]:
    raise ValueError(f"q and k must have the same head dim D, got {q.shape[3]} and {k.shape[3]}")
  num_heads, num_kv_heads = q.shape[2], k.shape[2]
  if num_heads == 0 or num_kv_heads == 0 or num_heads % num_kv_heads:
    raise ValueError(f"the number of q heads ({num_heads}) must be a positive multiple of the number of k/v heads "
                     f"({num_kv_heads})")
  for name, d in (("head dim D of q and k", q.shape[3]), ("head dim Dv of v", v.shape[3])):
    if not is_head_dim(d):
      raise ValueError(f"{name} must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")


def seqlens_operand(seqlens, name: str, mask: MaskType, batch: int, seqlen: int):
  if not mask.is_padding:
    if seqlens is not None:
      raise ValueError(f"{name} is only accepted with a padding mask (padding, padding_causal, "
                       f"padding_causal_bottom_right); mask_type is {mask.name.lower()!r}")
    return _primitives.no_lengths()
  if seqlens is None:
    raise ValueError(f"mask_type {mask.name.lower()!r} requires {name} (int32 [B])")
  seqlens = as_array(seqlens, name, allow_sequence=True)
  if seqlens.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got {tuple(seqlens.shape)}")
  if not jnp.issubdtype(seqlens.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {seqlens.dtype}")
  if not isinstance(seqlens, jax.core.Tracer):
    values = np.asarray(seqlens)
    if values.size and (values.min() < 0 or values.max() > seqlen):
      raise ValueError(f"{name} values must lie in [0, {seqlen}], got {values.tolist()}")
  return saturate_to_int32(jnp.asarray(seqlens))


def saturate_to_int32(x):
  """int32 values of an integer array, clamped instead of wrapped: 2**32 + 5 stays out of range (2**31 - 1) rather than
  becoming 5, so the run-time length check sees that it is out of range."""
  if x.dtype == jnp.int32:
    return x
  info = jnp.iinfo(x.dtype)
  if info.min < _INT32.min or info.max > _INT32.max:
    x = jnp.clip(x, max(info.min, _INT32.min), min(info.max, _INT32.max))
  return x.astype(jnp.int32)


def check_window(window_size) -> tuple[int, int]:
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
  for side, value in (("left", left), ("right", right)):
    if not is_int(value):
      raise TypeError(f"window_size {side} must be an int, got {value!r}")
    if not -1 <= value <= MAX_WINDOW:
      raise ValueError(f"window_size {side} must be -1 (unbounded) or in [0, {MAX_WINDOW}], got {value}")
  return int(left), int(right)


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  if not (math.isfinite(scale) and _as_float32(scale) > 0 and math.isfinite(_as_float32(scale))):
    raise ValueError(f"scale must be a finite positive number within float32 range, got {scale}")
  return float(scale)


def _as_float32(x) -> float:
  """x as the kernels receive it (float32): 1e39 becomes inf and 1e-50 becomes 0, which they must refuse."""
  with np.errstate(over="ignore", under="ignore"):
    return float(np.float32(x))


def check_softcap(softcap) -> float:
  if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
    raise TypeError(f"softcap must be a Python float, got {type(softcap).__name__}")
  if not (math.isfinite(softcap) and softcap >= 0 and math.isfinite(_as_float32(softcap))) or (
      softcap > 0 and _as_float32(softcap) == 0):
    raise ValueError(f"softcap must be 0 (off) or a positive number within float32 range, got {softcap}")
  return float(softcap)


def alibi_operand(alibi_slopes, batch: int, num_heads: int):
  if alibi_slopes is None:
    return _primitives.no_alibi()
  alibi_slopes = as_array(alibi_slopes, "alibi_slopes", allow_sequence=True)
  if alibi_slopes.shape not in ((num_heads,), (batch, num_heads)):
    raise ValueError(f"alibi_slopes must have shape [H] = ({num_heads},) or [B, H] = ({batch}, {num_heads}), "
                     f"got {tuple(alibi_slopes.shape)}")
  if not jnp.issubdtype(alibi_slopes.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be a float array, got {alibi_slopes.dtype}")
  return jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (batch, num_heads))


def sink_operand(sink_logits, num_heads: int):
  """Checks sink_logits (float32 [H]) and returns it as a JAX array, or None (te_jax/sinks.py merges it)."""
  if sink_logits is None:
    return None
  sink_logits = as_array(sink_logits, "sink_logits")
  if tuple(sink_logits.shape) != (num_heads,):
    raise ValueError(f"sink_logits must have shape [H] = ({num_heads},), got {tuple(sink_logits.shape)}")
  if sink_logits.dtype != jnp.float32:
    raise TypeError(f"sink_logits must be float32, got {sink_logits.dtype}")
  return jnp.asarray(sink_logits)


def bias_operand(bias, full_shape: tuple[int, int, int, int]):
  """The bias operand (te_jax/_primitives.py): bias as it is, each dim full or 1, or the placeholder without one."""
  if bias is None:
    return _primitives.no_bias()
  bias = as_array(bias, "bias")
  allowed = "[B or 1, H or 1, Sq or 1, Skv or 1] = [{} or 1, {} or 1, {} or 1, {} or 1]".format(*full_shape)
  if bias.ndim != 4:
    raise ValueError(f"bias must have rank 4, {allowed}; got shape {tuple(bias.shape)}")
  if any(extent not in (1, full) for extent, full in zip(bias.shape, full_shape)):
    raise ValueError(f"bias must have shape {allowed} (each dim full or 1); got {tuple(bias.shape)}")
  if np.dtype(bias.dtype) not in DTYPE_CODES:
    raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
  return jnp.asarray(bias)


def dropout_operand(rate, rng, mods: bool) -> tuple[int, Any]:
  """The drop threshold (0: no dropout) and the dropout operand (te_jax/_primitives.py) of an unsharded call; with
  `mods` (score_mod / mask_mod) its offsets are read without dropout too."""
  rate = check_rate(rate)
  if rate == 0.0:
    return 0, _primitives.offsets_operand() if mods else _primitives.no_dropout()
  if rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng, a JAX PRNG key (jax.random.key or jax.random.PRNGKey)")
  return int(drop_threshold(rate)), _primitives.dropout_operand(key_words(rng))


def token_operands(q_segment_ids, kv_segment_ids, q_positions, kv_positions, mask: MaskType, batch: int,
                   seqlen_q: int, seqlen_kv: int):
  """The four token operands (te_jax/_primitives.py) and whether ids / positions were given."""
  has_ids = q_segment_ids is not None or kv_segment_ids is not None
  has_positions = q_positions is not None or kv_positions is not None
  if has_ids or has_positions:
    what = "segment ids" if not has_positions else "positions" if not has_ids else "segment ids and positions"
    if mask.is_padding:
      raise ValueError(f"{what} go with mask_type 'no_mask' or 'causal' only, got {mask.name.lower()!r}: mark "
                       "padding tokens with segment id 0 instead of q_seqlens/kv_seqlens")
    if mask.is_bottom_right:
      raise ValueError(f"{what} go with mask_type 'no_mask' or 'causal' only, got {mask.name.lower()!r}: for a "
                       "bottom-right diagonal pass positions (e.g. q_positions = Skv - Sq + i) with mask_type 'causal'")
  if has_ids:
    if q_segment_ids is None:
      raise ValueError("kv_segment_ids needs q_segment_ids (the ids of the queries)")
    q_ids = _token_array(q_segment_ids, "q_segment_ids", batch, seqlen_q, "Sq")
    if kv_segment_ids is None:
      if seqlen_q != seqlen_kv:
        raise ValueError(f"q_segment_ids alone needs Sq == Skv (the keys then use the same ids); got Sq={seqlen_q}, "
                         f"Skv={seqlen_kv}: pass kv_segment_ids too")
      kv_ids = q_ids
    else:
      kv_ids = _token_array(kv_segment_ids, "kv_segment_ids", batch, seqlen_kv, "Skv")
  else:
    q_ids, kv_ids = _primitives.no_tokens()[:2]
  if has_positions:
    q_pos = (_token_array(q_positions, "q_positions", batch, seqlen_q, "Sq") if q_positions is not None else
             _indices(batch, seqlen_q))
    kv_pos = (_token_array(kv_positions, "kv_positions", batch, seqlen_kv, "Skv") if kv_positions is not None else
              _indices(batch, seqlen_kv))
  else:
    q_pos, kv_pos = _primitives.no_tokens()[2:]
  return (q_ids, kv_ids, q_pos, kv_pos), has_ids, has_positions


def _indices(batch: int, seqlen: int):
  return jnp.broadcast_to(jnp.arange(seqlen, dtype=jnp.int32), (batch, seqlen))


def _token_array(x, name: str, batch: int, seqlen: int, seq_name: str):
  x = as_array(x, name, allow_sequence=True)
  if tuple(x.shape) != (batch, seqlen):
    raise ValueError(f"{name} must have shape [B, {seq_name}] = ({batch}, {seqlen}), got {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer (int32) array, got {x.dtype}")
  return saturate_to_int32(jnp.asarray(x))


def mod_operands(score_mod, mask_mod):
  """(the score_mod's ModSpec or None, the mask_mod's, their captures: the score_mod's then the mask_mod's) of
  fused_attn's score_mod= / mask_mod= (te_jax.flex translates them; docs/flex_attention.md)."""
  specs, captures = [], []
  for mod, name, translate, contract in (
      (score_mod, "score_mod", flex.translate_score_mod, "score_mod(score, b, h, q_idx, kv_idx) -> score"),
      (mask_mod, "mask_mod", flex.translate_mask_mod, "mask_mod(b, h, q_idx, kv_idx) -> bool")):
    if mod is None:
      specs.append(None)
      continue
    if not callable(mod):
      raise TypeError(f"{name} must be a function {contract} or None, got {type(mod).__name__}")
    translated = translate(mod)
    specs.append(translated.spec())
    captures += translated.captures
  return specs[0], specs[1], tuple(captures)
