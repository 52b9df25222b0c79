"""(query block, key block) pairs as kernel calls: the geometry of a pair of a call without segment ids or positions,
the dropout operand of any pair, and the result of a pair that is skipped.

The kernel has no position-offset operand, so a pair of a call without segment ids or positions is expressed with the
padding/bottom-right machinery of the core (docs/SHARDING.md derives it):

  For a query block whose first row sits at global position qo and a key block starting at ko, let, per batch b,
  delta_b = kv_seqlens[b] - q_seqlens[b] for bottom-right masks (else 0), D_b = qo - ko + delta_b,
  A_b = clip(q_seqlens[b] - qo, 0, Lq) (valid local rows) and C_b = clip(kv_seqlens[b] - ko, 0, Lk) (valid keys).
  * "full" blocks (non-causal masks, or a causal query block strictly after its key block): mask "padding" with
    local lengths (A_b, C_b).
  * "causal" blocks: mask "padding_causal_bottom_right" with local lengths (A_b, clip(A_b + D_b, 0, C_b)): the
    kernel's diagonal p_i = i + skv_l - sq_l = i + D_b is exactly the global one, and the window applies around it.
    Exact whenever A_b + D_b <= C_b, which holds for every case check_supported accepts.
  * ALiBi adds slope * (j - p_i); a kernel diagonal that differs from the true one by a per-row constant only shifts
    lse by slope * (D_kernel - D_b), which is corrected here (out is unchanged), and undone for the backward.

Dropout and mods: every block pair's kernel call, forward and backward, gets the dropout operand with the natural
positions of the block's first query row and first key added (block_dropout), so the kept elements are the unsharded
call's and the mods see global indices; the captures (score_mod / mask_mod's, a block mask's) go whole to every call,
and a backward call's capture gradients are its pair's terms, which the callers add up.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from te_jax import _primitives
from te_jax.attention_config import AttentionConfig
from te_jax.mask_type import MaskType


def _kernel_configs(config: AttentionConfig):
  full = dataclasses.replace(config, mask_type=MaskType.PADDING, window_left=-1, window_right=-1)
  causal = dataclasses.replace(config, mask_type=MaskType.PADDING_CAUSAL_BOTTOM_RIGHT)
  return full, causal


@dataclasses.dataclass(frozen=True)
class Block:
  """Local lengths and the diagonal correction of one (query block, key block) pair for one kernel config."""
  sq: jax.Array  # int32 [B]
  skv: jax.Array  # int32 [B]
  lse_shift: jax.Array | None  # f32 [B, H, 1]: lse_true - lse_kernel (ALiBi only)


def geometry(config, kind, qo, ko, lq, lk, q_seqlens, kv_seqlens, alibi) -> Block:
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
  return Block(sq.astype(jnp.int32), skv.astype(jnp.int32), shift)


def block_forward(config, kind, q, k, v, blk: Block, alibi, dropout, captures):
  full, causal = _kernel_configs(config)
  out, lse = _primitives.attention_forward_p.bind(q, k, v, blk.sq, blk.skv, alibi, *_no_block_options(), dropout,
                                                  *captures, config=full if kind == "full" else causal)
  if blk.lse_shift is not None:
    lse = lse + blk.lse_shift
  return out, lse


def block_backward(config, kind, q, k, v, out, lse, dout, dlse, blk: Block, alibi, dropout, captures):
  """dq, dk, dv and the capture gradients (float32, the pair's terms) of one pair."""
  full, causal = _kernel_configs(config)
  if blk.lse_shift is not None:
    lse = lse - blk.lse_shift
  dq, dk, dv, _, *grads = _primitives.attention_backward_p.bind(q, k, v, out, lse, dout, dlse, blk.sq, blk.skv, alibi,
                                                                *_no_block_options(), dropout, *captures,
                                                                config=full if kind == "full" else causal)
  return dq, dk, dv, tuple(grads)


def _no_block_options():
  """The sinks, tokens, page table, kv_descale and bias of a block of a call without segment ids and positions:
  placeholders. Sinks join once, after the blocks' merge (te_jax/attention.py); check_supported refuses paging and a
  bias, and a context-parallel FP8 call attends over dequantized values."""
  return (_primitives.no_sinks(), *_primitives.no_tokens(), _primitives.no_page_table(), _primitives.no_kv_descale(),
          _primitives.no_bias())


def block_dropout(config, dropout, qo, ko):
  """The dropout operand of one (query block, key block) pair: the shard's operand (key, batch and head offsets)
  with the global positions of the block's first query row (qo) and first key (ko) added, so that the block's kernel
  call drops exactly the elements the unsharded call drops (te_jax/dropout.py). Each block must be a contiguous range
  of global positions. Without dropout or mods the operand is the placeholder, unread."""
  if not config.reads_offsets:
    return dropout
  shift = jnp.stack([jnp.uint32(0), jnp.uint32(0), jnp.uint32(0), jnp.uint32(0), jnp.asarray(qo, jnp.uint32),
                     jnp.asarray(ko, jnp.uint32)])
  return dropout + shift


def add_gradients(total, grads):
  """Capture gradients summed over pairs (None before the first)."""
  return grads if total is None else tuple(t + g for t, g in zip(total, grads))


def empty_state(q, v, dtype):
  """The (out, lse) of attention over no key: the neutral element of merge_partial."""
  return (jnp.zeros(q.shape[:3] + (v.shape[3],), dtype), jnp.full((q.shape[0], q.shape[2], q.shape[1]), -jnp.inf,
                                                                   jnp.float32))
