"""Calls with segment ids or positions, either strategy. Every token carries its position (the given one, or its global
index), so the kernel's causal mask, window and ALiBi compare kv_pos with q_pos and a (query block, key block) pair is
plain attention on the two blocks with their ids and positions (docs/SHARDING.md): no geometry, no natural order, no
skipping by chunk index (the kernel skips the key tiles no query of the block can see). K/V's ids and positions
travel with K/V; q's stay local.

q and K/V may differ in length (Sq != Skv: cross attention, decoding with q_positions = cache length + i): nothing
here assumes Sq == Skv. Each side is cut into chunks (and load-balanced) by its own length, and every chunk size, piece
start and global index is computed from the length of the side it belongs to (q's, or k's for K/V and their tokens).

Dropout's keep-mask and the mods are addressed by global (i, j), and a kernel call adds one offset per axis to its
local indices, so each call's query rows and keys must be contiguous ranges of the sequence. A load-balanced shard is
two chunks that are not (chunks r and 2N-1-r), so with dropout or mods this path cuts it into its chunks: two query
pieces per shard, two key pieces per ring block (all-gather puts the gathered K/V in natural order instead, one
piece), and merges the pieces by lse. Without them or without load balancing a shard is one piece. The mods' captures
go whole to every call; the capture gradients are summed over the calls and the sequence axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from te_jax import _primitives
from te_jax.context_parallel.all_gather import gather
from te_jax.context_parallel.blocks import add_gradients, block_dropout, empty_state
from te_jax.context_parallel.chunks import chunk_ids, split, to_device_order, to_natural
from te_jax.context_parallel.layout import ContextParallel, check_axis_size
from te_jax.context_parallel.ring import ring_pass
from te_jax.merge_states import merge_partial


def _global_indices(cp: ContextParallel, rank, batch: int, local_len: int):
  """int32 [B, local_len]: the natural sequence index of each token shard `rank` (traced) holds, in local order.
  local_len is the side's own local length (q's or K/V's), so its chunks are that side's."""
  chunks = chunk_ids(cp, rank)
  chunk = local_len // len(chunks)
  index = jnp.concatenate([c * chunk + jnp.arange(chunk, dtype=jnp.int32) for c in chunks])
  return jnp.broadcast_to(index, (batch, local_len))


def _token_sides(config, cp, tokens):
  """((q ids, q positions), (kv ids, kv positions)) of this shard; global indices where the call has no positions,
  so that causal masks, windows and ALiBi stay right across blocks; ids None where it has none (their placeholders
  are not per token: nothing to cut, gather or pass along the ring)."""
  q_ids, kv_ids, q_pos, kv_pos = tokens
  if not config.has_segment_ids:
    q_ids = kv_ids = None
  if not config.has_positions:
    rank = lax.axis_index(cp.axis)
    q_pos, kv_pos = _global_indices(cp, rank, *q_ids.shape), _global_indices(cp, rank, *kv_ids.shape)
  return (q_ids, q_pos), (kv_ids, kv_pos)


def _packed_config(config):
  return dataclasses.replace(config, has_positions=True)


def _packed_operands(alibi, q_side, kv_side, dropout):
  """The lengths (none: the whole blocks, ids and positions say the rest), alibi, tokens, page table, kv_descale, bias
  and dropout of one block."""
  ids = _primitives.no_tokens()[:2] if q_side[0] is None else (q_side[0], kv_side[0])
  return (_primitives.no_lengths(), _primitives.no_lengths(), alibi, _primitives.no_sinks(), *ids, q_side[1],
          kv_side[1], _primitives.no_page_table(), _primitives.no_kv_descale(), _primitives.no_bias(), dropout)


def _block_forward(config, q, alibi, q_side, k, v, kv_side, dropout, captures):
  return _primitives.attention_forward_p.bind(q, k, v, *_packed_operands(alibi, q_side, kv_side, dropout), *captures,
                                              config=_packed_config(config))


def _block_backward(config, q, out, lse, dout, dlse, alibi, q_side, k, v, kv_side, dropout, captures):
  dq, dk, dv, _, *grads = _primitives.attention_backward_p.bind(q, k, v, out, lse, dout, dlse,
                                                                *_packed_operands(alibi, q_side, kv_side, dropout),
                                                                *captures, config=_packed_config(config))
  return dq, dk, dv, tuple(grads)


def _pieces_per_shard(config, cp: ContextParallel) -> int:
  return 2 if config.reads_offsets and cp.load_balanced else 1


def _piece(x, i: int, n: int, axis: int = 1):
  return split(x, n, axis)[i]


def _piece_starts(cp: ContextParallel, rank, length: int, n: int):
  """The global position of the first token of each of the n pieces of shard `rank` (traced) of `length` tokens
  (meaningful when each piece is contiguous: always with n = 2, without load balancing with n = 1)."""
  chunks = chunk_ids(cp, rank)
  chunk = length // len(chunks)
  return [c * chunk for c in chunks[:n]]


def _merged(states):
  state = states[0]
  for other in states[1:]:
    state = merge_partial(*state, *other)
  return state


def _accumulate(total, x):
  return x if total is None else total.astype(jnp.float32) + x


def forward(q, k, v, alibi, tokens, dropout, captures, config, cp):
  """Local shards -> local out, lse. `tokens`: the shard's segment ids and positions (placeholders where absent)."""
  check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  q_side, kv_side = _token_sides(config, cp, tokens)
  n = _pieces_per_shard(config, cp)
  q_parts = [(_piece(q, i, n), jax.tree.map(lambda x: _piece(x, i, n), q_side), qo)  # noqa: B023
             for i, qo in enumerate(_piece_starts(cp, rank, q.shape[1], n))]

  def attend(block, kv_starts):
    """[(out, lse)] of each query piece against the K/V block, whose len(kv_starts) pieces start at kv_starts."""
    m = len(kv_starts)
    return [_merged([_block_forward(config, qp, alibi, qs, *jax.tree.map(lambda x: _piece(x, j, m), block),
                                    block_dropout(config, dropout, qo, ko), captures)  # noqa: B023
                     for j, ko in enumerate(kv_starts)])
            for qp, qs, qo in q_parts]

  if cp.strategy == "all_gather":
    # Device order is fine (the gathered ids and positions are in the same order) unless dropout needs one
    # contiguous block: then natural order, which it already is without load balancing.
    block = gather((k, v, kv_side), cp)
    if n > 1:
      block = jax.tree.map(lambda x: to_natural(x, cp), block)
    states = attend(block, [0])
  else:
    states = [empty_state(qp, v, jnp.float32) for qp, _, _ in q_parts]
    block = (k, v, kv_side)
    for step in range(cp.size):
      if step < cp.size - 1:  # issued first: the next block travels while this one computes
        next_block = ring_pass(block, cp)
      src = (rank - step) % cp.size
      states = [merge_partial(*state, *part)
                for state, part in zip(states, attend(block, _piece_starts(cp, src, k.shape[1], n)))]
      if step < cp.size - 1:
        block = next_block
  out, lse = (jnp.concatenate(xs, axis=axis) if n > 1 else xs[0] for xs, axis in zip(zip(*states), (1, 2)))
  return out.astype(q.dtype), lse


def backward(q, k, v, out, lse, dout, dlse, alibi, tokens, dropout, captures, config, cp):
  """Local shards -> local dq, dk, dv (each block with the final out and lse, and its forward's dropout operand) and
  this shard's terms of the capture gradients."""
  check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  q_side, kv_side = _token_sides(config, cp, tokens)
  n = _pieces_per_shard(config, cp)
  q_parts = [(tuple(_piece(x, i, n, axis) for x, axis in ((q, 1), (out, 1), (lse, 2), (dout, 1), (dlse, 2))),
              jax.tree.map(lambda x: _piece(x, i, n), q_side), qo)  # noqa: B023
             for i, qo in enumerate(_piece_starts(cp, rank, q.shape[1], n))]

  def grads(block, kv_starts):
    """([dq of each query piece], dk, dv of the K/V block, the capture gradients' terms) over the block's
    len(kv_starts) pieces."""
    m = len(kv_starts)
    kv_pieces = [jax.tree.map(lambda x: _piece(x, j, m), block) for j in range(m)]  # noqa: B023
    dqs, dks, dvs, capture_grads = [], [None] * m, [None] * m, None
    for (qp, op, lp, dop, dlp), qs, qo in q_parts:
      dq = None
      for j, ko in enumerate(kv_starts):
        dq_b, dk_b, dv_b, grads_b = _block_backward(config, qp, op, lp, dop, dlp, alibi, qs, *kv_pieces[j],
                                                    block_dropout(config, dropout, qo, ko), captures)
        dq, dks[j], dvs[j] = _accumulate(dq, dq_b), _accumulate(dks[j], dk_b), _accumulate(dvs[j], dv_b)
        capture_grads = add_gradients(capture_grads, grads_b)
      dqs.append(dq)
    return dqs, *(jnp.concatenate(xs, axis=1) if m > 1 else xs[0] for xs in (dks, dvs)), capture_grads

  if cp.strategy == "all_gather":
    block = gather((k, v, kv_side), cp)
    if n > 1:  # natural order (see forward); the gradients go back to device order before the scatter
      block = jax.tree.map(lambda x: to_natural(x, cp), block)
    dqs, dk_all, dv_all, capture_grads = grads(block, [0])
    if n > 1:
      dk_all, dv_all = to_device_order(dk_all, cp), to_device_order(dv_all, cp)
    dk, dv = (lax.psum_scatter(x.astype(jnp.float32), cp.axis, scatter_dimension=1, tiled=True)
              for x in (dk_all, dv_all))
  else:
    dqs = [jnp.zeros(qp.shape, jnp.float32) for (qp, *_), _, _ in q_parts]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    capture_grads = None
    block = (k, v, kv_side)
    for step in range(cp.size):
      if step < cp.size - 1:
        next_block = ring_pass(block, cp)
      src = (rank - step) % cp.size
      dqs_b, dk_b, dv_b, grads_b = grads(block, _piece_starts(cp, src, k.shape[1], n))
      dqs = [dq + dq_b for dq, dq_b in zip(dqs, dqs_b)]
      capture_grads = add_gradients(capture_grads, grads_b)
      # The accumulators travel with their K/V block; after the last step this permute returns them to their owner.
      dk, dv = ring_pass((dk + dk_b, dv + dv_b), cp)
      if step < cp.size - 1:
        block = next_block
  dq = jnp.concatenate(dqs, axis=1) if n > 1 else dqs[0]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), capture_grads
