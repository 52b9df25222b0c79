"""te_jax.fused_attn: argument checking, the default scale and lengths, and the VJP over the two primitives."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from te_jax import _primitives
from te_jax import context_parallel as _context_parallel
from te_jax import sharding as _sharding
from te_jax.attention_config import DTYPE_CODES, AttentionConfig
from te_jax.dropout import check_rate, drop_threshold, key_words
from te_jax.engine import requested_engine
from te_jax.mask_type import MaskType
from te_jax.sinks import apply_sinks, sink_gradient, sink_operand

MAX_HEAD_DIM = 256  # cpp/validate.h: kMaxHeadDim
MAX_WINDOW = 2**31 - 1  # cpp/validate.h: kMaxWindow
_INT32 = np.iinfo(np.int32)


def fused_attn(q, k, v, *, mask_type: MaskType | str = "no_mask", q_seqlens=None, kv_seqlens=None,
               window_size: tuple[int, int] = (-1, -1), scale: float | None = None, softcap: float = 0.0,
               alibi_slopes=None, return_lse: bool = False, deterministic: bool = False, engine: str | None = None,
               context_parallel_axis: str | None = None, context_parallel_strategy: str = "all_gather",
               context_parallel_load_balanced: bool = False, q_segment_ids=None, kv_segment_ids=None,
               q_positions=None, kv_positions=None, sink_logits=None, bias=None, dropout_rate: float = 0.0,
               dropout_rng=None):
  """Fused scaled-dot-product attention.

  Args:
    q: [B, Sq, H, D]; k: [B, Skv, Hkv, D]; v: [B, Skv, Hkv, Dv]. H must be a multiple of Hkv (GQA/MQA). float32,
      bfloat16 or float16, all three the same.
    mask_type: "no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
      "padding_causal_bottom_right" or a te_jax.MaskType.
    q_seqlens, kv_seqlens: int32 [B] valid lengths; required by the padding masks and refused by the others.
    window_size: (left, right) sliding window around each query's diagonal position; -1 is unbounded.
    scale: multiplies q.k; defaults to 1/sqrt(D).
    softcap: if > 0, logits become softcap * tanh(logits / softcap).
    alibi_slopes: float32 [H] or [B, H]; adds slope * (key position - query position) to the logits.
    return_lse: also return the float32 log-sum-exp of the logits, [B, H, Sq].
    deterministic: whether the backward must be bitwise reproducible. False (fast): the CUDA backward sums dq with
      float atomics (for D + Dv <= 256) and the CPU backward in an order that follows its thread scheduling, so dq's
      last bits may differ from run to run. True: the same bits every run, whatever the thread count; slower.
    engine: which implementation runs the call: "auto" (default; or $TE_JAX_ENGINE) picks per configuration the faster
      engine that serves it, measured once on the GPU (te_jax/engine.py); "te" runs te_jax's own kernels; "cudnn"
      runs cuDNN's fused attention and raises EngineUnavailableError (a ValueError) saying why when cuDNN cannot serve
      the call (soft-cap, arbitrary ALiBi slopes, a gradient through lse, no GPU, ...). Never a silent fallback.
    context_parallel_axis: name of a mesh axis the sequence dimension of q, k and v is sharded over (context
      parallelism; the mesh in context (`with jax.set_mesh(mesh)`, shard_map), else q, k or v's NamedSharding, must
      have the axis). None: no context parallelism
      (batch and head sharding work without it). See docs/SHARDING.md.
    context_parallel_strategy: "all_gather" (gather K/V, compute the local query rows) or "ring" (K/V blocks passed
      around the axis with collective permutes, results merged by log-sum-exp).
    context_parallel_load_balanced: q, k, v (and so out, lse; and the segment ids and positions, if any) are in
      te_jax.reorder_for_load_balancing order.
    q_segment_ids, kv_segment_ids: int32 [B, Sq] / [B, Skv] (packed sequences): a query sees only keys with its own
      id; id 0 is padding (such a query gives out = 0, lse = -inf and zero gradients; such a key is never seen).
      q_segment_ids alone with Sq == Skv: the keys use the same ids. te_jax.segment_ids_from_lengths builds them.
    q_positions, kv_positions: int32 [B, Sq] / [B, Skv]: the positions causal masks, windows and ALiBi use instead of
      the indices (each defaults to 0..S-1): causal means kv_pos <= q_pos, a window (l, r) means
      q_pos - l <= kv_pos <= q_pos + r, ALiBi adds slope * (kv_pos - q_pos). Need not be sorted or distinct.
      Segment ids and positions go with mask_type "no_mask" or "causal" only. On the GPU te_jax's engine serves them
      (cuDNN does not; engine="auto" picks te_jax's kernels).
    sink_logits: float32 [H] (attention sinks): one extra logit per head in every row's softmax denominator that
      contributes no value: out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)); lse includes it; it gets a
      gradient. A row with no visible key gives out = 0 and lse = sink_h. The off-by-one softmax is
      `sink_logits=jax.lax.stop_gradient(jnp.zeros(H))`. Every engine and backend (te_jax/sinks.py).
    bias: an additive logit bias, float32, bfloat16 or float16 of rank 4, broadcastable to [B, H, Sq, Skv] with each
      dim full or 1 ([1, H, Sq, Skv] relative positions, [B, 1, 1, Skv] a 0/-inf key mask, ...): the logits become
      softcap(scale * q.k) + alibi + bias, before the mask. A row whose every visible logit is -inf gives out = 0,
      lse = -inf. It gets a gradient (summed over its broadcast dims, in its dtype). On a GPU te_jax's kernels serve it
      (cuDNN does not take it), and there deterministic=True needs a bias whose gradient sums over no dim (full shape,
      or dims of extent 1).
    dropout_rate: attention dropout, a Python float in [0, 1): each probability (after the softmax, so lse is
      unchanged) is kept with probability 1 - dropout_rate and scaled by 1 / (1 - dropout_rate) before P.V; the
      backward applies the same keep-mask. 0 (default): no dropout, dropout_rng is ignored. On the GPU te_jax's kernels
      apply it (the same mask as on the CPU; cuDNN does not take it, engine="auto" picks te_jax's kernels).
    dropout_rng: the JAX PRNG key that defines the keep-mask (jax.random.key, or a raw uint32[2] jax.random.PRNGKey);
      required when dropout_rate > 0. Element (b, h, i, j) of the [B, H, Sq, Skv] probabilities is kept as
      te_jax.dropout_keep_mask(dropout_rng, (B, H, Sq, Skv), dropout_rate) says, however the call is sharded over the
      batch, the heads and (context parallelism, either strategy, load balanced or not) the sequence; global (i, j)
      are natural sequence positions. Under vmap over N examples the mapped axis joins the batch: example n's batch
      entry b uses mask entry b * N + n, so each example gets its own mask from one key (which must not be mapped).

  Returns:
    out [B, Sq, H, Dv] in q's dtype, and lse if return_lse. Rows with no visible key give out = 0, lse = -inf.
    Gradients flow to q, k and v (and through lse when it is returned).
  """
  q, k, v = (_as_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
  _check_qkv(q, k, v)
  batch, seqlen_q, num_heads, head_dim = q.shape
  seqlen_kv = k.shape[1]
  mask = MaskType.parse(mask_type)
  q_seqlens = _seqlens_operand(q_seqlens, "q_seqlens", mask, batch, seqlen_q)
  kv_seqlens = _seqlens_operand(kv_seqlens, "kv_seqlens", mask, batch, seqlen_kv)
  window_left, window_right = _check_window(window_size)
  for flag, name in ((return_lse, "return_lse"), (deterministic, "deterministic")):
    if not isinstance(flag, (bool, np.bool_)):
      raise TypeError(f"{name} must be a bool, got {flag!r}")
  threshold, dropout = _dropout_operand(dropout_rate, dropout_rng)
  tokens, has_ids, has_positions = _token_operands(q_segment_ids, kv_segment_ids, q_positions, kv_positions, mask,
                                                   batch, seqlen_q, seqlen_kv)
  cp = _context_parallel.make(context_parallel_axis, context_parallel_strategy, context_parallel_load_balanced,
                              (q, k, v))
  config = AttentionConfig(mask_type=mask, window_left=window_left, window_right=window_right,
                           scale=_check_scale(scale, head_dim), softcap=_check_softcap(softcap),
                           has_alibi=alibi_slopes is not None, deterministic=bool(deterministic),
                           engine=requested_engine(engine), lse_cotangent=bool(return_lse) or cp is not None,
                           has_segment_ids=has_ids, has_positions=has_positions, has_bias=bias is not None,
                           dropout_threshold=threshold,
                           # context parallelism merges the sinks after its blocks' merge (_attention)
                           has_sinks=sink_logits is not None and cp is None)
  alibi = _alibi_operand(alibi_slopes, batch, num_heads)
  sinks = sink_operand(sink_logits, num_heads)
  bias_operand = _bias_operand(bias, (batch, num_heads, seqlen_q, seqlen_kv))
  if cp is not None:
    _context_parallel.check_supported(config, cp, q.shape, k.shape)
    _context_parallel.check_lengths(config, cp, q_seqlens, kv_seqlens)
  out, lse = _attention(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias_operand, dropout, sinks)
  return (out, lse) if return_lse else out


# `cp` (a ContextParallel or None) is static like config. Both directions bind the partitioned primitives of
# te_jax/sharding.py, which wrap the kernel primitives of te_jax/_primitives.py. `tokens` is the tuple of the four
# segment-id and position operands (placeholders when absent); like the lengths, they get no gradient. `sinks` is None
# or the float32 [H] sink logits: the forward kernels merge them into their rows (config.has_sinks), or, with context
# parallelism, apply_sinks merges them into the merged blocks (te_jax/sinks.py); the backward then runs the kernels on
# the sink softmax's out and lse, and the sinks' gradient comes from those (sink_gradient). k and v are contiguous: the
# page table operand is a placeholder (a paged call is te_jax/paged_attention.py's). `bias` is the bias operand (the
# placeholder of _primitives.no_bias when absent), whose gradient the backward kernel returns. `dropout` is the dropout
# operand (key and offsets; te_jax/_primitives.py), which gets no gradient.
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks):
  per_head = _primitives.no_sinks() if sinks is None else jnp.broadcast_to(sinks, (q.shape[0], q.shape[2]))
  out, lse = _sharding.forward(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, per_head, tokens,
                               _primitives.no_page_table(), bias, dropout)
  return apply_sinks(out, lse, per_head) if sinks is not None and not config.has_sinks else (out, lse)


def _attention_fwd(config, cp, *primals):
  _refuse_slope_gradient(primals[5])
  q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks = _primal_values(primals)
  out, lse = _attention(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks)
  return (out, lse), (q, k, v, out, lse, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks)


def _attention_bwd(config, cp, residuals, cotangents):
  q, k, v, out, lse, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks = residuals
  dout, dlse = _instantiate_zeros(cotangents)
  dout, dlse = dout.astype(out.dtype), dlse.astype(jnp.float32)
  dq, dk, dv, dbias = _sharding.backward(config, cp, q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi,
                                         _primitives.no_sinks(), tokens, _primitives.no_page_table(), bias,
                                         dropout)
  dsinks = None if sinks is None else sink_gradient(out, lse, dout, dlse, sinks)
  # The placeholder's cotangent is None: its dbias (a zero) would be typed as varying over shard_map's manual axes.
  return dq, dk, dv, None, None, None, (None,) * len(tokens), dbias if config.has_bias else None, None, dsinks


# symbolic_zeros: the forward learns which operands are differentiated (_refuse_slope_gradient).
_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _primal_values(primals):
  """The values of a custom_vjp forward's operands, which symbolic_zeros=True wraps leaf by leaf."""
  return jax.tree.map(lambda p: p.value, primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))


def _refuse_slope_gradient(alibi: CustomVJPPrimal) -> None:
  """A clear error rather than a silent zero: the kernels compute no gradient for the ALiBi slopes."""
  if alibi.perturbed:
    raise ValueError("alibi_slopes are being differentiated, but te_jax computes no gradient for them (it would be a "
                     "silent zero): pass jax.lax.stop_gradient(alibi_slopes) to train with fixed slopes")


def _instantiate_zeros(cotangents):
  """The cotangents with each symbolic zero (symbolic_zeros=True: an output nothing depends on) made an array."""
  return jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c, cotangents,
                      is_leaf=lambda x: isinstance(x, SymbolicZero))


def _as_array(x: Any, name: str, allow_sequence: bool = False):
  if allow_sequence and isinstance(x, (list, tuple)):
    x = np.asarray(x)
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
  return x


def _check_qkv(q, k, v) -> None:
  for x, name, what in ((q, "q", "[B, Sq, H, D]"), (k, "k", "[B, Skv, Hkv, D]"), (v, "v", "[B, Skv, Hkv, Dv]")):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 {what}, got shape {tuple(x.shape)}")
    if np.dtype(x.dtype) not in DTYPE_CODES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
  if not q.dtype == k.dtype == v.dtype:
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
    if d <= 0 or d % 8 or d > MAX_HEAD_DIM:
      raise ValueError(f"{name} must be a multiple of 8 in [8, {MAX_HEAD_DIM}], got {d}")


def _seqlens_operand(seqlens, name: str, mask: MaskType, batch: int, seqlen: int):
  if not mask.is_padding:
    if seqlens is not None:
      raise ValueError(f"{name} is only accepted with a padding mask (padding, padding_causal, "
                       f"padding_causal_bottom_right); mask_type is {mask.name.lower()!r}")
    return _primitives.no_lengths()
  if seqlens is None:
    raise ValueError(f"mask_type {mask.name.lower()!r} requires {name} (int32 [B])")
  seqlens = _as_array(seqlens, name, allow_sequence=True)
  if seqlens.shape != (batch,):
    raise ValueError(f"{name} must have shape [B] = ({batch},), got {tuple(seqlens.shape)}")
  if not jnp.issubdtype(seqlens.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {seqlens.dtype}")
  if not isinstance(seqlens, jax.core.Tracer):
    values = np.asarray(seqlens)
    if values.size and (values.min() < 0 or values.max() > seqlen):
      raise ValueError(f"{name} values must lie in [0, {seqlen}], got {values.tolist()}")
  return _saturate_to_int32(jnp.asarray(seqlens))


def _saturate_to_int32(x):
  """int32 values of an integer array, clamped instead of wrapped: 2**32 + 5 stays out of range (2**31 - 1) rather than
  becoming 5, so the run-time length check sees that it is out of range."""
  if x.dtype == jnp.int32:
    return x
  info = jnp.iinfo(x.dtype)
  if info.min < _INT32.min or info.max > _INT32.max:
    x = jnp.clip(x, max(info.min, _INT32.min), min(info.max, _INT32.max))
  return x.astype(jnp.int32)


def _check_window(window_size) -> tuple[int, int]:
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise TypeError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
  for side, value in (("left", left), ("right", right)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
      raise TypeError(f"window_size {side} must be an int, got {value!r}")
    if not -1 <= value <= MAX_WINDOW:
      raise ValueError(f"window_size {side} must be -1 (unbounded) or in [0, {MAX_WINDOW}], got {value}")
  return int(left), int(right)


def _check_scale(scale, head_dim: int) -> float:
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


def _check_softcap(softcap) -> float:
  if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
    raise TypeError(f"softcap must be a Python float, got {type(softcap).__name__}")
  if not (math.isfinite(softcap) and softcap >= 0 and math.isfinite(_as_float32(softcap))) or (
      softcap > 0 and _as_float32(softcap) == 0):
    raise ValueError(f"softcap must be 0 (off) or a positive number within float32 range, got {softcap}")
  return float(softcap)


def _alibi_operand(alibi_slopes, batch: int, num_heads: int):
  if alibi_slopes is None:
    return _primitives.no_alibi()
  alibi_slopes = _as_array(alibi_slopes, "alibi_slopes", allow_sequence=True)
  if alibi_slopes.shape not in ((num_heads,), (batch, num_heads)):
    raise ValueError(f"alibi_slopes must have shape [H] = ({num_heads},) or [B, H] = ({batch}, {num_heads}), "
                     f"got {tuple(alibi_slopes.shape)}")
  if not jnp.issubdtype(alibi_slopes.dtype, jnp.floating):
    raise TypeError(f"alibi_slopes must be a float array, got {alibi_slopes.dtype}")
  return jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (batch, num_heads))


def _bias_operand(bias, full_shape: tuple[int, int, int, int]):
  """The bias operand (te_jax/_primitives.py): bias as it is, each dim full or 1, or the placeholder without one."""
  if bias is None:
    return _primitives.no_bias()
  bias = _as_array(bias, "bias")
  allowed = "[B or 1, H or 1, Sq or 1, Skv or 1] = [{} or 1, {} or 1, {} or 1, {} or 1]".format(*full_shape)
  if bias.ndim != 4:
    raise ValueError(f"bias must have rank 4, {allowed}; got shape {tuple(bias.shape)}")
  if any(extent not in (1, full) for extent, full in zip(bias.shape, full_shape)):
    raise ValueError(f"bias must have shape {allowed} (each dim full or 1); got {tuple(bias.shape)}")
  if np.dtype(bias.dtype) not in DTYPE_CODES:
    raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
  return jnp.asarray(bias)


def _dropout_operand(rate, rng) -> tuple[int, Any]:
  """The drop threshold (0: no dropout) and the dropout operand (te_jax/_primitives.py) of an unsharded call."""
  rate = check_rate(rate)
  if rate == 0.0:
    return 0, _primitives.no_dropout()
  if rng is None:
    raise ValueError(f"dropout_rate={rate} needs dropout_rng, a JAX PRNG key (jax.random.key or jax.random.PRNGKey)")
  return int(drop_threshold(rate)), _primitives.dropout_operand(key_words(rng))


def _token_operands(q_segment_ids, kv_segment_ids, q_positions, kv_positions, mask: MaskType, batch: int,
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
  x = _as_array(x, name, allow_sequence=True)
  if tuple(x.shape) != (batch, seqlen):
    raise ValueError(f"{name} must have shape [B, {seq_name}] = ({batch}, {seqlen}), got {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer (int32) array, got {x.dtype}")
  return _saturate_to_int32(jnp.asarray(x))
