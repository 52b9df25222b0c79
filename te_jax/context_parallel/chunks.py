"""The chunks of the sequence a shard holds. Without load balancing shard r holds natural chunk r of N; with it, chunks
r and 2N-1-r of 2N (te_jax/load_balancing.py), so a gathered sequence is in device order until it is permuted back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from te_jax.context_parallel.layout import ContextParallel
from te_jax.load_balancing import load_balanced_chunk_order


def chunk_ids(cp: ContextParallel, rank):
  """Natural chunk indices (of cp.size or 2*cp.size chunks) held by shard `rank` (traced), in local order."""
  if not cp.load_balanced:
    return [rank]
  return [rank, 2 * cp.size - 1 - rank]


def split(x, n, axis):
  return jnp.split(x, n, axis=axis) if n > 1 else [x]


def to_natural(x, cp: ContextParallel, axis=1):
  """A gathered array in device order -> natural sequence order (a static chunk permutation, no communication)."""
  if not cp.load_balanced:
    return x
  order = np.argsort(load_balanced_chunk_order(cp.size))
  chunks = split(x, 2 * cp.size, axis)
  return jnp.concatenate([chunks[i] for i in order], axis=axis)


def to_device_order(x, cp: ContextParallel, axis=1):
  if not cp.load_balanced:
    return x
  chunks = split(x, 2 * cp.size, axis)
  return jnp.concatenate([chunks[i] for i in load_balanced_chunk_order(cp.size)], axis=axis)
