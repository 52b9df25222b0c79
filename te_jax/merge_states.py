"""Merging attention over disjoint key sets by their log-sum-exp (cascade attention, split-KV, context parallelism).

Attention of the same queries over keys A and over keys B, each with its lse (fused_attn(..., return_lse=True)),
gives attention over A and B together: lse = log(exp(lse_a) + exp(lse_b)) and out = w_a out_a + w_b out_b with
w = exp(lse_part - lse). A row that saw no key in a part (lse -inf, out 0) contributes nothing; a row that saw no key
in either stays out 0, lse -inf. Non-finite values follow IEEE arithmetic: a NaN lse or out makes the row NaN."""

from __future__ import annotations

import jax.numpy as jnp


def merge_partial(out_a, lse_a, out_b, lse_b):
  """The merge in float32: out [B, S, H, Dv] (any float dtype), lse float32 [B, H, S]. Returns (out float32, lse)."""
  neg_inf = -jnp.inf
  empty = (lse_a == neg_inf) & (lse_b == neg_inf)
  m = jnp.where(empty, 0.0, jnp.maximum(lse_a, lse_b))  # jnp.maximum propagates NaN
  wa, wb = jnp.exp(lse_a - m), jnp.exp(lse_b - m)
  total = jnp.where(empty, 1.0, wa + wb)  # never log(0) or 1/0, whose gradients would poison jnp.where's
  lse = jnp.where(empty, neg_inf, m + jnp.log(total))
  to_out = lambda w: jnp.swapaxes(jnp.where(empty, 0.0, w / total), 1, 2)[..., None]  # [B,H,S] -> [B,S,H,1]
  return to_out(wa) * out_a.astype(jnp.float32) + to_out(wb) * out_b.astype(jnp.float32), lse


def merge_states(out_a, lse_a, out_b, lse_b):
  """Combines two attentions of the same queries over disjoint key sets into the attention over their union.

  out_a, out_b: [B, S, H, Dv] (fused_attn's out); lse_a, lse_b: float32 [B, H, S] (its lse with return_lse=True).
  Returns (out, lse): out in the promoted dtype of out_a and out_b, computed in float32; lse float32 [B, H, S].
  Works under jit, vmap and grad."""
  for name, x in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
  out_a, out_b, lse_a, lse_b = (jnp.asarray(x) for x in (out_a, out_b, lse_a, lse_b))
  if out_a.ndim != 4:
    raise ValueError(f"out_a must have shape [B, S, H, Dv], got {tuple(out_a.shape)}")
  if out_b.shape != out_a.shape:
    raise ValueError(f"out_b must have out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
  b, s, h, _ = out_a.shape
  for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
    if lse.shape != (b, h, s):
      raise ValueError(f"{name} must have shape [B, H, S] = {(b, h, s)} for outs of shape {tuple(out_a.shape)}, "
                       f"got {tuple(lse.shape)}")
  for name, x in (("out_a", out_a), ("out_b", out_b), ("lse_a", lse_a), ("lse_b", lse_b)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point array, got {x.dtype}")
  out, lse = merge_partial(out_a, lse_a.astype(jnp.float32), out_b, lse_b.astype(jnp.float32))
  return out.astype(jnp.result_type(out_a, out_b)), lse
