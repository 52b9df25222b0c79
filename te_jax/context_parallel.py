"""Context (sequence) parallelism: the per-shard computation that runs on one device's slice of the sequence.

Each device holds a contiguous shard of q, k and v along the sequence (or, with load balancing, two chunks: see
te_jax/load_balancing.py). The kernel has no position-offset operand, so each (query block, key block) pair is
expressed with the padding/bottom-right machinery of the core (docs/SHARDING.md derives it):

  For a query block whose first row sits at global position qo and a key block starting at ko, let, per batch b,
  delta_b = kv_seqlens[b] - q_seqlens[b] for bottom-right masks (else 0), D_b = qo - ko + delta_b,
  A_b = clip(q_seqlens[b] - qo, 0, Lq) (valid local rows) and C_b = clip(kv_seqlens[b] - ko, 0, Lk) (valid keys).
  * "full" blocks (non-causal masks, or a causal query block strictly after its key block): mask "padding" with
    local lengths (A_b, C_b).
  * "causal" blocks: mask "padding_causal_bottom_right" with local lengths (A_b, clip(A_b + D_b, 0, C_b)): the
    kernel's diagonal p_i = i + skv_l - sq_l = i + D_b is exactly the global one, and the window applies around it.
    Exact whenever A_b + D_b <= C_b, which holds for every case accepted below.
  * ALiBi adds slope * (j - p_i); a kernel diagonal that differs from the true one by a per-row constant only shifts
    lse by slope * (D_kernel - D_b), which is corrected here (out is unchanged), and undone for the backward.

Strategies:
  all_gather: gather K and V over the axis (tiled all-gather), compute the local query rows against the whole
    sequence; the backward re-gathers K/V and reduce-scatters dK/dV (float32) back to their owners.
  ring: N steps; at step s a device computes its queries against the K/V block that started on device (r - s) mod N
    while the next block is already travelling (collective-permute); blocks entirely in the causal future are skipped
    (lax.switch), the partial results are merged by log-sum-exp in float32. The backward runs the same ring with the
    final out/lse (so the softmax is exact per block); dK/dV accumulators (float32) travel with their K/V block and
    one last permute returns them to their owners.

Calls with segment ids or positions (CPU backend) take a simpler path, at the end of this file: every token has a
position, so each block pair is plain attention on the blocks' ids and positions (docs/SHARDING.md). There q and K/V
may differ in length (Sq != Skv: cross attention, decoding with q_positions = cache length + i): each side is cut
into chunks (and load-balanced) by its own length.

Dropout: every block pair's kernel call gets the dropout operand with the natural positions of the block's first query
row and first key added (_block_dropout), forward and backward, so the kept elements are the unsharded call's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax import _primitives
from te_jax.attention_config import AttentionConfig
from te_jax.load_balancing import load_balanced_chunk_order
from te_jax.mask_type import MaskType
from te_jax.merge_states import merge_partial

STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """The static context-parallel layout of one fused_attn call."""
  axis: str  # the mesh axis the sequence is sharded over
  strategy: str  # "all_gather" | "ring"
  load_balanced: bool  # inputs are in reorder_for_load_balancing order
  size: int  # the size of `axis` (number of sequence shards)
  manual: bool = False  # fused_attn was called inside shard_map with `axis` manual: it sees local shapes


# --------------------------------------------------------------------------------------------------------------------
# Checks done once, at trace time, by fused_attn.

def check_supported(config: AttentionConfig, cp: ContextParallel, q_shape, k_shape) -> None:
  """Raises ValueError/NotImplementedError for what context parallelism does not support (docs/SHARDING.md)."""
  where = f"context parallelism over mesh axis {cp.axis!r} ({cp.strategy})"
  if config.has_bias:
    raise ValueError(f"{where}: bias is not supported with context parallelism yet; shard the batch or the heads "
                     "instead, or pass no bias")
  if config.page_size:  # first: a paged k is a page pool, its dim 1 no sequence
    raise ValueError(f"{where}: a paged KV cache (page_size {config.page_size}) is not supported with context "
                     "parallelism; shard the batch (the page table) or the kv heads instead")
  local = cp.size if cp.manual else 1  # inside shard_map the shapes are the local shards
  seqlen_q, seqlen_kv = q_shape[1] * local, k_shape[1] * local
  if seqlen_q != seqlen_kv and not uses_tokens(config):
    # Without positions a block pair's diagonal comes from chunk offsets of one shared length (the geometry below).
    raise NotImplementedError(
        f"{where} with Sq != Skv (Sq={seqlen_q}, Skv={seqlen_kv}) needs token positions: pass q_positions and "
        "kv_positions (e.g. te_jax.positions_from_lengths, or for decoding q_positions = cache length + i and "
        "kv_positions = j) with mask_type 'causal' or 'no_mask', or segment ids")
  # q and k/v are each cut into `chunks` equal chunks of their own length.
  chunks = cp.size * (2 if cp.load_balanced else 1)
  for name, length in (("Sq (q's sequence length)", seqlen_q), ("Skv (k's and v's sequence length)", seqlen_kv)):
    if length % chunks:
      raise ValueError(f"{where}: {name} = {length} must be a multiple of {chunks} (the axis size {cp.size}"
                       f"{' times 2 chunks per shard for load balancing' if cp.load_balanced else ''})")
  mask = config.mask_type
  # With segment ids or positions every block carries its tokens' positions, and windows need no shifted diagonal.
  has_window = (config.window_left >= 0 or config.window_right >= 0) and not uses_tokens(config)
  if has_window and not mask.is_causal:
    raise NotImplementedError(
        f"{where}: a sliding window needs a causal mask type (window_size={config.window_left, config.window_right}, "
        f"mask_type={mask.name.lower()!r}). A non-causal window around a shifted diagonal cannot be expressed with the "
        "core's padding/bottom-right masks; it needs a query-position-offset operand in the kernel.")
  if has_window and cp.strategy == "ring":
    raise NotImplementedError(
        f"{where}: sliding windows are supported with context_parallel_strategy='all_gather' only (a ring block "
        "that is both in the past and cut by the window cannot be expressed without a position-offset operand)")


def unsupported_lengths(config: AttentionConfig, cp: ContextParallel, q_seqlens, kv_seqlens):
  """bool [B]: batch entries whose (global) lengths this layout cannot compute exactly, or None if there are none.

  padding_causal (top-left) needs q_seqlens <= kv_seqlens; with the ring, padding_causal_bottom_right needs
  q_seqlens == kv_seqlens (it then equals padding_causal). fused_attn raises for concrete lengths; traced lengths
  that break the rule give NaN in out, lse and the gradients of those batch entries (never a silently wrong value).
  """
  mask = config.mask_type
  if not (mask.is_padding and mask.is_causal):
    return None
  if mask.is_bottom_right:
    return (q_seqlens != kv_seqlens) if cp.strategy == "ring" else None
  return q_seqlens > kv_seqlens


# --------------------------------------------------------------------------------------------------------------------
# One block.

def _kernel_configs(config: AttentionConfig):
  full = dataclasses.replace(config, mask_type=MaskType.PADDING, window_left=-1, window_right=-1)
  causal = dataclasses.replace(config, mask_type=MaskType.PADDING_CAUSAL_BOTTOM_RIGHT)
  return full, causal


@dataclasses.dataclass(frozen=True)
class _Block:
  """Local lengths and the diagonal correction of one (query block, key block) pair for one kernel config."""
  sq: jax.Array  # int32 [B]
  skv: jax.Array  # int32 [B]
  lse_shift: jax.Array | None  # f32 [B, H, 1]: lse_true - lse_kernel (ALiBi only)


def _geometry(config, kind, qo, ko, lq, lk, q_seqlens, kv_seqlens, alibi):
  delta = (kv_seqlens - q_seqlens) if config.mask_type.is_bottom_right else 0
  d = jnp.broadcast_to(qo - ko + delta, q_seqlens.shape)
  a = jnp.clip(q_seqlens - qo, 0, lq)
  c = jnp.clip(kv_seqlens - ko, 0, lk)
  if kind == "full":
    sq, skv, d_kernel = a, c, 0
  else:
    sq, skv = a, jnp.clip(a + d, 0, c)
    d_kernel = skv - sq
  shift = None
  if config.has_alibi:
    shift = (alibi * jnp.asarray(d_kernel - d, jnp.float32)[:, None])[..., None]
  return _Block(sq.astype(jnp.int32), skv.astype(jnp.int32), shift)


def _block_forward(config, kind, q, k, v, blk: _Block, alibi, dropout):
  full, causal = _kernel_configs(config)
  out, lse = _primitives.attention_forward_p.bind(q, k, v, blk.sq, blk.skv, alibi, *_no_block_options(), dropout,
                                                  config=full if kind == "full" else causal)
  if blk.lse_shift is not None:
    lse = lse + blk.lse_shift
  return out, lse


def _block_backward(config, kind, q, k, v, out, lse, dout, dlse, blk: _Block, alibi, dropout):
  full, causal = _kernel_configs(config)
  if blk.lse_shift is not None:
    lse = lse - blk.lse_shift
  dq, dk, dv, _ = _primitives.attention_backward_p.bind(q, k, v, out, lse, dout, dlse, blk.sq, blk.skv, alibi,
                                                        *_no_block_options(), dropout,
                                                        config=full if kind == "full" else causal)
  return dq, dk, dv


def _no_block_options():
  """The sinks, tokens, page table and bias of a block of a call without segment ids and positions: placeholders.
  Sinks join once, after the blocks' merge (te_jax/attention.py); check_supported refuses paging and a bias."""
  return (_primitives.no_sinks(), *_primitives.no_tokens(), _primitives.no_page_table(), _primitives.no_bias())


def _block_dropout(config, dropout, qo, ko):
  """The dropout operand of one (query block, key block) pair: the shard's operand (key, batch and head offsets)
  with the global positions of the block's first query row (qo) and first key (ko) added, so that the block's kernel
  call drops exactly the elements the unsharded call drops (te_jax/dropout.py). Each block must be a contiguous range
  of global positions. Without dropout the operand is the placeholder, unread."""
  if not config.dropout_threshold:
    return dropout
  shift = jnp.stack([jnp.uint32(0), jnp.uint32(0), jnp.uint32(0), jnp.uint32(0), jnp.asarray(qo, jnp.uint32),
                     jnp.asarray(ko, jnp.uint32)])
  return dropout + shift


# --------------------------------------------------------------------------------------------------------------------
# Layout helpers.

def _chunk_ids(cp: ContextParallel, rank):
  """Natural chunk indices (of cp.size or 2*cp.size chunks) held by shard `rank` (traced), in local order."""
  if not cp.load_balanced:
    return [rank]
  return [rank, 2 * cp.size - 1 - rank]


def _gather_natural(x, cp: ContextParallel):
  """The whole sequence of a local shard [B, S/N, ...], in natural order (all-gather over the axis)."""
  return _to_natural(lax.all_gather(x, cp.axis, axis=1, tiled=True), cp)


def _split(x, n, axis):
  return jnp.split(x, n, axis=axis) if n > 1 else [x]


def _to_natural(x, cp: ContextParallel, axis=1):
  """A gathered array in device order -> natural sequence order (a static chunk permutation, no communication)."""
  if not cp.load_balanced:
    return x
  order = np.argsort(load_balanced_chunk_order(cp.size))
  chunks = _split(x, 2 * cp.size, axis)
  return jnp.concatenate([chunks[i] for i in order], axis=axis)


def _to_device_order(x, cp: ContextParallel, axis=1):
  if not cp.load_balanced:
    return x
  chunks = _split(x, 2 * cp.size, axis)
  return jnp.concatenate([chunks[i] for i in load_balanced_chunk_order(cp.size)], axis=axis)


def _poison(bad, *xs):
  """NaN in the batch entries marked bad (see unsupported_lengths)."""
  if bad is None:
    return xs
  return tuple(jnp.where(bad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.asarray(jnp.nan, x.dtype), x) for x in xs)


def _global_lengths(config, cp, q, q_seqlens, kv_seqlens):
  """Without a padding mask fused_attn passes placeholders: the global lengths are the shards' times the axis size.
  Calls here have Sq == Skv (check_supported), so q's length serves both."""
  if config.mask_type.is_padding:
    return q_seqlens, kv_seqlens  # the caller's lengths are global sequence lengths
  full = jnp.full((q.shape[0],), q.shape[1] * cp.size, jnp.int32)
  return full, full


def _check_axis_size(cp: ContextParallel):
  size = lax.axis_size(cp.axis)
  if size != cp.size:
    raise ValueError(f"context_parallel_axis {cp.axis!r} has size {size} here but fused_attn was traced for {cp.size}")


# --------------------------------------------------------------------------------------------------------------------
# The per-shard forward and backward (they run inside shard_map or a custom_partitioning lowering).

def local_forward(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config: AttentionConfig,
                  cp: ContextParallel):
  """Local shards [B, S/N, ...] (global q_seqlens/kv_seqlens, alibi) -> local out, lse. `sinks` is a placeholder (the
  sinks join after the blocks' merge, te_jax/attention.py). `tokens`: the local segment ids and positions
  (placeholders when the call has none), then the page table and bias placeholders and the dropout operand (the key,
  with this shard's batch and head offsets; each block adds its sequence offsets)."""
  del sinks
  dropout = tokens[-1]
  if uses_tokens(config):
    return _packed_forward(q, k, v, alibi, tokens[:4], dropout, config, cp)
  q_seqlens, kv_seqlens = _global_lengths(config, cp, q, q_seqlens, kv_seqlens)
  _check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  n_local = 2 if cp.load_balanced else 1
  chunk = q.shape[1] // n_local
  q_chunks = _split(q, n_local, 1)
  q_ids = _chunk_ids(cp, rank)
  bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
  outs, lses = [], []
  if cp.strategy == "all_gather":
    k_all, v_all = _gather_natural(k, cp), _gather_natural(v, cp)
    kind = "causal" if config.mask_type.is_causal else "full"
    for qc, qid in zip(q_chunks, q_ids):
      blk = _geometry(config, kind, qid * chunk, 0, chunk, k_all.shape[1], q_seqlens, kv_seqlens, alibi)
      out, lse = _block_forward(config, kind, qc, k_all, v_all, blk, alibi, _block_dropout(config, dropout,
                                                                                            qid * chunk, 0))
      outs.append(out)
      lses.append(lse)
  else:
    outs, lses = _ring_forward(q_chunks, q_ids, k, v, q_seqlens, kv_seqlens, alibi, dropout, config, cp, rank,
                               chunk)
  out = jnp.concatenate(outs, axis=1) if n_local > 1 else outs[0]
  lse = jnp.concatenate(lses, axis=2) if n_local > 1 else lses[0]
  return _poison(bad, out.astype(q.dtype), lse)


def _ring_perm(cp):
  return [(i, (i + 1) % cp.size) for i in range(cp.size)]


def _ring_kind(config, qid, kid):
  """0: skip, 1: full, 2: causal (diagonal) for a ring block; q/k chunk ids are traced scalars."""
  if not config.mask_type.is_causal:
    return None
  return jnp.where(qid > kid, 1, jnp.where(qid == kid, 2, 0))


def _ring_forward(q_chunks, q_ids, k, v, q_seqlens, kv_seqlens, alibi, dropout, config, cp, rank, chunk):
  n_local = len(q_chunks)
  outs, lses = (list(state) for state in zip(*(_empty_state(qc, v, jnp.float32) for qc in q_chunks)))
  k_cur, v_cur = k, v
  for step in range(cp.size):
    if step < cp.size - 1:  # issued first: the next block travels while this one computes
      k_next = lax.ppermute(k_cur, cp.axis, _ring_perm(cp))
      v_next = lax.ppermute(v_cur, cp.axis, _ring_perm(cp))
    src = (rank - step) % cp.size
    for kc, vc, kid in zip(_split(k_cur, n_local, 1), _split(v_cur, n_local, 1), _chunk_ids(cp, src)):
      for t, (qc, qid) in enumerate(zip(q_chunks, q_ids)):
        out, lse = _ring_block_forward(config, qc, kc, vc, qid, kid, chunk, q_seqlens, kv_seqlens, alibi, dropout)
        outs[t], lses[t] = merge_partial(outs[t], lses[t], out, lse)
    if step < cp.size - 1:
      k_cur, v_cur = k_next, v_next
  return outs, lses


def _empty_state(q, v, dtype):
  """The (out, lse) of attention over no key: the neutral element of merge_partial."""
  return (jnp.zeros(q.shape[:3] + (v.shape[3],), dtype), jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf,
                                                                   jnp.float32))


def _ring_block_forward(config, qc, kc, vc, qid, kid, chunk, q_seqlens, kv_seqlens, alibi, dropout):
  qo, ko = qid * chunk, kid * chunk
  dropout = _block_dropout(config, dropout, qo, ko)

  def run(kind):
    blk = _geometry(config, kind, qo, ko, chunk, chunk, q_seqlens, kv_seqlens, alibi)
    return _block_forward(config, kind, qc, kc, vc, blk, alibi, dropout)

  def skip():
    return _empty_state(qc, vc, qc.dtype)

  index = _ring_kind(config, qid, kid)
  if index is None:
    return run("full")
  return lax.switch(index, [skip, lambda: run("full"), lambda: run("causal")])


def local_backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, *placeholders,
                   config: AttentionConfig, cp: ContextParallel):
  """Local shards -> local dq, dk, dv and the bias placeholder's zero gradient (each block uses the final out and lse,
  so its softmax is exact, and the same dropout operand as its forward, so its keep-mask is the forward's).
  `placeholders`: the tokens, page table, bias and dropout operands (see local_forward)."""
  del sinks
  no_dbias = jnp.zeros_like(placeholders[-2])
  dropout = placeholders[-1]
  if uses_tokens(config):
    return (*_packed_backward(q, k, v, out, lse, dout, dlse, alibi, placeholders[:4], dropout, config, cp),
            no_dbias)
  q_seqlens, kv_seqlens = _global_lengths(config, cp, q, q_seqlens, kv_seqlens)
  _check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  n_local = 2 if cp.load_balanced else 1
  chunk = q.shape[1] // n_local
  q_ids = _chunk_ids(cp, rank)
  per_q = list(zip(_split(q, n_local, 1), _split(out, n_local, 1), _split(lse, n_local, 2),
                   _split(dout, n_local, 1), _split(dlse, n_local, 2), q_ids))
  bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
  if cp.strategy == "all_gather":
    k_all, v_all = _gather_natural(k, cp), _gather_natural(v, cp)
    kind = "causal" if config.mask_type.is_causal else "full"
    dqs, dk_all, dv_all = [], None, None
    for qc, oc, lc, doc, dlc, qid in per_q:
      blk = _geometry(config, kind, qid * chunk, 0, chunk, k_all.shape[1], q_seqlens, kv_seqlens, alibi)
      dq_c, dk_c, dv_c = _block_backward(config, kind, qc, k_all, v_all, oc, lc, doc, dlc, blk, alibi,
                                         _block_dropout(config, dropout, qid * chunk, 0))
      dqs.append(dq_c)
      dk_all = dk_c.astype(jnp.float32) if dk_all is None else dk_all + dk_c
      dv_all = dv_c.astype(jnp.float32) if dv_all is None else dv_all + dv_c
    dk = lax.psum_scatter(_to_device_order(dk_all, cp), cp.axis, scatter_dimension=1, tiled=True)
    dv = lax.psum_scatter(_to_device_order(dv_all, cp), cp.axis, scatter_dimension=1, tiled=True)
  else:
    dqs, dk, dv = _ring_backward(per_q, k, v, q_seqlens, kv_seqlens, alibi, dropout, config, cp, rank, chunk)
  dq = jnp.concatenate(dqs, axis=1) if n_local > 1 else dqs[0]
  return (*_poison(bad, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)), no_dbias)


def _ring_backward(per_q, k, v, q_seqlens, kv_seqlens, alibi, dropout, config, cp, rank, chunk):
  n_local = len(per_q)
  dqs = [jnp.zeros(p[0].shape, jnp.float32) for p in per_q]
  k_cur, v_cur = k, v
  dk_acc, dv_acc = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  perm = _ring_perm(cp)
  for step in range(cp.size):
    if step < cp.size - 1:
      k_next = lax.ppermute(k_cur, cp.axis, perm)
      v_next = lax.ppermute(v_cur, cp.axis, perm)
    src = (rank - step) % cp.size
    dk_parts, dv_parts = [], []
    for kc, vc, kid in zip(_split(k_cur, n_local, 1), _split(v_cur, n_local, 1), _chunk_ids(cp, src)):
      dk_c = jnp.zeros(kc.shape, jnp.float32)
      dv_c = jnp.zeros(vc.shape, jnp.float32)
      for t, (qc, oc, lc, doc, dlc, qid) in enumerate(per_q):
        dq_b, dk_b, dv_b = _ring_block_backward(config, qc, kc, vc, oc, lc, doc, dlc, qid, kid, chunk, q_seqlens,
                                                kv_seqlens, alibi, dropout)
        dqs[t] = dqs[t] + dq_b
        dk_c, dv_c = dk_c + dk_b, dv_c + dv_b
      dk_parts.append(dk_c)
      dv_parts.append(dv_c)
    dk_acc = dk_acc + (jnp.concatenate(dk_parts, axis=1) if n_local > 1 else dk_parts[0])
    dv_acc = dv_acc + (jnp.concatenate(dv_parts, axis=1) if n_local > 1 else dv_parts[0])
    # The accumulators travel with their K/V block; after the last step this permute returns them to their owner.
    dk_acc = lax.ppermute(dk_acc, cp.axis, perm)
    dv_acc = lax.ppermute(dv_acc, cp.axis, perm)
    if step < cp.size - 1:
      k_cur, v_cur = k_next, v_next
  return dqs, dk_acc, dv_acc


def _ring_block_backward(config, qc, kc, vc, oc, lc, doc, dlc, qid, kid, chunk, q_seqlens, kv_seqlens, alibi,
                         dropout):
  qo, ko = qid * chunk, kid * chunk
  dropout = _block_dropout(config, dropout, qo, ko)

  def run(kind):
    blk = _geometry(config, kind, qo, ko, chunk, chunk, q_seqlens, kv_seqlens, alibi)
    grads = _block_backward(config, kind, qc, kc, vc, oc, lc, doc, dlc, blk, alibi, dropout)
    return tuple(g.astype(jnp.float32) for g in grads)

  def skip():
    return (jnp.zeros(qc.shape, jnp.float32), jnp.zeros(kc.shape, jnp.float32), jnp.zeros(vc.shape, jnp.float32))

  index = _ring_kind(config, qid, kid)
  if index is None:
    return run("full")
  return lax.switch(index, [skip, lambda: run("full"), lambda: run("causal")])


# --------------------------------------------------------------------------------------------------------------------
# Packed sequences: calls with segment ids or positions (CPU backend). Every token carries its position (the given
# one, or its global index), so the kernel's causal mask, window and ALiBi compare kv_pos with q_pos and a (query
# block, key block) pair is plain attention on the two blocks with their ids and positions: no geometry, no natural
# order, no skipping by chunk index (the kernel skips the key tiles no query of the block can see). K/V's ids and
# positions travel with K/V; q's stay local. Nothing here assumes Sq == Skv: every chunk size, piece start and global
# index is computed from the length of the side it belongs to (q's, or k's for K/V and their tokens).

def uses_tokens(config: AttentionConfig) -> bool:
  return config.has_segment_ids or config.has_positions


def _global_indices(cp: ContextParallel, rank, batch: int, local_len: int):
  """int32 [B, local_len]: the natural sequence index of each token shard `rank` (traced) holds, in local order.
  local_len is the side's own local length (q's or K/V's), so its chunks are that side's."""
  chunks = _chunk_ids(cp, rank)
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
  """The lengths (none: the whole blocks, ids and positions say the rest), alibi, tokens, page table, bias and
  dropout of one block."""
  ids = _primitives.no_tokens()[:2] if q_side[0] is None else (q_side[0], kv_side[0])
  return (_primitives.no_lengths(), _primitives.no_lengths(), alibi, _primitives.no_sinks(), *ids, q_side[1],
          kv_side[1], _primitives.no_page_table(), _primitives.no_bias(), dropout)


def _packed_block_forward(config, q, alibi, q_side, k, v, kv_side, dropout):
  return _primitives.attention_forward_p.bind(q, k, v, *_packed_operands(alibi, q_side, kv_side, dropout),
                                              config=_packed_config(config))


def _packed_block_backward(config, q, out, lse, dout, dlse, alibi, q_side, k, v, kv_side, dropout):
  dq, dk, dv, _ = _primitives.attention_backward_p.bind(q, k, v, out, lse, dout, dlse,
                                                        *_packed_operands(alibi, q_side, kv_side, dropout),
                                                        config=_packed_config(config))
  return dq, dk, dv


def _gather_block(block, cp: ContextParallel):
  """Every array of `block` over the whole sequence, in device order (tiled all-gather)."""
  return jax.tree.map(lambda x: lax.all_gather(x, cp.axis, axis=1, tiled=True), block)


def _ring_pass(block, cp: ContextParallel):
  """Sends every array of `block` one step along the ring."""
  return jax.tree.map(lambda x: lax.ppermute(x, cp.axis, _ring_perm(cp)), block)


# Dropout's keep-mask is addressed by global (i, j), and a kernel call adds one offset per axis to its local indices,
# so each call's query rows and keys must be contiguous ranges of the sequence. A load-balanced shard is two chunks
# that are not (chunks r and 2N-1-r), so with dropout the packed path cuts it into its chunks: two query pieces per
# shard, two key pieces per ring block (all-gather puts the gathered K/V in natural order instead, one piece), and
# merges the pieces by lse. Without dropout or load balancing a shard is one piece, as before.

def _pieces_per_shard(config, cp: ContextParallel) -> int:
  return 2 if config.dropout_threshold and cp.load_balanced else 1


def _piece(x, i: int, n: int, axis: int = 1):
  return _split(x, n, axis)[i]


def _piece_starts(cp: ContextParallel, rank, length: int, n: int):
  """The global position of the first token of each of the n pieces of shard `rank` (traced) of `length` tokens
  (meaningful when each piece is contiguous: always with n = 2, without load balancing with n = 1)."""
  chunks = _chunk_ids(cp, rank)
  chunk = length // len(chunks)
  return [c * chunk for c in chunks[:n]]


def _merged(states):
  state = states[0]
  for other in states[1:]:
    state = merge_partial(*state, *other)
  return state


def _accumulate(total, x):
  return x if total is None else total.astype(jnp.float32) + x


def _packed_forward(q, k, v, alibi, tokens, dropout, config, cp):
  _check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  q_side, kv_side = _token_sides(config, cp, tokens)
  n = _pieces_per_shard(config, cp)
  q_parts = [(_piece(q, i, n), jax.tree.map(lambda x: _piece(x, i, n), q_side), qo)  # noqa: B023
             for i, qo in enumerate(_piece_starts(cp, rank, q.shape[1], n))]

  def attend(block, kv_starts):
    """[(out, lse)] of each query piece against the K/V block, whose len(kv_starts) pieces start at kv_starts."""
    m = len(kv_starts)
    return [_merged([_packed_block_forward(config, qp, alibi, qs, *jax.tree.map(lambda x: _piece(x, j, m), block),
                                           _block_dropout(config, dropout, qo, ko))  # noqa: B023
                     for j, ko in enumerate(kv_starts)])
            for qp, qs, qo in q_parts]

  if cp.strategy == "all_gather":
    # Device order is fine (the gathered ids and positions are in the same order) unless dropout needs one
    # contiguous block: then natural order, which it already is without load balancing.
    block = _gather_block((k, v, kv_side), cp)
    if n > 1:
      block = jax.tree.map(lambda x: _to_natural(x, cp), block)
    states = attend(block, [0])
  else:
    states = [_empty_state(qp, v, jnp.float32) for qp, _, _ in q_parts]
    block = (k, v, kv_side)
    for step in range(cp.size):
      if step < cp.size - 1:  # issued first: the next block travels while this one computes
        next_block = _ring_pass(block, cp)
      src = (rank - step) % cp.size
      states = [merge_partial(*state, *part)
                for state, part in zip(states, attend(block, _piece_starts(cp, src, k.shape[1], n)))]
      if step < cp.size - 1:
        block = next_block
  out, lse = (jnp.concatenate(xs, axis=axis) if n > 1 else xs[0] for xs, axis in zip(zip(*states), (1, 2)))
  return out.astype(q.dtype), lse


def _packed_backward(q, k, v, out, lse, dout, dlse, alibi, tokens, dropout, config, cp):
  _check_axis_size(cp)
  rank = lax.axis_index(cp.axis)
  q_side, kv_side = _token_sides(config, cp, tokens)
  n = _pieces_per_shard(config, cp)
  q_parts = [(tuple(_piece(x, i, n, axis) for x, axis in ((q, 1), (out, 1), (lse, 2), (dout, 1), (dlse, 2))),
              jax.tree.map(lambda x: _piece(x, i, n), q_side), qo)  # noqa: B023
             for i, qo in enumerate(_piece_starts(cp, rank, q.shape[1], n))]

  def grads(block, kv_starts):
    """([dq of each query piece], dk, dv of the K/V block) over the block's len(kv_starts) pieces."""
    m = len(kv_starts)
    kv_pieces = [jax.tree.map(lambda x: _piece(x, j, m), block) for j in range(m)]  # noqa: B023
    dqs, dks, dvs = [], [None] * m, [None] * m
    for (qp, op, lp, dop, dlp), qs, qo in q_parts:
      dq = None
      for j, ko in enumerate(kv_starts):
        dq_b, dk_b, dv_b = _packed_block_backward(config, qp, op, lp, dop, dlp, alibi, qs, *kv_pieces[j],
                                                  _block_dropout(config, dropout, qo, ko))
        dq, dks[j], dvs[j] = _accumulate(dq, dq_b), _accumulate(dks[j], dk_b), _accumulate(dvs[j], dv_b)
      dqs.append(dq)
    return dqs, *(jnp.concatenate(xs, axis=1) if m > 1 else xs[0] for xs in (dks, dvs))

  if cp.strategy == "all_gather":
    block = _gather_block((k, v, kv_side), cp)
    if n > 1:  # natural order (see _packed_forward); the gradients go back to device order before the scatter
      block = jax.tree.map(lambda x: _to_natural(x, cp), block)
    dqs, dk_all, dv_all = grads(block, [0])
    if n > 1:
      dk_all, dv_all = _to_device_order(dk_all, cp), _to_device_order(dv_all, cp)
    dk, dv = (lax.psum_scatter(x.astype(jnp.float32), cp.axis, scatter_dimension=1, tiled=True)
              for x in (dk_all, dv_all))
  else:
    dqs = [jnp.zeros(qp.shape, jnp.float32) for (qp, *_), _, _ in q_parts]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    block = (k, v, kv_side)
    for step in range(cp.size):
      if step < cp.size - 1:
        next_block = _ring_pass(block, cp)
      src = (rank - step) % cp.size
      dqs_b, dk_b, dv_b = grads(block, _piece_starts(cp, src, k.shape[1], n))
      dqs = [dq + dq_b for dq, dq_b in zip(dqs, dqs_b)]
      # The accumulators travel with their K/V block; after the last step this permute returns them to their owner.
      dk, dv = _ring_pass((dk + dk_b, dv + dv_b), cp)
      if step < cp.size - 1:
        block = next_block
  dq = jnp.concatenate(dqs, axis=1) if n > 1 else dqs[0]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# --------------------------------------------------------------------------------------------------------------------
# The unpartitioned meaning (one device holds everything): undo the load-balancing order, attend, redo it.

def _tokens_in_natural_order(config, cp, operands):
  """The segment ids and positions (the first four of `operands`) come in the load-balanced order like q, k, v; the
  placeholders of absent ones have no order."""
  from te_jax.load_balancing import inverse_reorder_for_load_balancing as inv
  present = (config.has_segment_ids,) * 2 + (config.has_positions,) * 2
  return tuple(inv(x, cp.size, 1) if p else x for x, p in zip(operands[:4], present)) + tuple(operands[4:])


def unpartitioned_forward(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config, cp):
  from te_jax.load_balancing import inverse_reorder_for_load_balancing as inv, reorder_for_load_balancing as fwd
  if cp is not None and cp.load_balanced:
    q, k, v = (inv(x, cp.size, 1) for x in (q, k, v))
    tokens = _tokens_in_natural_order(config, cp, tokens)
  out, lse = _primitives.attention_forward_p.bind(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config=config)
  if cp is not None:
    bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
    if cp.load_balanced:
      out, lse = fwd(out, cp.size, 1), fwd(lse, cp.size, 2)
    out, lse = _poison(bad, out, lse)
  return out, lse


def unpartitioned_backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config, cp):
  from te_jax.load_balancing import inverse_reorder_for_load_balancing as inv, reorder_for_load_balancing as fwd
  if cp is not None and cp.load_balanced:
    q, k, v, out, dout = (inv(x, cp.size, 1) for x in (q, k, v, out, dout))
    lse, dlse = inv(lse, cp.size, 2), inv(dlse, cp.size, 2)
    tokens = _tokens_in_natural_order(config, cp, tokens)
  dq, dk, dv, dbias = _primitives.attention_backward_p.bind(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens,
                                                            alibi, sinks, *tokens, config=config)
  if cp is not None:
    bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
    if cp.load_balanced:
      dq, dk, dv = (fwd(x, cp.size, 1) for x in (dq, dk, dv))
    dq, dk, dv = _poison(bad, dq, dk, dv)
  return dq, dk, dv, dbias


# --------------------------------------------------------------------------------------------------------------------
# fused_attn's arguments -> ContextParallel.

def current_axis_size(axis: str, operands=()) -> int | None:
  """The size of mesh axis `axis` in the mesh in context (jax.set_mesh / shard_map / `with mesh:`), else in the mesh of
  an operand's NamedSharding (its type carries it, for a sharded array and for the tracer of one under jit), or None.
  The partitioner takes the mesh from the operands' shardings either way; only the axis size is needed here."""
  meshes = [jax.sharding.get_abstract_mesh(), _physical_mesh()]
  meshes += [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in operands]
  for mesh in meshes:
    if mesh is not None and not mesh.empty and axis in mesh.axis_names:
      return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis])
  return None


def _physical_mesh():
  from jax._src import mesh as mesh_lib
  return mesh_lib.thread_resources.env.physical_mesh


def make(axis, strategy, load_balanced, operands=()) -> ContextParallel | None:
  """Checks fused_attn's context_parallel_* arguments; None when context parallelism is off. `operands` (q, k, v) may
  carry the mesh when none is in context."""
  if not isinstance(load_balanced, (bool, np.bool_)):
    raise TypeError(f"context_parallel_load_balanced must be a bool, got {load_balanced!r}")
  if strategy not in STRATEGIES:
    raise ValueError(f"context_parallel_strategy must be one of {STRATEGIES}, got {strategy!r}")
  if axis is None:
    if load_balanced or strategy != "all_gather":
      raise ValueError("context_parallel_strategy / context_parallel_load_balanced need context_parallel_axis")
    return None
  if not isinstance(axis, str):
    raise TypeError(f"context_parallel_axis must be a mesh axis name (str) or None, got {axis!r}")
  size, manual = current_axis_size(axis, operands), axis in _manual_axes()
  if size is None:
    raise ValueError(f"context_parallel_axis {axis!r} is not an axis of the mesh in context nor of q, k or v's "
                     "sharding; pass arrays sharded with a NamedSharding over a mesh with that axis, call fused_attn "
                     "under `with jax.set_mesh(mesh):` (or `with mesh:`), or inside shard_map over such a mesh")
  return ContextParallel(axis=axis, strategy=strategy, load_balanced=bool(load_balanced), size=size, manual=manual)


def _manual_axes() -> frozenset:
  mesh = jax.sharding.get_abstract_mesh()
  return frozenset() if mesh is None or mesh.empty else frozenset(getattr(mesh, "manual_axes", ()))


def check_lengths(config: AttentionConfig, cp: ContextParallel, q_seqlens, kv_seqlens) -> None:
  """Raises for concrete lengths that unsupported_lengths() flags (traced ones give NaN in those batch entries)."""
  if isinstance(q_seqlens, jax.core.Tracer) or isinstance(kv_seqlens, jax.core.Tracer):
    return
  bad = unsupported_lengths(config, cp, np.asarray(q_seqlens), np.asarray(kv_seqlens))
  if bad is not None and bad.any():
    rule = ("q_seqlens <= kv_seqlens" if not config.mask_type.is_bottom_right else "q_seqlens == kv_seqlens")
    raise NotImplementedError(
        f"context parallelism ({cp.strategy}) with mask_type {config.mask_type.name.lower()!r} needs {rule} in every "
        f"batch entry; entries {np.flatnonzero(bad).tolist()} break it")
