"""te_jax.dot_product_attention: jax.nn.dot_product_attention's signature and semantics on te_jax's kernels.

Everything here maps jax.nn's arguments onto one te_jax.fused_attn call: the masks jax.nn builds from is_causal, the
sequence lengths and local_window_size become fused_attn's mask type, lengths and window; an arbitrary boolean mask
becomes part of fused_attn's additive bias (attention_bias, which te_jax.flax shares). What fused_attn cannot serve is
a ValueError that says why, never a silent fallback to another implementation.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from te_jax.arguments import MAX_HEAD_DIM, MAX_WINDOW, check_bool, is_head_dim, is_int
from te_jax.attention import fused_attn
from te_jax.attention_config import DTYPE_CODES
from te_jax.engine import ENGINES
from te_jax.fp8 import is_fp8

# implementation= values: None (te_jax's default engine choice) and te_jax's engine names; "cudnn" is both jax.nn's
# name and te_jax's engine name for cuDNN's fused attention. "xla" asks for XLA's attention, which this function does
# not run.
IMPLEMENTATIONS = (None,) + ENGINES


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None, implementation: str | None = None,
                          return_residual: bool = False, q_descale=None, k_descale=None, v_descale=None, fp8=False):
  """`jax.nn.dot_product_attention` on te_jax's fused kernels: same signature, shapes, dtype rules and masking.

  Shapes (jax.nn's letters): query `[B, T, N, H]`, key and value `[B, S, K, H]`, N a multiple of K (GQA/MQA); or the
  same without the batch dim (`[T, N, H]`, `[S, K, H]`), which gives an unbatched result. query, key and value share
  one dtype (float32, bfloat16 or float16; float32 on the CPU only, as for te_jax.fused_attn); the result has it too.

  Args:
    query, key, value: as above.
    bias: an additive logit bias broadcastable to `[B, N, T, S]` (rank 4 or less: leading dims are added, as jax.nn;
      each dim full or 1), added to the scaled logits; it gets a gradient. A dtype other than float32,
      bfloat16 or float16 is taken as float32 (jax.nn adds the bias to float32 logits).
    mask: a boolean array broadcastable to `[B, N, T, S]` like bias, True = keep (jax.nn's). It is ANDed with the
      masks of is_causal, the sequence lengths and local_window_size. te_jax adds it to the bias as -inf where False,
      so it costs a bias's memory and bandwidth: prefer those arguments where they say the same.
    scale: multiplies the logits; default `1/sqrt(H)`. A Python number > 0 (te_jax.fused_attn's rule).
    is_causal: key j is visible to query i only when j <= i (top-left aligned, as jax.nn).
    query_seq_lengths, key_value_seq_lengths: int32 `[B]`: query rows i >= length give 0 (as jax.nn); keys j >= length
      are invisible. Values outside `[0, T]` / `[0, S]` mean what they mean to jax.nn (a length past the end masks
      nothing, a negative one masks everything): they are clipped to that range.
    local_window_size: `(left, right)` or an int w for `(w, w)`: query i sees keys `i - left <= j <= i + right`
      (jax.nn's convention, which is te_jax's `window_size`). Both must be >= 0: a negative size means something
      else to jax.nn than to te_jax (-1 is "unbounded" in te_jax), so it is refused.
    implementation: None (te_jax's default engine: "auto", or $TE_JAX_ENGINE), or a te_jax engine: "auto", "te",
      "cudnn" (cuDNN's fused attention through te_jax: te_jax's semantics, and an error saying why when cuDNN cannot
      serve the call). "xla" is a ValueError: this function never runs XLA's attention; call
      jax.nn.dot_product_attention for that.
    return_residual: also return the log-sum-exp of each row's logits, `[B, T, N]` (`[T, N]` unbatched) in query's
      dtype (the output's, for FP8 operands), with no gradient (as jax.nn).
    q_descale, k_descale, v_descale, fp8: te_jax's FP8 attention, as te_jax.fused_attn takes them (beyond jax.nn):
      FP8 query, key and value (or key and value alone) with their descales, the output then bfloat16 (query's dtype
      for FP8 key and value alone); or fp8=True | "per_head" on higher-precision operands.

  Where te_jax differs from jax.nn (implementation="xla"): a query row that sees no key at all (its key_value length
  is 0, a window that holds no valid key, a mask row with no True) gives 0 here, and -inf as its residual. jax.nn masks with a large
  negative logit instead of -inf, so such a row is the mean of value over all S keys (masked ones included), its
  residual a large negative number, and its gradient reaches those values. Every row with at least one visible key
  agrees with jax.nn, forward and gradients. Rows past query_seq_lengths are 0 in both (their residual: -inf here, a
  large negative number in jax.nn).

  Returns:
    The attention output, shaped like query; with return_residual, `(output, residual)`.
  """
  if implementation == "xla":
    raise ValueError("te_jax.dot_product_attention: implementation='xla' asks for XLA's attention, which this "
                     "function does not run; call jax.nn.dot_product_attention(..., implementation='xla') for it. "
                     "Here implementation is None or a te_jax engine: 'auto', 'te', 'cudnn'")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"te_jax.dot_product_attention: implementation must be None or one of "
                     f"{', '.join(repr(e) for e in ENGINES)}, got {implementation!r}")
  check_bool(is_causal, "is_causal")
  check_bool(return_residual, "return_residual")

  output_shape = jnp.shape(query)
  query, key, value = (_ensure_4d(jnp.asarray(x)) for x in (query, key, value))
  batch, seqlen_kv, num_kv_heads, head_dim = key.shape
  _check_shape_and_dtype(value, "value", (batch, seqlen_kv, num_kv_heads, head_dim), key.dtype)
  # An FP8 KV cache keeps query in a higher precision.
  kv_cache = is_fp8(key.dtype) and not is_fp8(query.dtype)
  _check_shape_and_dtype(query, "query", (batch, -1, -1, head_dim), None if kv_cache else key.dtype)
  seqlen_q, num_heads = query.shape[1], query.shape[2]
  if num_kv_heads == 0 or num_heads % num_kv_heads:
    raise ValueError(f"the number of query heads must be a multiple of the number of key/value heads, got "
                     f"{num_heads} and {num_kv_heads}")
  if not is_head_dim(head_dim):
    raise ValueError(f"the head dim H of query, key and value must be a multiple of 8 in [8, {MAX_HEAD_DIM}] for "
                     f"te_jax's kernels, got {head_dim}")

  q_seqlens = _seq_lengths(query_seq_lengths, "query_seq_lengths", batch, seqlen_q)
  kv_seqlens = _seq_lengths(key_value_seq_lengths, "key_value_seq_lengths", batch, seqlen_kv)
  padding = q_seqlens is not None or kv_seqlens is not None
  if padding:
    q_seqlens = jnp.full((batch,), seqlen_q, jnp.int32) if q_seqlens is None else q_seqlens
    kv_seqlens = jnp.full((batch,), seqlen_kv, jnp.int32) if kv_seqlens is None else kv_seqlens
  mask_type = {(False, False): "no_mask", (True, False): "causal", (False, True): "padding",
               (True, True): "padding_causal"}[(bool(is_causal), padding)]

  # FP8 operands attend in float32 (te_jax/fp8.py): a mask's bias takes that dtype, not an FP8 one.
  logit_bias = attention_bias(bias, mask, (batch, num_heads, seqlen_q, seqlen_kv),
                              jnp.float32 if is_fp8(query.dtype) else query.dtype)
  result = fused_attn(query, key, value, mask_type=mask_type, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                      window_size=_window(local_window_size), scale=scale, return_lse=bool(return_residual),
                      engine=implementation, bias=logit_bias, q_descale=q_descale, k_descale=k_descale,
                      v_descale=v_descale, fp8=fp8)
  if not return_residual:
    return jnp.reshape(result, output_shape)
  out, lse = result  # lse float32 [B, N, T]
  residual = jax.lax.stop_gradient(jnp.transpose(lse, (0, 2, 1)).astype(out.dtype))
  return jnp.reshape(out, output_shape), jnp.reshape(residual, output_shape[:-1])


def attention_bias(bias, mask, full_shape: tuple[int, int, int, int], mask_dtype):
  """jax.nn's bias and boolean mask as one fused_attn bias `[B|1, N|1, T|1, S|1]`, or None when both are None.

  Each is broadcastable to full_shape = (B, N, T, S) by jax.nn's rules; size-1 dims stay 1, so the bias gradient
  stays as small as the bias. The mask adds -inf where it is False: a row that keeps a key gets jax.nn's result (its
  large negative logit also weighs exactly 0 there), a row that keeps none gives 0 (fused_attn's rule for a row of
  -inf logits) where jax.nn gives the mean of value. Without a bias the mask's bias has mask_dtype (the query's).
  """
  if bias is not None:
    bias = _logit_shaped(jnp.asarray(bias), "bias", full_shape)
    if np.dtype(bias.dtype) not in DTYPE_CODES:  # the dtypes fused_attn takes
      bias = bias.astype(jnp.float32)
  if mask is None:
    return bias
  mask = _logit_shaped(jnp.asarray(mask), "mask", full_shape)
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be a boolean array (True = keep), got dtype {mask.dtype}; an additive mask is a bias")
  masked_out = jnp.where(mask, 0, -jnp.inf).astype(mask_dtype if bias is None else bias.dtype)
  return masked_out if bias is None else bias + masked_out


def _logit_shaped(x, name: str, full_shape: tuple[int, int, int, int]):
  """x as rank 4 (jax.nn's leading unit dims), each dim full or 1."""
  x = _ensure_4d(x)
  if x.ndim != 4 or any(extent not in (1, full) for extent, full in zip(x.shape, full_shape)):
    raise ValueError(f"{name} must be broadcastable to [B, N, T, S] = {full_shape} with each dim full or 1, at most "
                     f"rank 4; got shape {tuple(x.shape)}")
  return x


def _ensure_4d(x):
  """jax.nn's rule: leading unit dims up to rank 4, so [T, N, H] is a batch of one."""
  if x.ndim < 4:
    return jnp.expand_dims(x, tuple(range(4 - x.ndim)))
  return x


def _check_shape_and_dtype(x, name: str, shape: tuple[int, ...], dtype) -> None:
  """x's rank and shape, and its dtype unless dtype is None."""
  if x.ndim != len(shape):
    raise ValueError(f"{name} must have rank 4 [B, T|S, N|K, H] or 3 (unbatched), got shape {tuple(x.shape)}")
  if dtype is not None and x.dtype != dtype:
    raise ValueError(f"{name} dtype must be key's dtype {dtype}, got {x.dtype}")
  if any(want != -1 and got != want for got, want in zip(x.shape, shape)):
    raise ValueError(f"{name} shape must be {tuple('*' if s == -1 else s for s in shape)} (from key's shape), got "
                     f"{tuple(x.shape)}")


def _seq_lengths(lengths, name: str, batch: int, seqlen: int):
  """int32 [B] clipped to [0, seqlen] (jax.nn's meaning of lengths outside it), or None."""
  if lengths is None:
    return None
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got {tuple(lengths.shape)}")
  if lengths.dtype != jnp.int32:
    raise ValueError(f"{name} dtype must be int32, got {lengths.dtype}")
  return jnp.clip(lengths, 0, seqlen)


def _window(local_window_size) -> tuple[int, int]:
  """jax.nn's local_window_size as te_jax's window_size: the same (left, right) convention, None is unbounded."""
  if local_window_size is None:
    return (-1, -1)
  if is_int(local_window_size):
    local_window_size = (local_window_size, local_window_size)
  try:
    left, right = local_window_size
  except (TypeError, ValueError):
    raise TypeError(f"local_window_size must be an int or a pair (left, right) of ints, got "
                    f"{local_window_size!r}") from None
  for side, size in (("left", left), ("right", right)):
    if not is_int(size):
      raise TypeError(f"local_window_size {side} must be an int, got {size!r}")
    if size < 0:
      raise ValueError(f"local_window_size {side} must be >= 0, got {size}: a negative window means something else "
                       f"to jax.nn than to te_jax, so te_jax refuses it (None is an unbounded window)")
  return min(int(left), MAX_WINDOW), min(int(right), MAX_WINDOW)
