"""A float64 NumPy reference of fused_attn's semantics, forward and gradients, written from the definition in the
README (not from the kernels). Tests, `python -m te_jax` and the benchmark's error column compare against it."""

from __future__ import annotations

import numpy as np

from te_jax.dropout import drop_threshold
from te_jax.mask_type import MaskType


def visible_mask(mask_type, seqlen_q, seqlen_kv, q_seqlens, kv_seqlens, window_size=(-1, -1), q_segment_ids=None,
                 kv_segment_ids=None, q_positions=None, kv_positions=None) -> np.ndarray:
  """bool [B, Sq, Skv]: whether query i of batch b sees key j. Segment ids: same nonzero id on both sides. Positions
  (each side defaults to its indices when the other is given): the causal mask and the window compare them."""
  mask_type = MaskType.parse(mask_type)
  left, right = window_size
  i = np.arange(seqlen_q)[None, :, None]
  j = np.arange(seqlen_kv)[None, None, :]
  sq = np.asarray(q_seqlens, np.int64)[:, None, None]
  skv = np.asarray(kv_seqlens, np.int64)[:, None, None]
  p = i + (skv - sq if mask_type.is_bottom_right else 0)
  visible = (i < sq) & (j < skv)
  if q_segment_ids is not None:
    q_ids = np.asarray(q_segment_ids, np.int64)
    kv_ids = q_ids if kv_segment_ids is None else np.asarray(kv_segment_ids, np.int64)
    visible &= (q_ids[:, :, None] != 0) & (q_ids[:, :, None] == kv_ids[:, None, :])
  if q_positions is not None or kv_positions is not None:
    p, j = _positions(q_positions, kv_positions, len(sq), seqlen_q, seqlen_kv)
    p, j = p[:, :, None], j[:, None, :]
  if mask_type.is_causal:
    visible &= j <= p
  if left >= 0:
    visible &= j >= p - left
  if right >= 0:
    visible &= j <= p + right
  return visible


def _positions(q_positions, kv_positions, batch, seqlen_q, seqlen_kv):
  """int64 [B, Sq] query and [B, Skv] key positions, the indices where not given."""
  q = np.broadcast_to(np.arange(seqlen_q), (batch, seqlen_q)) if q_positions is None else q_positions
  kv = np.broadcast_to(np.arange(seqlen_kv), (batch, seqlen_kv)) if kv_positions is None else kv_positions
  return np.asarray(q, np.int64), np.asarray(kv, np.int64)


def _drawn_rate(rate: float) -> float:
  """The rate the keep-mask draws: rate rounded to a multiple of 2^-16 (te_jax/dropout.py)."""
  return float(drop_threshold(rate)) / 2.0**16


def _diag_positions(mask_type, seqlen_q, q_seqlens, kv_seqlens) -> np.ndarray:
  """p_i per batch, [B, Sq]."""
  i = np.arange(seqlen_q)[None, :]
  if MaskType.parse(mask_type).is_bottom_right:
    return i + (np.asarray(kv_seqlens, np.int64) - np.asarray(q_seqlens, np.int64))[:, None]
  return np.broadcast_to(i, (len(q_seqlens), seqlen_q))


def _logits(q, k, scale, softcap, alibi_slopes, p, key_positions):
  """Returns (s, dlogit/draw) in float64, [B, H, Sq, Skv]; k already expanded to H heads; p [B, Sq] and key_positions
  [B, Skv] are the positions ALiBi uses."""
  raw = np.einsum("bihd,bjhd->bhij", q, k) * scale
  if softcap > 0:
    t = np.tanh(raw / softcap)
    s, dsdraw = softcap * t, scale * (1.0 - t * t)
  else:
    s, dsdraw = raw, np.full_like(raw, scale)
  if alibi_slopes is not None:
    slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), (q.shape[0], q.shape[2]))
    s = s + slopes[:, :, None, None] * (key_positions[:, None, None, :] - p[:, None, :, None])
  return s, dsdraw


def _visible_sum(weights, values, visible, over: str):
  """Sums weights [B,H,Sq,Skv] times values over the visible (query, key) pairs only: over "keys" gives [B,Sq,H,D] from
  values [B,Skv,H,D], over "queries" gives [B,Skv,H,D] from values [B,Sq,H,D]. weights are 0 outside `visible`, but a
  plain product would still add 0 * NaN = NaN from a non-finite value there, and pairs a row does not see must never
  affect it; so the non-finite values are summed apart, over visible pairs alone."""
  spec = "bhij,bjhd->bihd" if over == "keys" else "bhij,bihd->bjhd"
  finite = np.isfinite(values)
  result = np.einsum(spec, weights, np.where(finite, values, 0.0))
  if finite.all():
    return result
  bad = np.where(finite, 0.0, values).transpose(0, 2, 1, 3)  # [B, H, S, D]
  if over == "keys":
    terms = np.where(visible[..., None], weights[..., None] * bad[:, :, None, :, :], 0.0).sum(axis=3)
  else:
    terms = np.where(visible[..., None], weights[..., None] * bad[:, :, :, None, :], 0.0).sum(axis=2)
  return result + terms.transpose(0, 2, 1, 3)


def attention_reference(q, k, v, *, mask_type="no_mask", q_seqlens=None, kv_seqlens=None, window_size=(-1, -1),
                        scale=None, softcap=0.0, alibi_slopes=None, dout=None, dlse=None, q_segment_ids=None,
                        kv_segment_ids=None, q_positions=None, kv_positions=None, bias=None,
                        keep_mask=None, dropout_rate=0.0, sink_logits=None):
  """Returns dict with out [B,Sq,H,Dv], lse [B,H,Sq] and, if dout is given, dq, dk, dv and, with a bias, dbias (its
  shape, summed over its broadcast dims; all float64).

  IEEE arithmetic over each row's visible keys: a NaN or inf in the row's q, in a visible key's k or v, or in a slope
  reaches that row's results as the formula carries it; keys a row does not see never affect it; a row with no visible
  key gives out = 0, lse = -inf and zero gradients. bias ([B or 1, H or 1, Sq or 1, Skv or 1]) is added to the logits
  after ALiBi; a row whose visible logits are then all -inf counts as a row with no visible key. keep_mask (bool
  [B, H, Sq, Skv], e.g. te_jax.dropout_keep_mask) applies attention dropout: out and dv use the probabilities times
  keep_mask / (1 - dropout_rate); lse is unchanged. sink_logits ([H]) adds one valueless logit per head to every
  row's softmax denominator (attention sinks): lse includes it, a row with no visible key gives out = 0, lse = sink.
  (No gradient for the sinks here: tests/test_sinks.py differentiates the definition.)"""
  if sink_logits is not None:
    return _with_sinks(sink_logits, dict(q=q, k=k, v=v, mask_type=mask_type, q_seqlens=q_seqlens,
                                         kv_seqlens=kv_seqlens, window_size=window_size, scale=scale, softcap=softcap,
                                         alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids,
                                         kv_segment_ids=kv_segment_ids, q_positions=q_positions,
                                         kv_positions=kv_positions, bias=bias, keep_mask=keep_mask,
                                         dropout_rate=dropout_rate), dout, dlse)
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  batch, seqlen_q, num_heads, head_dim = q.shape
  seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  q_seqlens = np.full(batch, seqlen_q) if q_seqlens is None else np.asarray(q_seqlens)
  kv_seqlens = np.full(batch, seqlen_kv) if kv_seqlens is None else np.asarray(kv_seqlens)
  scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
  ke, ve = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  p = _diag_positions(mask_type, seqlen_q, q_seqlens, kv_seqlens)
  key_positions = np.broadcast_to(np.arange(seqlen_kv), (batch, seqlen_kv))
  if q_positions is not None or kv_positions is not None:
    p, key_positions = _positions(q_positions, kv_positions, batch, seqlen_q, seqlen_kv)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    s, dsdraw = _logits(q, ke, scale, softcap, alibi_slopes, p, key_positions)
    visible = visible_mask(mask_type, seqlen_q, seqlen_kv, q_seqlens, kv_seqlens, window_size, q_segment_ids,
                           kv_segment_ids, q_positions, kv_positions)[:, None]
    if bias is not None:
      s = s + np.asarray(bias, np.float64)
      visible = visible & ~np.all(np.where(visible, s == -np.inf, True), axis=-1, keepdims=True)
    any_visible = visible.any(axis=-1, keepdims=True)
    s = np.where(visible, s, -np.inf)
    # The row max shifts the exponentials; NaN and +inf in it carry through, and a row whose visible logits are all
    # -inf (from inf inputs) keeps a sum of 0, hence lse = -inf and out = 0 / 0 = NaN.
    row_max = s.max(axis=-1, keepdims=True)
    shift = np.where(row_max == -np.inf, 0.0, row_max)
    e = np.where(visible, np.exp(s - shift), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    probs = np.where(visible, e / np.where(any_visible, total, 1.0), 0.0)
    lse = np.where(any_visible, np.log(total) + shift, -np.inf)[..., 0]
    # 1 without dropout, else keep / (1 - rate): what P.V multiplies each probability by (the rate rounded to 2^-16
    # as the mask draws it, te_jax/dropout.py).
    keep_scale = 1.0 if keep_mask is None else np.asarray(keep_mask, np.float64) / (1.0 - _drawn_rate(dropout_rate))
    dropped = probs * keep_scale
    out = _visible_sum(dropped, ve, visible, "keys")
    result = dict(out=out, lse=lse)
    if dout is None:
      return result
    dout = np.asarray(dout, np.float64)
    dlse = np.zeros_like(lse) if dlse is None else np.where(any_visible[..., 0], np.asarray(dlse, np.float64), 0.0)
    dve = _visible_sum(dropped, dout, visible, "queries")
    dprobs = np.einsum("bihd,bjhd->bhij", dout, ve)  # used at visible pairs only (below)
    delta = np.einsum("bihd,bihd->bhi", dout, out)
    dlogits = np.where(visible, probs * (keep_scale * dprobs - delta[..., None] + dlse[..., None]), 0.0)
    draw = dlogits * dsdraw
    dq = _visible_sum(draw, ke, visible, "keys")
    dke = _visible_sum(draw, q, visible, "queries")
  fold = lambda x: x.reshape(batch, seqlen_kv, num_kv_heads, group, x.shape[-1]).sum(axis=3)
  result.update(dq=dq, dk=fold(dke), dv=fold(dve))
  if bias is not None:
    broadcast = tuple(axis for axis, extent in enumerate(np.shape(bias)) if extent == 1)
    result["dbias"] = dlogits.sum(axis=broadcast, keepdims=True)
  return result


def _with_sinks(sink_logits, arguments: dict, dout, dlse) -> dict:
  """attention_reference with sinks, from the reference without them: lse' = logaddexp(lse, sink), so each
  probability and out scale by c = exp(lse - lse'). The logits' gradient is then P' (dO.V - dO.out' + dlse'), which is
  the reference's own formula fed dO c and dlse = c (dlse' + (1 - c) dO.out)."""
  plain = attention_reference(**arguments)
  sink = np.asarray(sink_logits, np.float64)[:, None]  # [H, 1] against lse [B, H, Sq]
  with np.errstate(invalid="ignore"):
    lse = np.logaddexp(plain["lse"], sink)
    c = np.where(np.isneginf(plain["lse"]), 0.0, np.exp(plain["lse"] - lse))
  per_row = c.transpose(0, 2, 1)[..., None]  # out's layout [B, Sq, H, 1]
  result = dict(out=plain["out"] * per_row, lse=lse)
  if dout is None:
    return result
  dout = np.asarray(dout, np.float64)
  dlse = np.zeros_like(lse) if dlse is None else np.asarray(dlse, np.float64)
  delta = np.einsum("bqhd,bqhd->bhq", dout, plain["out"])
  grads = attention_reference(**arguments, dout=dout * per_row, dlse=c * (dlse + (1.0 - c) * delta))
  result.update({name: grads[name] for name in ("dq", "dk", "dv", "dbias") if name in grads})
  return result
