"""The ring strategy: N steps; at step s a device computes its queries against the K/V block that started on device
(r - s) mod N while the next block is already travelling (collective permute); blocks entirely in the causal future
are skipped (lax.switch), and the partial results are merged by log-sum-exp in float32. The backward runs the same
ring with the final out/lse (so the softmax is exact per block); dK/dV accumulators (float32) travel with their K/V
block and one last permute returns them to their owners."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.context_parallel.blocks import (add_gradients, block_backward, block_dropout, block_forward, empty_state,
                                            geometry)
from te_jax.context_parallel.chunks import chunk_ids, split
from te_jax.context_parallel.layout import ContextParallel
from te_jax.merge_states import merge_partial


def ring_pass(block, cp: ContextParallel):
  """Sends every array of `block` one step along the ring."""
  return jax.tree.map(lambda x: lax.ppermute(x, cp.axis, _ring_perm(cp)), block)


def _ring_perm(cp):
  return [(i, (i + 1) % cp.size) for i in range(cp.size)]


def _ring_kind(config, qid, kid):
  """0: skip, 1: full, 2: causal (diagonal) for a ring block; q/k chunk ids are traced scalars."""
  if not config.mask_type.is_causal:
    return None
  return jnp.where(qid > kid, 1, jnp.where(qid == kid, 2, 0))


def forward(q_chunks, q_ids, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp, rank, chunk):
  """[out], [lse] (float32) of each local query chunk (natural chunk q_ids[t], of `chunk` rows) against every K/V
  block of the ring."""
  n_local = len(q_chunks)
  outs, lses = (list(state) for state in zip(*(empty_state(qc, v, jnp.float32) for qc in q_chunks)))
  k_cur, v_cur = k, v
  for step in range(cp.size):
    if step < cp.size - 1:  # issued first: the next block travels while this one computes
      k_next, v_next = ring_pass((k_cur, v_cur), cp)
    src = (rank - step) % cp.size
    for kc, vc, kid in zip(split(k_cur, n_local, 1), split(v_cur, n_local, 1), chunk_ids(cp, src)):
      for t, (qc, qid) in enumerate(zip(q_chunks, q_ids)):
        out, lse = _block_forward(config, qc, kc, vc, qid, kid, chunk, q_seqlens, kv_seqlens, alibi, dropout,
                                  captures)
        outs[t], lses[t] = merge_partial(outs[t], lses[t], out, lse)
    if step < cp.size - 1:
      k_cur, v_cur = k_next, v_next
  return outs, lses


def _block_forward(config, qc, kc, vc, qid, kid, chunk, q_seqlens, kv_seqlens, alibi, dropout, captures):
  qo, ko = qid * chunk, kid * chunk
  dropout = block_dropout(config, dropout, qo, ko)

  def run(kind):
    blk = geometry(config, kind, qo, ko, chunk, chunk, q_seqlens, kv_seqlens, alibi)
    return block_forward(config, kind, qc, kc, vc, blk, alibi, dropout, captures)

  def skip():
    return empty_state(qc, vc, qc.dtype)

  index = _ring_kind(config, qid, kid)
  if index is None:
    return run("full")
  return lax.switch(index, [skip, lambda: run("full"), lambda: run("causal")])


def backward(per_q, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp, rank, chunk):
  """[dq] (float32) of each local query chunk, this shard's dk, dv (float32) and its terms of the capture gradients
  (they stay on the device: every pair adds to the same arrays). per_q: (q, out, lse, dout, dlse, chunk id) of each
  local query chunk."""
  n_local = len(per_q)
  dqs = [jnp.zeros(p[0].shape, jnp.float32) for p in per_q]
  grads = None
  k_cur, v_cur = k, v
  dk_acc, dv_acc = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  for step in range(cp.size):
    if step < cp.size - 1:
      k_next, v_next = ring_pass((k_cur, v_cur), cp)
    src = (rank - step) % cp.size
    dk_parts, dv_parts = [], []
    for kc, vc, kid in zip(split(k_cur, n_local, 1), split(v_cur, n_local, 1), chunk_ids(cp, src)):
      dk_c = jnp.zeros(kc.shape, jnp.float32)
      dv_c = jnp.zeros(vc.shape, jnp.float32)
      for t, (qc, oc, lc, doc, dlc, qid) in enumerate(per_q):
        (dq_b, dk_b, dv_b), grads_b = _block_backward(config, qc, kc, vc, oc, lc, doc, dlc, qid, kid, chunk,
                                                    q_seqlens, kv_seqlens, alibi, dropout, captures)
        grads = add_gradients(grads, grads_b)
        dqs[t] = dqs[t] + dq_b
        dk_c, dv_c = dk_c + dk_b, dv_c + dv_b
      dk_parts.append(dk_c)
      dv_parts.append(dv_c)
    dk_acc = dk_acc + (jnp.concatenate(dk_parts, axis=1) if n_local > 1 else dk_parts[0])
    dv_acc = dv_acc + (jnp.concatenate(dv_parts, axis=1) if n_local > 1 else dv_parts[0])
    # The accumulators travel with their K/V block; after the last step this permute returns them to their owner.
    dk_acc, dv_acc = ring_pass((dk_acc, dv_acc), cp)
    if step < cp.size - 1:
      k_cur, v_cur = k_next, v_next
  return dqs, dk_acc, dv_acc, grads


def _block_backward(config, qc, kc, vc, oc, lc, doc, dlc, qid, kid, chunk, q_seqlens, kv_seqlens, alibi, dropout,
                    captures):
  qo, ko = qid * chunk, kid * chunk
  dropout = block_dropout(config, dropout, qo, ko)

  def run(kind):
    blk = geometry(config, kind, qo, ko, chunk, chunk, q_seqlens, kv_seqlens, alibi)
    dq, dk, dv, grads = block_backward(config, kind, qc, kc, vc, oc, lc, doc, dlc, blk, alibi, dropout, captures)
    return tuple(g.astype(jnp.float32) for g in (dq, dk, dv)), grads

  def skip():
    zeros = tuple(jnp.zeros(x.shape, jnp.float32) for x in (qc, kc, vc))
    return zeros, tuple(jnp.zeros(captures[i].shape, jnp.float32) for i in config.capture_gradients)

  index = _ring_kind(config, qid, kid)
  if index is None:
    return run("full")
  return lax.switch(index, [skip, lambda: run("full"), lambda: run("causal")])
