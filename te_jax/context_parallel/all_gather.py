"""The all_gather strategy: gather K and V over the axis (tiled all-gather) and compute the local query rows against
the whole sequence; the backward re-gathers K/V and reduce-scatters dK/dV (float32) back to their owners."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from te_jax.context_parallel.blocks import add_gradients, block_backward, block_dropout, block_forward, geometry
from te_jax.context_parallel.chunks import to_device_order, to_natural
from te_jax.context_parallel.layout import ContextParallel


def gather(block, cp: ContextParallel):
  """Every array of `block` over the whole sequence, in device order (tiled all-gather)."""
  return jax.tree.map(lambda x: lax.all_gather(x, cp.axis, axis=1, tiled=True), block)


def _gather_natural(x, cp: ContextParallel):
  """The whole sequence of a local shard [B, S/N, ...], in natural order (all-gather over the axis)."""
  return to_natural(gather(x, cp), cp)


def forward(q_chunks, q_ids, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp, chunk):
  """[out], [lse] of each local query chunk (natural chunk q_ids[t], of `chunk` rows) against the whole sequence."""
  k_all, v_all = _gather_natural(k, cp), _gather_natural(v, cp)
  kind = "causal" if config.mask_type.is_causal else "full"
  outs, lses = [], []
  for qc, qid in zip(q_chunks, q_ids):
    blk = geometry(config, kind, qid * chunk, 0, chunk, k_all.shape[1], q_seqlens, kv_seqlens, alibi)
    out, lse = block_forward(config, kind, qc, k_all, v_all, blk, alibi,
                             block_dropout(config, dropout, qid * chunk, 0), captures)
    outs.append(out)
    lses.append(lse)
  return outs, lses


def backward(per_q, k, v, q_seqlens, kv_seqlens, alibi, dropout, captures, config, cp, chunk):
  """[dq] of each local query chunk, this shard's dk, dv (float32) and its terms of the capture gradients. per_q: (q,
  out, lse, dout, dlse, chunk id) of each local query chunk."""
  k_all, v_all = _gather_natural(k, cp), _gather_natural(v, cp)
  kind = "causal" if config.mask_type.is_causal else "full"
  dqs, dk_all, dv_all, grads = [], None, None, None
  for qc, oc, lc, doc, dlc, qid in per_q:
    blk = geometry(config, kind, qid * chunk, 0, chunk, k_all.shape[1], q_seqlens, kv_seqlens, alibi)
    dq_c, dk_c, dv_c, grads_c = block_backward(config, kind, qc, k_all, v_all, oc, lc, doc, dlc, blk, alibi,
                                               block_dropout(config, dropout, qid * chunk, 0), captures)
    grads = add_gradients(grads, grads_c)
    dqs.append(dq_c)
    dk_all = dk_c.astype(jnp.float32) if dk_all is None else dk_all + dk_c
    dv_all = dv_c.astype(jnp.float32) if dv_all is None else dv_all + dv_c
  dk = lax.psum_scatter(to_device_order(dk_all, cp), cp.axis, scatter_dimension=1, tiled=True)
  dv = lax.psum_scatter(to_device_order(dv_all, cp), cp.axis, scatter_dimension=1, tiled=True)
  return dqs, dk, dv, grads
