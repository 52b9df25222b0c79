"""Causal load balancing for context parallelism.

With a causal mask, splitting the sequence into N contiguous shards gives the last shard N times the work of the first.
reorder_for_load_balancing cuts the sequence into 2N equal chunks and lays them out so that shard r (of N) holds chunks
r and 2N-1-r: every shard then has one early and one late chunk and the same causal work. Call it on q, k, v (and on
anything else laid out along the sequence, such as labels) before sharding the sequence over the context-parallel mesh
axis, pass context_parallel_load_balanced=True to fused_attn, and undo it on the output with
inverse_reorder_for_load_balancing. Both are cheap gathers of whole chunks along one axis.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def load_balanced_chunk_order(cp_size: int) -> np.ndarray:
  """The natural chunk index (of 2 * cp_size chunks) stored at each position of the reordered sequence."""
  if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
    raise ValueError(f"cp_size must be a positive int, got {cp_size!r}")
  return np.array([c for r in range(cp_size) for c in (r, 2 * cp_size - 1 - r)], np.int64)


def _check(x, cp_size: int, seq_axis: int) -> int:
  if not hasattr(x, "shape"):
    raise TypeError(f"expected an array, got {type(x).__name__}")
  axis = seq_axis % x.ndim if x.ndim else 0
  if x.ndim == 0 or not -x.ndim <= seq_axis < x.ndim:
    raise ValueError(f"seq_axis {seq_axis} is out of range for an array of rank {x.ndim}")
  load_balanced_chunk_order(cp_size)
  if x.shape[axis] % (2 * cp_size):
    raise ValueError(f"load balancing over {cp_size} context-parallel shards cuts the sequence into {2 * cp_size} "
                     f"equal chunks; the sequence length {x.shape[axis]} (axis {seq_axis}) is not a multiple of "
                     f"{2 * cp_size}")
  return axis


def _permute_chunks(x, order, axis: int):
  chunks = jnp.split(x, len(order), axis=axis)  # static slices: no index constant, so it traces anywhere
  return jnp.concatenate([chunks[i] for i in order], axis=axis)


def reorder_for_load_balancing(x, cp_size: int, seq_axis: int = 1):
  """Natural sequence order -> load-balanced order for cp_size context-parallel shards (see the module docstring)."""
  axis = _check(x, cp_size, seq_axis)
  return _permute_chunks(x, load_balanced_chunk_order(cp_size), axis)


def inverse_reorder_for_load_balancing(x, cp_size: int, seq_axis: int = 1):
  """Undoes reorder_for_load_balancing: load-balanced order -> natural sequence order."""
  axis = _check(x, cp_size, seq_axis)
  return _permute_chunks(x, np.argsort(load_balanced_chunk_order(cp_size)), axis)
