"""Block masks (FlexAttention's): which blocks of (query, key) pairs a mask_mod hides wholly, keeps wholly, or cuts,
computed once and reused across layers and calls, so the kernels skip the blocks it hides and call the mask_mod only
on the blocks it cuts (docs/flex_attention.md)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from te_jax import _backends, _logging, flex
from te_jax.flex.mask_blocks import mask_blocks

logger = _logging.logger.getChild("flex")

# A block's state in BlockMask.blocks.
HIDDEN, PARTIAL, VISIBLE = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
  """blocks: int8 [B or 1, H or 1, ceil(Sq / block_q), ceil(Skv / block_kv)], per block of queries and keys
  HIDDEN (0: the mask_mod hides every pair), PARTIAL (1) or VISIBLE (2: it keeps every pair); a size-1 batch or head
  dim serves every batch entry or head. mask_mod is the function it was made from, which a call with the block mask
  applies on its PARTIAL blocks."""
  blocks: jax.Array
  mask_mod: object = dataclasses.field(metadata=dict(static=True))
  seqlen_q: int = dataclasses.field(metadata=dict(static=True))
  seqlen_kv: int = dataclasses.field(metadata=dict(static=True))
  block_q: int = dataclasses.field(metadata=dict(static=True))
  block_kv: int = dataclasses.field(metadata=dict(static=True))


def _positive(value, name: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


# The mask values create_block_mask evaluates in one step: a loop of one block row a step leaves a GPU waiting on each
# small step, one over every row at once holds B x H x Sq x Skv values.
MAP_STEP_EVALUATIONS = 1 << 22


def create_block_mask(mask_mod, B, H, Sq: int, Skv: int, *, block=128) -> BlockMask:
  """The BlockMask of mask_mod(b, h, q_idx, kv_idx) -> bool over B x H x Sq x Skv.

  Args:
    mask_mod: the mask_mod (te_jax.flex_attention's contract).
    B, H: the batch size and query heads, or None where the mask does not depend on b (h): one block row serves all.
    Sq, Skv: the query and key lengths.
    block: the block's queries and keys, an int or (block_q, block_kv); te_jax's kernels read any size, and skip more
      work with blocks that are multiples of their tiles (CPU: 64 queries x 128 keys).

  Evaluated on the default device a few block rows of queries at a time (lax.map, as many rows a step as hold about
  MAP_STEP_EVALUATIONS mask values, at least one), so it never holds more than that or B x H x block_q x Skv of them:
  under jit, inside the step that uses it, or once outside and passed in.
  """
  if not callable(mask_mod):
    raise TypeError(f"mask_mod must be a function mask_mod(b, h, q_idx, kv_idx) -> bool, got {type(mask_mod).__name__}")
  batch = 1 if B is None else _positive(B, "B")
  heads = 1 if H is None else _positive(H, "H")
  seqlen_q, seqlen_kv = _positive(Sq, "Sq"), _positive(Skv, "Skv")
  block_q, block_kv = (block, block) if not isinstance(block, (tuple, list)) else tuple(block)
  block_q, block_kv = _positive(block_q, "block_q"), _positive(block_kv, "block_kv")
  rows, cols = math.ceil(seqlen_q / block_q), math.ceil(seqlen_kv / block_kv)

  b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
  h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
  kv = jnp.arange(cols * block_kv, dtype=jnp.int32)[None, None, None, :]
  mod = jnp.vectorize(lambda b, h, q, kv: jnp.asarray(mask_mod(b, h, q, kv), bool))

  def block_row(row):
    q = (row * block_q + jnp.arange(block_q, dtype=jnp.int32))[None, None, :, None]
    inside = (q < seqlen_q) & (kv < seqlen_kv)
    keep = mod(b, h, jnp.minimum(q, seqlen_q - 1), jnp.minimum(kv, seqlen_kv - 1)) & inside
    keep = keep.reshape(batch, heads, block_q, cols, block_kv)
    inside = jnp.broadcast_to(inside, keep.shape[:3] + (cols * block_kv,)).reshape(keep.shape)
    some = keep.any(axis=(2, 4))
    every = (keep | ~inside).all(axis=(2, 4))
    return jnp.where(every, VISIBLE, jnp.where(some, PARTIAL, HIDDEN)).astype(jnp.int8)

  per_row = batch * heads * block_q * cols * block_kv
  blocks = jax.lax.map(block_row, jnp.arange(rows, dtype=jnp.int32),
                       batch_size=max(1, min(rows, MAP_STEP_EVALUATIONS // per_row)))  # [rows, batch, heads, cols]
  return BlockMask(jnp.transpose(blocks, (1, 2, 0, 3)), mask_mod, seqlen_q, seqlen_kv, block_q, block_kv)


# The block of a call's own block mask: the CPU kernels' tile (cpp/cpu/tile_shape.h: kTileQ queries, kTileKV keys), so
# that each tile is one block.
CALL_BLOCK = (64, 128)
# A call's own block mask costs B x H x Sq x Skv evaluations of the mask_mod in XLA (B or H 1 where the mask does not
# read b or h); above this many the call runs without one.
MAX_CALL_BLOCK_MASK_EVALUATIONS = 1 << 26


def _reads_b_and_h(mask_mod) -> tuple[bool, bool]:
  index = jax.ShapeDtypeStruct((), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda b, h, q, kv: mask_mod(b, h, q, kv))(index, index, index, index).jaxpr
  used = {v for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, core.Var)}
  used |= {v for v in jaxpr.outvars if isinstance(v, core.Var)}
  return jaxpr.invars[0] in used, jaxpr.invars[1] in used


def _host_blocks(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> np.ndarray | None:
  """The call's block states from the mask_mod's CPU library (te_jax/flex/mask_blocks.py), or None where XLA builds
  them: on another default backend (whose kernels evaluate their own Mask), or where a capture is a tracer of the
  enclosing jit (its values are known only when the program runs)."""
  if jax.default_backend() != "cpu":
    return None
  mod = flex.translate_mask_mod(mask_mod)
  if any(isinstance(c, jax.core.Tracer) for c in mod.captures):
    return None
  library = _backends.backend_for("cpu").flex_library(mod.spec())
  return mask_blocks(library, mod.captures, batch, heads, seqlen_q, seqlen_kv, *CALL_BLOCK)


def call_block_mask(mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_kv: int) -> BlockMask | None:
  """The block mask a call given a mask_mod and no block mask builds for itself (one block row for every batch entry
  or head where the mask does not read b or h), or None where that costs more than MAX_CALL_BLOCK_MASK_EVALUATIONS.
  On the CPU its blocks are computed once at trace time by the mask's own library where they can be (_host_blocks):
  a constant of the program instead of an XLA loop that costs ~150 ms to compile and runs in every call."""
  reads_b, reads_h = _reads_b_and_h(mask_mod)
  evaluations = (batch if reads_b else 1) * (heads if reads_h else 1) * seqlen_q * seqlen_kv
  if evaluations > MAX_CALL_BLOCK_MASK_EVALUATIONS:
    logger.debug("mask_mod without a block mask: %d evaluations would build one, more than %d; none built",
                 evaluations, MAX_CALL_BLOCK_MASK_EVALUATIONS)
    return None
  logger.debug("mask_mod without a block mask: building one in the call, %d evaluations", evaluations)
  blocks = _host_blocks(mask_mod, batch if reads_b else 1, heads if reads_h else 1, seqlen_q, seqlen_kv)
  if blocks is not None:
    return BlockMask(jnp.asarray(blocks), mask_mod, seqlen_q, seqlen_kv, *CALL_BLOCK)
  return create_block_mask(mask_mod, batch if reads_b else None, heads if reads_h else None, seqlen_q, seqlen_kv,
                           block=CALL_BLOCK)


def block_mask_operand(block_mask, mask_mod, batch: int, heads: int, seqlen_q: int, seqlen_kv: int):
  """(the mask_mod a call applies, the blocks operand or None, (block_q, block_kv) or None) of fused_attn's
  block_mask= and mask_mod=; a mask_mod without a block mask gets the call's own (call_block_mask)."""
  if block_mask is None and mask_mod is not None and callable(mask_mod):
    block_mask = call_block_mask(mask_mod, batch, heads, seqlen_q, seqlen_kv)
  if block_mask is None:
    return mask_mod, None, None
  if not isinstance(block_mask, BlockMask):
    raise TypeError(f"block_mask must be a te_jax.BlockMask (te_jax.create_block_mask) or None, got "
                    f"{type(block_mask).__name__}")
  if mask_mod is not None and mask_mod is not block_mask.mask_mod:
    raise ValueError("block_mask carries its own mask_mod: pass mask_mod=None (or the block mask's own mask_mod)")
  if (block_mask.seqlen_q, block_mask.seqlen_kv) != (seqlen_q, seqlen_kv):
    raise ValueError(f"block_mask was made for Sq, Skv = {block_mask.seqlen_q}, {block_mask.seqlen_kv}; this call "
                     f"has {seqlen_q}, {seqlen_kv}")
  b, h = block_mask.blocks.shape[:2]
  if b not in (1, batch) or h not in (1, heads):
    raise ValueError(f"block_mask's blocks have batch and head dims {b}, {h}; this call needs 1 or {batch}, and 1 or "
                     f"{heads}")
  return block_mask.mask_mod, block_mask.blocks, (block_mask.block_q, block_mask.block_kv)
