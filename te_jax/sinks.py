"""Attention sinks: one extra logit per head that joins every row's softmax denominator and carries no value,
out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)) (gpt-oss; the off-by-one softmax is sink 0).

The sink is a key set of its own with lse = sink and out = 0, so attention with sinks is the kernels' attention merged
with it by lse (as te_jax.merge_states merges): lse' = log(exp(lse) + exp(sink)), out' = out exp(lse - lse'). te_jax's
forward kernels do that merge on each finished row in float, before out is rounded (cpp/core/sink.h: they get the sinks
operand); apply_sinks below does it in XLA after cuDNN's kernel (the lowering, te_jax/_primitives.py) and after
context parallelism's merge of its blocks (te_jax/attention.py). The backward needs no kernel change: the kernels
recompute the probabilities from the lse they are given, and with lse' and out' they are the sink softmax's (the
sink's own share, exp(sink - lse'), is what the rows' probabilities no longer sum to), which gives dq, dk and dv; the
sink's gradient is -sum_i exp(sink - lse'_i) (dout'_i . out'_i - dlse'_i)."""

from __future__ import annotations

import jax.numpy as jnp


def apply_sinks(out, lse, sinks):
  """(out', lse') from the kernels' out [B, Sq, H, Dv] and lse [B, H, Sq] and the sinks [B, H] (cpp/core/sink.h is the
  kernels' copy). A row that sees no key gets out 0 and lse = sink; a sink of -inf is no sink (also for such a row:
  out 0, lse -inf); NaN propagates."""
  sink = sinks[:, :, None]
  merged = jnp.logaddexp(lse, sink)
  # lse == merged when the sink adds nothing (-inf), also for rows whose lse is -inf, where exp(-inf + inf) is NaN.
  weight = jnp.where(lse == merged, 1.0, jnp.exp(lse - merged))
  scaled = out.astype(jnp.float32) * jnp.swapaxes(weight, 1, 2)[..., None]
  return scaled.astype(out.dtype), merged


def sink_gradient(out, lse, dout, dlse, sinks):
  """d(loss)/d(sink) [H] from the sink softmax's out', lse' and their cotangents."""
  share = jnp.where(sinks[None, :, None] == -jnp.inf, 0.0, jnp.exp(sinks[None, :, None] - lse))  # [B, H, Sq]
  delta = jnp.einsum("bshd,bshd->bhs", dout.astype(jnp.float32), out.astype(jnp.float32))
  return -jnp.sum(share * (delta - dlse), axis=(0, 2))
