"""The per-shard forward and backward of context parallelism (they run inside shard_map or a custom_partitioning
lowering): a call with segment ids or positions takes the packed path, any other its strategy."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from te_jax import _primitives
from te_jax.attention_config import AttentionConfig
from te_jax.context_parallel import all_gather, packed, ring
from te_jax.context_parallel.chunks import chunk_ids, split
from te_jax.context_parallel.layout import (ContextParallel, check_axis_size, poison, unsupported_lengths,
                                            uses_tokens)


def local_forward(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config: AttentionConfig,
                  cp: ContextParallel):
  """Local shards [B, S/N, ...] (global q_seqlens/kv_seqlens, alibi) -> local out, lse. `sinks` is a placeholder (the
  sinks join after the blocks' merge, te_jax/attention.py). `tokens`: the local segment ids and positions (placeholders
  when the call has none), then the page table, kv_descale and bias placeholders, the dropout operand (the key, with
  this shard's batch and head offsets; each block adds its sequence offsets) and the mods' captures (whole)."""
  del sinks
  tokens, captures = _primitives.split_captures(tokens, config)
  dropout = tokens[-1]
  if uses_tokens(config):
    return packed.forward(q, k, v, alibi, tokens[:4], dropout, captures, config, cp)
  q_seqlens, kv_seqlens = _global_lengths(config, cp, q, q_seqlens, kv_seqlens)
  check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  n_local = 2 if cp.load_balanced else 1
  chunk = q.shape[1] // n_local
  q_chunks = split(q, n_local, 1)
  q_ids = chunk_ids(cp, rank)
  bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
  if cp.strategy == "all_gather":
    outs, lses = all_gather.forward(q_chunks, q_ids, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp,
                                    chunk)
  else:
    outs, lses = ring.forward(q_chunks, q_ids, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp, rank,
                              chunk)
  out = jnp.concatenate(outs, axis=1) if n_local > 1 else outs[0]
  lse = jnp.concatenate(lses, axis=2) if n_local > 1 else lses[0]
  return poison(bad, out.astype(q.dtype), lse)


def local_backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, *placeholders,
                   config: AttentionConfig, cp: ContextParallel):
  """Local shards -> local dq, dk, dv, the bias placeholder's zero gradient and the capture gradients of this shard's
  batch entries and heads, summed over the sequence's shards (each block uses the final out and lse, so its softmax is
  exact, and the same dropout operand as its forward, so its keep-mask is the forward's). `placeholders`: the tokens,
  page table, kv_descale, bias and dropout operands and the captures (see local_forward)."""
  del sinks
  placeholders, captures = _primitives.split_captures(placeholders, config)
  no_dbias = jnp.zeros_like(placeholders[-2])
  dropout = placeholders[-1]
  if uses_tokens(config):
    dq, dk, dv, grads = packed.backward(q, k, v, out, lse, dout, dlse, alibi, placeholders[:4], dropout, captures,
                                        config, cp)
    return (dq, dk, dv, no_dbias, *(lax.psum(g, cp.axis) for g in grads))
  q_seqlens, kv_seqlens = _global_lengths(config, cp, q, q_seqlens, kv_seqlens)
  check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  n_local = 2 if cp.load_balanced else 1
  chunk = q.shape[1] // n_local
  q_ids = chunk_ids(cp, rank)
  per_q = list(zip(split(q, n_local, 1), split(out, n_local, 1), split(lse, n_local, 2),
                   split(dout, n_local, 1), split(dlse, n_local, 2), q_ids))
  bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
  if cp.strategy == "all_gather":
    dqs, dk, dv, grads = all_gather.backward(per_q, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp,
                                             chunk)
  else:
    dqs, dk, dv, grads = ring.backward(per_q, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp, rank,
                                       chunk)
  dq = jnp.concatenate(dqs, axis=1) if n_local > 1 else dqs[0]
  return (*poison(bad, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)), no_dbias,
          *(lax.psum(g, cp.axis) for g in grads))  # the sequence shards' terms


def _global_lengths(config, cp, q, q_seqlens, kv_seqlens):
  """Without a padding mask fused_attn passes placeholders: the global lengths are the shards' times the axis size.
  Calls here have Sq == Skv (check_supported), so q's length serves both."""
  if config.mask_type.is_padding:
    return q_seqlens, kv_seqlens  # the caller's lengths are global sequence lengths
  full = jnp.full((q.shape[0],), q.shape[1] * cp.size, jnp.int32)
  return full, full
