"""A pure-JAX implementation of the two attention primitives' semantics (forward and backward), used by the sharding
tests as a stand-in lowering when the C++ CPU extension is not built, and as an independent check of the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

from te_jax import _primitives


def _logits_and_mask(q, k, q_seqlens, kv_seqlens, alibi, config):
  batch, seqlen_q, num_heads, _ = q.shape
  seqlen_kv, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  ke = jnp.repeat(k.astype(jnp.float32), group, axis=2)
  raw = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), ke) * config.scale
  if config.softcap > 0:
    t = jnp.tanh(raw / config.softcap)
    s, dsdraw = config.softcap * t, config.scale * (1.0 - t * t)
  else:
    s, dsdraw = raw, jnp.full_like(raw, config.scale)
  i = jnp.arange(seqlen_q)[None, :, None]
  j = jnp.arange(seqlen_kv)[None, None, :]
  sq = q_seqlens[:, None, None]
  skv = kv_seqlens[:, None, None]
  p = i + (skv - sq if config.mask_type.is_bottom_right else 0)
  visible = (i < sq) & (j < skv)
  if config.mask_type.is_causal:
    visible &= j <= p
  if config.window_left >= 0:
    visible &= j >= p - config.window_left
  if config.window_right >= 0:
    visible &= j <= p + config.window_right
  if config.has_alibi:
    s = s + alibi[:, :, None, None] * (j - p).astype(jnp.float32)[:, None]
  return s, dsdraw, visible[:, None], ke, group


def forward(q, k, v, q_seqlens, kv_seqlens, alibi, *, config):
  s, _, visible, _, group = _logits_and_mask(q, k, q_seqlens, kv_seqlens, alibi, config)
  s = jnp.where(visible, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  finite = jnp.isfinite(lse)
  probs = jnp.where(visible & finite[..., None], jnp.exp(s - jnp.where(finite, lse, 0.0)[..., None]), 0.0)
  ve = jnp.repeat(v.astype(jnp.float32), group, axis=2)
  out = jnp.einsum("bhij,bjhd->bihd", probs, ve)
  return out.astype(q.dtype), jnp.where(finite, lse, -jnp.inf)


def backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, *, config):
  s, dsdraw, visible, ke, group = _logits_and_mask(q, k, q_seqlens, kv_seqlens, alibi, config)
  finite = jnp.isfinite(lse)
  probs = jnp.where(visible & finite[..., None], jnp.exp(s - jnp.where(finite, lse, 0.0)[..., None]), 0.0)
  ve = jnp.repeat(v.astype(jnp.float32), group, axis=2)
  dout = dout.astype(jnp.float32)
  dlse = jnp.where(finite, dlse, 0.0)
  dve = jnp.einsum("bhij,bihd->bjhd", probs, dout)
  dprobs = jnp.einsum("bihd,bjhd->bhij", dout, ve)
  delta = jnp.einsum("bihd,bihd->bhi", dout, out.astype(jnp.float32))
  ds = probs * (dprobs - delta[..., None] + dlse[..., None]) * dsdraw
  dq = jnp.einsum("bhij,bjhd->bihd", ds, ke)
  dke = jnp.einsum("bhij,bihd->bjhd", ds, q.astype(jnp.float32))
  batch, seqlen_kv, num_kv_heads = k.shape[:3]
  fold = lambda x: x.reshape(batch, seqlen_kv, num_kv_heads, group, x.shape[-1]).sum(axis=3)
  return dq.astype(q.dtype), fold(dke).astype(k.dtype), fold(dve).astype(v.dtype)


def install_cpu_lowering() -> None:
  """Makes both primitives lower to the pure-JAX implementation on the CPU (for running without the extension)."""
  mlir.register_lowering(_primitives.attention_forward_p, mlir.lower_fun(forward, multiple_results=True),
                         platform="cpu")
  mlir.register_lowering(_primitives.attention_backward_p, mlir.lower_fun(backward, multiple_results=True),
                         platform="cpu")


def extension_available() -> bool:
  try:
    import te_jax._te_jax_cpu  # noqa: F401
    return True
  except ImportError:
    return False
