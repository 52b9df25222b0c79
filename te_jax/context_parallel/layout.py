"""The static context-parallel layout of a fused_attn call (ContextParallel), made from its context_parallel_*
arguments, and the checks of what context parallelism supports: at trace time (check_supported, check_lengths) and,
for traced lengths, in the computation (unsupported_lengths, poison)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.arguments import check_bool
from te_jax.attention_config import AttentionConfig

STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
  """The static context-parallel layout of one fused_attn call."""
  axis: str  # the mesh axis the sequence is sharded over
  strategy: str  # "all_gather" | "ring"
  load_balanced: bool  # inputs are in reorder_for_load_balancing order
  size: int  # the size of `axis` (number of sequence shards)
  manual: bool = False  # fused_attn was called inside shard_map with `axis` manual: it sees local shapes


def make(axis, strategy, load_balanced, operands=()) -> ContextParallel | None:
  """Checks fused_attn's context_parallel_* arguments; None when context parallelism is off. `operands` (q, k, v) may
  carry the mesh when none is in context."""
  check_bool(load_balanced, "context_parallel_load_balanced")
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


def _manual_axes() -> frozenset:
  mesh = jax.sharding.get_abstract_mesh()
  return frozenset() if mesh is None or mesh.empty else frozenset(getattr(mesh, "manual_axes", ()))


def uses_tokens(config: AttentionConfig) -> bool:
  """Whether the call has segment ids or positions, and so takes the packed path (te_jax/context_parallel/packed.py)."""
  return config.has_segment_ids or config.has_positions


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
    # Without positions a block pair's diagonal comes from chunk offsets of one shared length (blocks.py's geometry).
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


def poison(bad, *xs):
  """NaN in the batch entries marked bad (see unsupported_lengths)."""
  if bad is None:
    return xs
  return tuple(jnp.where(bad.reshape((-1,) + (1,) * (x.ndim - 1)), jnp.asarray(jnp.nan, x.dtype), x) for x in xs)


def check_axis_size(cp: ContextParallel):
  """Inside the per-shard code: the axis has the size fused_attn was traced for."""
  size = lax.axis_size(cp.axis)
  if size != cp.size:
    raise ValueError(f"context_parallel_axis {cp.axis!r} has size {size} here but fused_attn was traced for {cp.size}")
