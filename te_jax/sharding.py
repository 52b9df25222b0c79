"""SPMD partitioning of fused_attn: custom_partitioning rules for the forward and backward primitives.

te_jax.attention binds the two primitives defined here (sharded_forward_p, sharded_backward_p). They have the same
operands and results as te_jax._primitives' attention_forward_p / attention_backward_p (the kernels), plus a static
`cp` parameter (a te_jax.context_parallel.ContextParallel or None). Their lowering wraps the kernel primitives in a
jax.experimental.custom_partitioning with a Shardy sharding rule, so under jit on a mesh:

  * batch sharding (data parallel / FSDP) and head sharding (tensor parallel) stay local: every device runs the kernel
    on its own batch and head slice, with no collective. GQA/MQA k/v heads shard with their group of query heads; if
    the query heads of one group are split over devices (more head shards than k/v heads), k/v are replicated over the
    extra axes and dK/dV are summed over them (an all-reduce in the backward only).
  * with context parallelism, the sequence dimension is sharded over the context-parallel axis and each device runs
    te_jax.context_parallel.local_forward/local_backward (all-gather or ring).
  * anything else (a sharded head dim D/Dv, a sequence sharded without context_parallel_axis, k/v sharded
    differently from q, sizes that do not divide) is resharded by XLA to the layout above, with a ReshardWarning that
    names the array, the axes and the bytes that move.

Inside shard_map (the context-parallel axis manual), the lowering runs the per-shard context-parallel code directly.
The vmap rule folds mapped axes into the batch dimension, as for the kernel primitives.
"""

from __future__ import annotations

import math
import re
import warnings
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax._src import sharding_impls
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from te_jax import _primitives
from te_jax import context_parallel as cpmod
from te_jax.attention_config import AttentionConfig
from te_jax.fp8 import is_fp8


class ReshardWarning(UserWarning):
  """fused_attn's operands arrive with a sharding the kernel cannot use in place; XLA moves data to fix it."""


sharded_forward_p = Primitive("te_jax_sharded_attention_forward")
sharded_forward_p.multiple_results = True
sharded_backward_p = Primitive("te_jax_sharded_attention_backward")
sharded_backward_p.multiple_results = True


def _refuse_second_derivative(primals, tangents, **params):
  raise NotImplementedError("te_jax computes first derivatives only: its attention backward cannot be differentiated "
                            "again (jax.grad of a gradient, jax.hessian); jax.jacrev of fused_attn works")


ad.primitive_jvps[sharded_backward_p] = _refuse_second_derivative


# The operands after q, k, v (and the backward's out, lse, dout, dlse), in both directions.
_OPTIONS = ("q_seqlens", "kv_seqlens", "alibi", "sinks", "q_ids", "kv_ids", "q_pos", "kv_pos", "page_table",
            "kv_descale", "bias", "dropout")
# An absent option is a one-element placeholder (te_jax/_primitives.py): its size-1 dims, like a bias's broadcast dims,
# are whole on every device.
# `alibi` and `sinks` [B, H] shard with the batch and the heads.
# `tokens`: q_segment_ids, kv_segment_ids, q_positions, kv_positions (te_jax/_primitives.py). They shard like the
# sequence they belong to: with their batch, and over the context-parallel axis with it (where they are placeholders).
# `bias` [B or 1, H or 1, Sq or 1, Skv or 1] shards with the batch and the heads along the dims where it is full; its
# gradient is summed over the shards of the dims where it broadcasts (context parallelism refuses a bias).
# `dropout` (key and offsets, te_jax/_primitives.py) is replicated; each batch or head shard adds its global offsets, so
# a sharded call drops exactly what the unsharded call drops, and its mods see global batch and head indices (context
# parallelism then adds each block's sequence offsets, te_jax/context_parallel/blocks.py).
# `page_table` [B, max_pages_per_seq] shards with the batch; a paged call's k and v pools [num_pages, page_size, Hkv, D]
# hold pages of every sequence, so they are replicated over the batch axes and sharded over the kv heads like
# contiguous k and v (context parallelism refuses paging).
# `kv_descale` [2, blocks, heads] (an FP8 KV cache's) shards its blocks with the batch when they are a contiguous call's
# batch entries (a paged call's pages are replicated, as the pools), and its heads like k and v's heads.
# `captures`: the arrays score_mod / mask_mod capture (te_jax/_primitives.py), the last operands (one pytree argument of
# the custom_partitioning), are replicated: a mod may read any entry. The backward's capture gradients are each
# device's partial sums, summed over the batch and head shards.
def forward(config: AttentionConfig, cp, q, k, v, q_seqlens, kv_seqlens, alibi, sinks, tokens, page_table, kv_descale,
            bias, dropout, captures=()):
  return tuple(sharded_forward_p.bind(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, page_table, kv_descale,
                                      bias, dropout, *captures, config=config, cp=cp))


def backward(config: AttentionConfig, cp, q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, tokens,
             page_table, kv_descale, bias, dropout, captures=()):
  return tuple(sharded_backward_p.bind(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, *tokens,
                                       page_table, kv_descale, bias, dropout, *captures, config=config, cp=cp))


# --------------------------------------------------------------------------------------------------------------------
# Sharding plan: which mesh axes shard batch, heads and (with context parallelism) the sequence.

def _spec_dims(sharding, ndim: int) -> list[tuple[str, ...]]:
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return [() if s is None else ((s,) if isinstance(s, str) else tuple(s)) for s in spec]


def _size(mesh, axes) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _nbytes(shape, dtype) -> int:
  return math.prod(shape) * np.dtype(dtype).itemsize


class _Plan:
  """Target layout of one call: mesh axes of the batch, query heads, k/v heads, sequence; axes to sum dK/dV over."""

  def __init__(self, config, cp, mesh, arg_shapes, emit_warnings: bool):
    *arg_shapes, captures = arg_shapes
    self.num_captures, self.num_capture_gradients = len(captures), len(config.capture_gradients)
    q, k, v = arg_shapes[:3]
    self.option_shapes = dict(zip(_OPTIONS, (a.shape for a in arg_shapes[-len(_OPTIONS):])))
    self.mesh = mesh
    self.notes: list[str] = []
    batch, seqlen_q, num_heads, _ = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qd = _spec_dims(q.sharding, 4)
    kd, vd = _spec_dims(k.sharding, 4), _spec_dims(v.sharding, 4)
    cp_axes = (cp.axis,) if cp is not None else ()
    # Batch: q's batch axes (k/v follow q). Drop axes that do not divide or that are the context-parallel axis.
    b_axes = tuple(a for a in qd[0] if a not in cp_axes)
    if batch % _size(mesh, b_axes):
      self.notes.append(f"the batch size {batch} is not divisible by the {_size(mesh, b_axes)} shards of mesh axes "
                        f"{b_axes}; the batch is gathered")
      b_axes = ()
    h_axes = tuple(a for a in qd[2] if a not in cp_axes and a not in b_axes)
    n_h = _size(mesh, h_axes)
    kv_axes, g_axes = h_axes, ()
    if num_heads % n_h:
      self.notes.append(f"the {num_heads} query heads are not divisible by the {n_h} shards of mesh axes {h_axes}; "
                        "the heads are gathered")
      h_axes, kv_axes = (), ()
    elif num_kv_heads % n_h:
      # Query heads of one k/v group are split over devices: k/v shard over the leading axes whose product is
      # num_kv_heads and are replicated over the rest (g_axes), where dK/dV are summed.
      prod, split = 1, None
      for i, a in enumerate(h_axes):
        if prod == num_kv_heads:
          split = i
          break
        prod *= mesh.shape[a]
      if split is not None and (num_heads // n_h) and group % (num_heads // n_h) == 0:
        kv_axes, g_axes = h_axes[:split], h_axes[split:]
      else:
        self.notes.append(f"the {n_h} head shards over mesh axes {h_axes} do not split the {num_kv_heads} k/v heads "
                          f"(groups of {group} query heads) into whole groups or whole shards of one group; the "
                          "heads are gathered")
        h_axes, kv_axes = (), ()
    self.b_axes, self.h_axes, self.kv_axes, self.g_axes = b_axes, h_axes, kv_axes, g_axes
    # Sequence: the context-parallel axis, or whole.
    self.s_axes = cp_axes
    if cp is not None and (mesh.shape.get(cp.axis) != cp.size):
      raise ValueError(f"context_parallel_axis {cp.axis!r} has size {mesh.shape.get(cp.axis)} in the mesh the call "
                       f"is partitioned on, but fused_attn was traced for size {cp.size}")
    self.paged = config.page_size > 0
    # FP8 attention (FP8 q, k, v on CUDA): the kv_descale operand's heads are the query heads (te_jax/fp8.py).
    self.fp8_attention = is_fp8(q.dtype)
    self.offsets = config.reads_offsets
    self.targets = {
        "q": (b_axes, self.s_axes, h_axes, ()),
        "kv": ((), (), kv_axes, ()) if self.paged else (b_axes, self.s_axes, kv_axes, ()),
    }
    if emit_warnings:
      for name, x, dims, target in (("q", q, qd, self.targets["q"]), ("k", k, kd, self.targets["kv"]),
                                    ("v", v, vd, self.targets["kv"])):
        self._note_reshard(name, x, dims, target, cp)
      for note in self.notes:
        warnings.warn(f"te_jax.fused_attn: {note}.", ReshardWarning, stacklevel=2)

  def _note_reshard(self, name, x, dims, target, cp):
    dim_names = ("page", "page-row", "head", "head-dim") if self.paged and name != "q" else (
        "batch", "sequence", "head", "head-dim")
    for dim, (have, want) in enumerate(zip(dims, target)):
      if have == tuple(want) or not have or set(have) <= set(want) and tuple(want[:len(have)]) == have:
        continue  # already right, or replicated / a prefix of the target (the partitioner slices locally: free)
      extra = [a for a in have if a not in want]
      n = _size(self.mesh, extra)
      moved = _nbytes(x.shape, x.dtype) * (n - 1) // (n * _size(self.mesh, [a for t in self.targets.get(
          "q" if name == "q" else "kv") for a in t]))
      hint = ""
      if dim == 1 and cp is None:
        hint = "; pass context_parallel_axis= to fused_attn to keep the sequence sharded"
      elif dim == 1:
        hint = f"; shard the sequence over the context-parallel axis {cp.axis!r} only"
      elif dim == 3:
        hint = "; shard the heads, not the head dim"
      self.notes.append(f"{name} {tuple(x.shape)} is sharded along its {dim_names[dim]} dimension over mesh axes "
                        f"{have}, but the kernel needs it {'sharded over ' + str(tuple(want)) if want else 'whole'} "
                        f"there: XLA reshards it first (about {moved} bytes gathered per device per call){hint}")

  def named(self, *dims):
    return NamedSharding(self.mesh, P(*[d if d else None for d in dims]))

  def forward_shardings(self):
    b, s, h = self.b_axes, self.s_axes, self.h_axes
    kvs = self.named(*self.targets["kv"])
    results = (self.named(b, s, h, ()), self.named(b, h, s))
    return (self.named(b, s, h, ()), kvs, kvs) + self.option_shardings() + (self.replicated(self.num_captures),), \
        results

  def backward_shardings(self):
    b, s, h = self.b_axes, self.s_axes, self.h_axes
    qs, kvs, lses = self.named(b, s, h, ()), self.named(*self.targets["kv"]), self.named(b, h, s)
    return ((qs, kvs, kvs, qs, lses, qs, lses) + self.option_shardings() + (self.replicated(self.num_captures),),
            (qs, kvs, kvs, self.optional("bias")) + self.replicated(self.num_capture_gradients))

  def replicated(self, n: int) -> tuple:
    """The captures' (or their gradients') shardings: whole on every device."""
    return (self.named(),) * n

  def capture_gradient_axes(self) -> tuple[str, ...]:
    """The mesh axes the capture gradients are summed over: every device adds the terms of its own batch and heads."""
    return self.b_axes + self.h_axes

  def optional(self, name):
    """An option's sharding: its dims sharded like the call's where full, whole where 1 (a placeholder's, a bias's
    broadcast dims). The tokens shard like their sequence, bias like the batch and heads (never its sequences)."""
    b, s, h = self.b_axes, self.s_axes, self.h_axes
    dims = {"q_seqlens": (b,), "kv_seqlens": (b,), "alibi": (b, h), "sinks": (b, h), "q_ids": (b, s),
            "kv_ids": (b, s), "q_pos": (b, s), "kv_pos": (b, s), "page_table": (b, ()),
            "kv_descale": ((), () if self.paged else b, h if self.fp8_attention else self.kv_axes),
            "bias": (b, h, (), ()), "dropout": ((),)}[name]
    return self.named(*(d if extent != 1 else () for d, extent in zip(dims, self.option_shapes[name])))

  def option_shardings(self):
    return tuple(self.optional(name) for name in _OPTIONS)

  def dbias_sum_axes(self) -> tuple[str, ...]:
    """The mesh axes each device's dbias holds a partial sum over: the batch and head shards of bias's size-1 dims."""
    batch, heads = self.option_shapes["bias"][:2]
    return (self.b_axes if batch == 1 else ()) + (self.h_axes if heads == 1 else ())

  def with_shard_offsets(self, q, dropout):
    """This device's dropout operand: the global batch and head of its first q entry added to the call's offsets.
    q is the local shard; the batch and heads are split into contiguous blocks, in the order of axis_index. Without
    dropout or mods the operand is a placeholder."""
    if not self.offsets:
      return dropout

    def first(axes, local_extent):
      return jax.lax.axis_index(axes).astype(jnp.uint32) * np.uint32(local_extent) if axes else jnp.uint32(0)
    shift = jnp.stack([jnp.uint32(0), jnp.uint32(0), first(self.b_axes, q.shape[0]), first(self.h_axes, q.shape[2]),
                       jnp.uint32(0), jnp.uint32(0)])
    return dropout + shift


def _mesh_ok(mesh, arg_shapes) -> bool:
  return (mesh is not None and not mesh.empty and
          all(isinstance(a.sharding, NamedSharding) for a in jax.tree.leaves(arg_shapes, is_leaf=_is_shape)))


def _is_shape(x):
  return hasattr(x, "sharding") and hasattr(x, "shape")


# --------------------------------------------------------------------------------------------------------------------
# custom_partitioning of the forward.

def _unpartitioned_forward(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, q_ids, kv_ids, q_pos, kv_pos, page_table,
                           kv_descale, bias, dropout, captures, config, cp):
  return cpmod.unpartitioned_forward(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, q_ids, kv_ids, q_pos, kv_pos,
                                     page_table, kv_descale, bias, dropout, *captures, config=config, cp=cp)


def _unpartitioned_backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, q_ids, kv_ids, q_pos,
                            kv_pos, page_table, kv_descale, bias, dropout, captures, config, cp):
  return cpmod.unpartitioned_backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, q_ids,
                                      kv_ids, q_pos, kv_pos, page_table, kv_descale, bias, dropout, *captures,
                                      config=config, cp=cp)


def _replicated_fallback(mesh, arg_shapes, result_shape, fn):
  """No usable mesh (e.g. a partially manual shard_map): keep the shardings XLA proposes for q and replicate."""
  arg_shardings = jax.tree.map(lambda a: a.sharding, arg_shapes, is_leaf=_is_shape)
  result_shardings = jax.tree.map(lambda a: a.sharding, result_shape, is_leaf=_is_shape)
  return mesh, fn, result_shardings, arg_shardings


def _partition_forward(config, cp, mesh, arg_shapes, result_shape):
  if not _mesh_ok(mesh, arg_shapes):
    if cp is not None:
      raise ValueError(f"te_jax.fused_attn: context_parallel_axis={cp.axis!r} needs a named mesh; call it under "
                       "`with jax.set_mesh(mesh)` (or `with mesh:`) with NamedSharding inputs, or inside shard_map")
    return _replicated_fallback(mesh, arg_shapes, result_shape,
                                partial(_unpartitioned_forward, config=config, cp=None))
  plan = _Plan(config, cp, mesh, arg_shapes, emit_warnings=True)
  args, results = plan.forward_shardings()
  def lower(q, *operands):
    *operands, dropout, captures = operands  # kv_descale and bias among the operands
    dropout = plan.with_shard_offsets(q, dropout)
    if cp is not None:
      return cpmod.local_forward(q, *operands, dropout, *captures, config=config, cp=cp)
    return tuple(_primitives.attention_forward_p.bind(q, *operands, dropout, *captures, config=config))

  return mesh, lower, results, args


def _partition_backward(config, cp, mesh, arg_shapes, result_shape):
  if not _mesh_ok(mesh, arg_shapes):
    if cp is not None:
      raise ValueError(f"te_jax.fused_attn: context_parallel_axis={cp.axis!r} needs a named mesh")
    return _replicated_fallback(mesh, arg_shapes, result_shape,
                                partial(_unpartitioned_backward, config=config, cp=None))
  plan = _Plan(config, cp, mesh, arg_shapes, emit_warnings=False)  # the forward already warned
  args, results = plan.backward_shardings()
  g_axes = plan.g_axes
  dbias_axes = plan.dbias_sum_axes() if config.has_bias else ()
  grad_axes = plan.capture_gradient_axes()

  def lower(q, k, v, *operands):
    *operands, dropout, captures = operands
    dropout = plan.with_shard_offsets(q, dropout)
    if cp is None:
      dq, dk, dv, dbias, *grads = _primitives.attention_backward_p.bind(q, k, v, *operands, dropout, *captures,
                                                                        config=config)
    else:  # its capture gradients already summed over the context-parallel axis
      dq, dk, dv, dbias, *grads = cpmod.local_backward(q, k, v, *operands, dropout, *captures, config=config, cp=cp)
    if grad_axes:  # each device's capture gradients hold its batch entries' and heads' terms
      grads = [jax.lax.psum(g, grad_axes) for g in grads]
    if g_axes:  # query heads of one k/v group live on several devices: sum their dK/dV contributions
      dk = jax.lax.psum(dk.astype(jnp.float32), g_axes).astype(k.dtype)
      dv = jax.lax.psum(dv.astype(jnp.float32), g_axes).astype(v.dtype)
    if dbias_axes:  # a bias broadcast over sharded batch entries or heads: sum the devices' partial gradients
      dbias = jax.lax.psum(dbias.astype(jnp.float32), dbias_axes).astype(dbias.dtype)
    return (dq, dk, dv, dbias, *grads)

  return mesh, lower, results, args


def _infer_forward(config, cp, mesh, arg_shapes, result_shape):
  """GSPMD (jax_use_shardy_partitioner=False) result shardings."""
  if not _mesh_ok(mesh, arg_shapes):
    return jax.tree.map(lambda a: a.sharding, arg_shapes[:1] * 2, is_leaf=_is_shape)
  return _Plan(config, cp, mesh, arg_shapes, emit_warnings=False).forward_shardings()[1]


def _infer_backward(config, cp, mesh, arg_shapes, result_shape):
  if not _mesh_ok(mesh, arg_shapes):
    captures = arg_shapes[-1]
    return jax.tree.map(lambda a: a.sharding, (*arg_shapes[:3], arg_shapes[-3],
                                               *(captures[i] for i in config.capture_gradients)), is_leaf=_is_shape)
  return _Plan(config, cp, mesh, arg_shapes, emit_warnings=False).backward_shardings()[1]


def _shapes(types):
  from jax._src.lib.mlir import ir
  return [tuple(ir.RankedTensorType(t).shape) for t in types]


def _heads_rule(value_types):
  q_shape, k_shape = _shapes(value_types[:2])
  group = q_shape[2] // k_shape[2]
  if group == 1:
    return "hk", {}
  if k_shape[2] == 1:  # MQA: Shardy refuses a size-1 factor in a compound; the query heads are their own factor
    return "h", {}
  return "(hk g)", {"g": group}


def _options_rule(value_types, h: str, s: str, skv: str, paged: bool) -> tuple[str, tuple[str, ...]]:
  """The options' factors (_OPTIONS): the call's own where a dim is full, a size-1 factor of its own where it is 1 (a
  placeholder's, a bias's broadcast dims; they need replication, listed second). kv_descale's blocks are a paged
  call's pages or a contiguous call's batch entries, its heads k's (q's with FP8 q: FP8 attention's descales)."""
  from jax._src.lib.mlir import ir
  descale_heads = h if str(ir.RankedTensorType(value_types[0]).element_type).startswith("f8") else "hk"
  dims = (("b",), ("b",), ("b", h), ("b", h), ("b", s), ("b", skv), ("b", s), ("b", skv), ("b", "pt"),
          ("kvd", "pages" if paged else "b", descale_heads), ("b", h, s, skv), ("rng",))
  operands, own = [], []
  for index, (names, shape) in enumerate(zip(dims, _shapes(value_types[-len(_OPTIONS):]))):
    factors = [name if extent != 1 else f"opt{index}x{axis}" for axis, (name, extent) in enumerate(zip(names, shape))]
    operands.append(" ".join(factors))
    own += [f for f, extent in zip(factors, shape) if extent == 1]
  return ", ".join(operands), tuple(own)


def _rule_factors(config, cp, value_types):
  """What both rules share: the heads factor, the two sequence factors, k's and v's leading factors (a paged call's
  pools have their own, replicated), the options' factors, each capture's (its own, replicated), and the rule's
  options (factor sizes, the factors that need replication)."""
  value_types, capture_types = value_types[:len(value_types) - config.num_captures], \
      value_types[len(value_types) - config.num_captures:]
  captures = [" ".join(f"cap{i}x{axis}" for axis in range(len(shape)))
              for i, shape in enumerate(_shapes(capture_types))]
  h, sizes = _heads_rule(value_types)
  # Under context parallelism q's and K/V's sequences are one factor, so that they shard in step over the axis. With
  # Sq != Skv (calls with positions or segment ids) the factor has two sizes, which Shardy allows (it takes the
  # smaller); both are multiples of the axis size (context_parallel.check_supported).
  s, skv = ("sq", "skv") if cp is None else ("s", "s")
  kv_rows = "pages psize" if config.page_size else f"b {skv}"
  options, own_factors = _options_rule(value_types, h, s, skv, config.page_size > 0)
  need = (("sq", "d", "skv", "dv") if cp is None else ("d", "dv")) + own_factors + \
      ("pt", "kvd", "rng", "pages", "psize") + \
      tuple(f for c in captures for f in c.split())
  return h, s, skv, kv_rows, options, captures, dict(need_replication_factors=tuple(dict.fromkeys(need)), **sizes)


def _with_ordered_replication(rule: str, options: dict):
  """Shardy wants the factors that need replication in the order they first appear in the rule (of those the call's
  operands have: a placeholder has no sequence or page factor)."""
  first = {}
  for i, name in enumerate(re.findall(r"\w+", rule)):
    first.setdefault(name, i)
  need = sorted((f for f in options["need_replication_factors"] if f in first), key=lambda f: first[f])
  return rule, dict(options, need_replication_factors=tuple(need))


def _forward_rule(config, cp, mesh, value_types, result_types):
  h, s, skv, kv, operands, captures, options = _rule_factors(config, cp, value_types)
  return _with_ordered_replication(
      f"b {s} {h} d, {kv} hk d, {kv} hk dv, {', '.join([operands] + captures)} -> b {s} {h} dv, b {h} {s}", options)


def _backward_rule(config, cp, mesh, value_types, result_types):
  h, s, skv, kv, operands, captures, options = _rule_factors(config, cp, value_types)
  bias = operands.split(", ")[-2]  # dbias has bias's factors, a capture gradient its capture's
  grads = [captures[i] for i in config.capture_gradients]
  return _with_ordered_replication(
      f"b {s} {h} d, {kv} hk d, {kv} hk dv, b {s} {h} dv, b {h} {s}, b {s} {h} dv, b {h} {s}, "
      f"{', '.join([operands] + captures)} -> b {s} {h} d, {kv} hk d, {kv} hk dv, {', '.join([bias] + grads)}", options)


# The captures, a tuple after the dropout operand, are one argument (a pytree: its arrays are the operands).
_FORWARD_OPERANDS, _BACKWARD_OPERANDS = 3 + len(_OPTIONS), 7 + len(_OPTIONS)
_partitioned_forward = custom_partitioning(_unpartitioned_forward,
                                           static_argnums=(_FORWARD_OPERANDS + 1, _FORWARD_OPERANDS + 2))
_partitioned_forward.def_partition(partition=_partition_forward, infer_sharding_from_operands=_infer_forward,
                                   sharding_rule=_forward_rule)
_partitioned_backward = custom_partitioning(_unpartitioned_backward,
                                            static_argnums=(_BACKWARD_OPERANDS + 1, _BACKWARD_OPERANDS + 2))
_partitioned_backward.def_partition(partition=_partition_backward, infer_sharding_from_operands=_infer_backward,
                                    sharding_rule=_backward_rule)


# --------------------------------------------------------------------------------------------------------------------
# The primitives.

def _cp_axis_is_manual(ctx, cp) -> bool:
  axis_context = ctx.module_context.axis_context
  return (cp is not None and isinstance(axis_context, sharding_impls.SPMDAxisContext) and
          cp.axis in axis_context.manual_axes)


def _forward_lowering(ctx, *args, config, cp):
  if _cp_axis_is_manual(ctx, cp):  # inside shard_map: the operands are already the local shards
    fn = partial(cpmod.local_forward, config=config, cp=cp)
  else:
    fn = lambda *a: _partitioned_forward(*a[:_FORWARD_OPERANDS], a[_FORWARD_OPERANDS:], config, cp)
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _backward_lowering(ctx, *args, config, cp):
  if _cp_axis_is_manual(ctx, cp):
    fn = partial(cpmod.local_backward, config=config, cp=cp)
  else:
    fn = lambda *a: _partitioned_backward(*a[:_BACKWARD_OPERANDS], a[_BACKWARD_OPERANDS:], config, cp)
  return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _with_manual_axes(outs, avals):
  """Inside shard_map, results vary over the manual axes the operands vary over (check_vma)."""
  carriers = [a for a in avals if getattr(a, "manual_axis_type", None) is not None
              and getattr(a.manual_axis_type, "varying", None)]
  if not carriers:
    return outs
  a = max(carriers, key=lambda a: len(a.manual_axis_type.varying))
  return [jax.core.ShapedArray(o.shape, o.dtype, sharding=NamedSharding(a.sharding.mesh, P()),
                               manual_axis_type=a.manual_axis_type) for o in outs]


def _forward_abstract_eval(*avals, config, cp):
  del cp
  return _with_manual_axes(_primitives.attention_forward_p.abstract_eval(*avals, config=config)[0], avals)


def _backward_abstract_eval(*avals, config, cp):
  del cp
  outs = _primitives.attention_backward_p.abstract_eval(*avals, config=config)[0]
  # The capture gradients are summed over the shards (local_backward, the partitioned lowering): they vary as their
  # captures do.
  _, captures = _primitives.split_captures(avals, config)
  grads = [captures[i].update(dtype=np.dtype(np.float32), weak_type=False) for i in config.capture_gradients]
  return [*_with_manual_axes(outs[:len(outs) - len(grads)], avals), *grads]


for _prim, _abstract, _lowering in ((sharded_forward_p, _forward_abstract_eval, _forward_lowering),
                                    (sharded_backward_p, _backward_abstract_eval, _backward_lowering)):
  _prim.def_impl(partial(dispatch.apply_primitive, _prim))
  dispatch.prim_requires_devices_during_lowering.add(_prim)  # the custom_partitioning lowering needs the devices
  _prim.def_abstract_eval(_abstract)
  batching.primitive_batchers[_prim] = partial(_primitives.batch_rule, _prim, returns_dbias=_prim is sharded_backward_p)
  mlir.register_lowering(_prim, _lowering)
