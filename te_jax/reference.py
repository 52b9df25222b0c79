"""A float64 NumPy reference of fused_attn's semantics, forward and gradients, written from the definition in the
README (not from the kernels). Tests, `python -m te_jax` and the benchmark's error column compare against it."""

from __future__ import annotations

import numpy as np

from te_jax.mask_type import MaskType


def visible_mask(mask_type, seqlen_q, seqlen_kv, q_seqlens, kv_seqlens, window_size=(-1, -1)) -> np.ndarray:
  """bool [B, Sq, Skv]: whether query i of batch b sees key j."""
  mask_type = MaskType.parse(mask_type)
  left, right = window_size
  i = np.arange(seqlen_q)[None, :, None]
  j = np.arange(seqlen_kv)[None, None, :]
  sq = np.asarray(q_seqlens, np.int64)[:, None, None]
  skv = np.asarray(kv_seqlens, np.int64)[:, None, None]
  p = i + (skv - sq if mask_type.is_bottom_right else 0)
  visible = (i < sq) & (j < skv)
  if mask_type.is_causal:
    visible &= j <= p
  if left >= 0:
    visible &= j >= p - left
  if right >= 0:
    visible &= j <= p + right
  return visible


def _diag_positions(mask_type, seqlen_q, q_seqlens, kv_seqlens) -> np.ndarray:
  """p_i per batch, [B, Sq]."""
  i = np.arange(seqlen_q)[None, :]
  if MaskType.parse(mask_type).is_bottom_right:
    return i + (np.asarray(kv_seqlens, np.int64) - np.asarray(q_seqlens, np.int64))[:, None]
  return np.broadcast_to(i, (len(q_seqlens), seqlen_q))


def _logits(q, k, scale, softcap, alibi_slopes, p):
  """Returns (s, dlogit/draw) in float64, [B, H, Sq, Skv]; k already expanded to H heads."""
  raw = np.einsum("bihd,bjhd->bhij", q, k) * scale
  if softcap > 0:
    t = np.tanh(raw / softcap)
    s, dsdraw = softcap * t, scale * (1.0 - t * t)
  else:
    s, dsdraw = raw, np.full_like(raw, scale)
  if alibi_slopes is not None:
    slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), (q.shape[0], q.shape[2]))
    j = np.arange(k.shape[1])
    s = s + slopes[:, :, None, None] * (j[None, None, None, :] - p[:, None, :, None])
  return s, dsdraw


def attention_reference(q, k, v, *, mask_type="no_mask", q_seqlens=None, kv_seqlens=None, window_size=(-1, -1),
                        scale=None, softcap=0.0, alibi_slopes=None, dout=None, dlse=None):
  """Returns dict with out [B,Sq,H,Dv], lse [B,H,Sq] and, if dout is given, dq, dk, dv (all float64)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, seqlen_q, num_heads, head_dim = q.shape
  seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  q_seqlens = np.full(batch, seqlen_q) if q_seqlens is None else np.asarray(q_seqlens)
  kv_seqlens = np.full(batch, seqlen_kv) if kv_seqlens is None else np.asarray(kv_seqlens)
  scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
  ke, ve = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  p = _diag_positions(mask_type, seqlen_q, q_seqlens, kv_seqlens)
  s, dsdraw = _logits(q, ke, scale, softcap, alibi_slopes, p)
  visible = visible_mask(mask_type, seqlen_q, seqlen_kv, q_seqlens, kv_seqlens, window_size)[:, None]
  s = np.where(visible, s, -np.inf)
  row_max = s.max(axis=-1, keepdims=True)
  any_visible = np.isfinite(row_max)
  e = np.where(visible, np.exp(s - np.where(any_visible, row_max, 0.0)), 0.0)
  total = e.sum(axis=-1, keepdims=True)
  probs = np.where(any_visible, e / np.where(any_visible, total, 1.0), 0.0)
  lse = np.where(any_visible, np.log(np.where(any_visible, total, 1.0)) + np.where(any_visible, row_max, 0.0),
                 -np.inf)[..., 0]
  out = np.einsum("bhij,bjhd->bihd", probs, ve)
  result = dict(out=out, lse=lse)
  if dout is None:
    return result
  dout = np.asarray(dout, np.float64)
  dlse = np.zeros_like(lse) if dlse is None else np.where(np.isfinite(lse), np.asarray(dlse, np.float64), 0.0)
  dve = np.einsum("bhij,bihd->bjhd", probs, dout)
  dprobs = np.einsum("bihd,bjhd->bhij", dout, ve)
  delta = np.einsum("bihd,bihd->bhi", dout, out)
  ds = probs * (dprobs - delta[..., None] + dlse[..., None])
  draw = ds * dsdraw
  dq = np.einsum("bhij,bjhd->bihd", draw, ke)
  dke = np.einsum("bhij,bihd->bjhd", draw, q)
  fold = lambda x: x.reshape(batch, seqlen_kv, num_kv_heads, group, x.shape[-1]).sum(axis=3)
  result.update(dq=dq, dk=fold(dke), dv=fold(dve))
  return result
