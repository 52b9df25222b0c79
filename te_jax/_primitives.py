"""The forward and backward attention primitives: abstract evaluation, lowering to either custom-call path, and the
batching rule. The public function (te_jax/attention.py) binds them; the VJP ties them together.

Operands, in the order the C++ handlers bind them (ffi/attention_signature.h, legacy/legacy_buffers.h):
  forward:  q, k, v, q_seqlens, kv_seqlens, alibi_slopes, sinks, *tokens, page_table, kv_descale, bias, dropout,
            *captures -> out, lse, workspace
  backward: q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi_slopes, sinks, *tokens, page_table,
            kv_descale, bias, dropout, *captures -> dq, dk, dv, dbias, workspace, *capture gradients
q_seqlens and kv_seqlens are int32 [B] with a padding mask (a paged call's q_seqlens a placeholder: its queries are the
last Sq tokens of every sequence). alibi_slopes is float32 [B, H] with config.has_alibi.
sinks is float32 [B, H]: with config.has_sinks the forward merges each head's sink logit into its rows (te_jax's
kernels in their epilogue, cpp/core/sink.h; after cuDNN's kernel this lowering, te_jax/sinks.py). The backward is given
that forward's out and lse, and reads nothing of it.
where tokens = q_segment_ids, kv_segment_ids, q_positions, kv_positions (int32 [B, Sq], [B, Skv], [B, Sq], [B, Skv])
with config.has_segment_ids / has_positions. page_table is int32 [B, max_pages_per_seq] when config.page_size > 0 (a
paged KV cache, forward only: k and v are then the pools [num_pages, page_size, Hkv, D(v)] and Skv, in the tokens'
shapes too, is the capacity max_pages_per_seq * page_size); the backward takes it too, for one operand list, and
refuses paging. kv_descale is float32 [2, blocks, heads] when k and v are an FP8 KV cache (q and out in another
dtype; the forward only: k's descales then v's, per block of keys, 1 or the pool's pages or the batch entries, and per
K/V head, 1 or Hkv; te_jax/fp8.py kv_descale_operand); the backward is given dequantized k and v. Each of these
operands is always passed, so lowering, batching and sharding handle one operand list:
absent (its flag off, and sinks always in the backward) it is a placeholder: its rank, every dim 1, that nothing reads
(see placeholder; the backends read each operand only under its flag, cpp/core/attention_params.h).
bias is [B or 1, H or 1, Sq or 1, Skv or 1] (float32, bfloat16 or float16; its size-1 dims broadcast), a float32
[1, 1, 1, 1] placeholder without config.has_bias (see no_bias); dbias has its shape and dtype. dropout is uint32 [6]:
the PRNG key's two words, then the global (b, h, i, j) of the call's element [0, 0, 0, 0] in the keep-mask of
te_jax/dropout.py (nonzero for a batch or head shard), which the mods' indices start from too; a placeholder where
neither reads it (config.reads_offsets). It is one per call: vmap never batches it.
captures are the arrays the call's score_mod and mask_mod capture (config.num_captures of them, the score_mod's
first; none without mods), passed as they are: the FFI handler takes them as its remaining operands, the legacy
handler after dropout (split_captures separates them). The backward returns, after the workspace, a float32 gradient
of each of the score_mod's floating-point captures (config.capture_gradients), unbatched under vmap.
Each custom call's last result, uint8 [backend.extension.workspace_bytes(params, direction)], is the engine's scratch
(0 bytes on the CPU): a result, so that XLA owns its memory on both paths. The primitives do not return it.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from te_jax._backends import backend_for
from te_jax.attention_config import AttentionConfig
from te_jax.custom_call_path import current_custom_call_path
from te_jax.engine import params_for_engine
from te_jax.fp8 import is_fp8, native_fp8_attention
from te_jax.sinks import apply_sinks

attention_forward_p = Primitive("te_jax_attention_forward")
attention_forward_p.multiple_results = True
attention_backward_p = Primitive("te_jax_attention_backward")
attention_backward_p.multiple_results = True


NUM_TOKEN_OPERANDS = 4
_SINKS = 6  # the sinks operand's index in the forward's operands


def placeholder(dtype, rank: int = 2):
  """An absent operand: its rank, every dim 1, one element that nothing reads. A literal constant: zeros of the full
  shape XLA would broadcast in a kernel per call."""
  return jnp.asarray(np.zeros((1,) * rank, dtype))


def no_lengths():
  """q_seqlens or kv_seqlens of a call without a padding mask: every row and key of every batch entry."""
  return placeholder(np.int32, rank=1)


def no_tokens():
  """The token operands of a call without segment ids and positions."""
  return (placeholder(np.int32),) * 4


def no_alibi():
  """The ALiBi slopes of a call without ALiBi."""
  return placeholder(np.float32)


def no_sinks():
  """The sinks operand of a call whose kernels merge no sinks."""
  return placeholder(np.float32)


def no_page_table():
  """The page table operand of a call whose k and v are contiguous."""
  return placeholder(np.int32)


def no_kv_descale():
  """The kv_descale operand of a call whose k and v are in q's dtype."""
  return placeholder(np.float32, rank=3)


def placeholder_operands(config: AttentionConfig, backward: bool) -> tuple[int, ...]:
  """Which of the operands before the bias are placeholders, as indices into q_seqlens, kv_seqlens, alibi_slopes,
  sinks, q_segment_ids, kv_segment_ids, q_positions, kv_positions, page_table."""
  absent = (not config.mask_type.is_padding or config.page_size > 0, not config.mask_type.is_padding,
            not config.has_alibi, backward or not config.has_sinks,
            *(not config.has_segment_ids,) * 2, *(not config.has_positions,) * 2, not config.page_size)
  return tuple(i for i, a in enumerate(absent) if a)


def no_bias():
  """The bias operand of a call without a bias: one float32 zero, broadcast everywhere, that the kernels do not read."""
  return placeholder(np.float32, rank=4)


def no_dropout():
  """The dropout operand of a call without dropout."""
  return placeholder(np.uint32, rank=1)


def dropout_operand(key_words):
  """The dropout operand of an unsharded call: the key's two words, offsets 0."""
  return jnp.concatenate([jnp.stack(key_words), jnp.zeros((4,), jnp.uint32)])


def offsets_operand():
  """The dropout operand of a call with mods and no dropout: offsets 0 (its key unread), which a shard's call adds its
  global batch and head to, as dropout's. Its unread key is [1, 0]: XLA makes a constant of one repeated value a
  broadcast, whose compile cost a fresh process's first call with a mod ~13 ms on the CPU."""
  return jnp.asarray(np.array([1, 0, 0, 0, 0, 0], np.uint32))


def split_captures(values, config: AttentionConfig):
  """(the operands before the captures, the captures): the mods' captures end the operand list."""
  values = list(values)
  split = len(values) - config.num_captures
  return values[:split], values[split:]


def _forward_abstract_eval(q, k, v, q_seqlens, kv_seqlens, alibi_slopes, *tokens_bias_dropout,
                           config: AttentionConfig):
  del k, q_seqlens, kv_seqlens, alibi_slopes, tokens_bias_dropout, config
  batch, seqlen_q, num_heads, _ = q.shape
  # FP8 q, k and v (the CUDA FP8 kernel's call, te_jax/fp8.py): out in bfloat16.
  out = jax.core.ShapedArray((batch, seqlen_q, num_heads, v.shape[3]), jnp.bfloat16 if is_fp8(q.dtype) else q.dtype)
  lse = jax.core.ShapedArray((batch, num_heads, seqlen_q), jnp.float32)
  return out, lse


def _backward_abstract_eval(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi_slopes, *tokens_bias_dropout,
                            config: AttentionConfig):
  del out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi_slopes
  others, captures = split_captures(tokens_bias_dropout, config)
  grads = tuple(jax.core.ShapedArray(captures[i].shape, jnp.float32) for i in config.capture_gradients)
  return tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v, others[-2])) + grads


def _lowering(ctx, *operands, config: AttentionConfig, direction: str, platform: str):
  backend = backend_for(platform)
  if direction == "backward":  # it is given the forward's out and lse, sinks merged
    config = dataclasses.replace(config, has_sinks=False)
  avals, capture_avals = split_captures(ctx.avals_in, config)
  q_aval, k_aval, v_aval = avals[:3]
  page_table_aval, kv_descale_aval, bias_aval = avals[-4:-1]
  params = config.core_params(q_aval.shape, k_aval.shape, v_aval.shape, q_aval.dtype, bias_shape=bias_aval.shape,
                              bias_dtype=bias_aval.dtype, page_table_shape=page_table_aval.shape,
                              kv_dtype=k_aval.dtype, kv_descale_shape=kv_descale_aval.shape)
  flex = config.flex_params(_mod_libraries(config, backend), [c.shape for c in capture_avals], direction)
  params.update(flex)
  # k and v FP8 as they are (an FP8 KV cache); FP8 attention proper passes the dequantized values in float32 with
  # config.fp8 (an FP8 KV cache's backward too, off a GPU: te_jax/fp8.py kv_cache_compute_dtype), or on CUDA, where
  # native_fp8_attention allows it, FP8 q, k and v as they are (q_format; te_jax/fp8.py fp8_native_operands).
  native = params["q_format"] != 0
  kv_cache = params["kv_format"] != 0 and not native
  if (config.fp8 and not kv_cache and not backend.serves_fp8) or (native and not native_fp8_attention()):
    raise ValueError(f"FP8 attention (FP8 q, k, v with descales, or fp8=) has no {platform} kernels in te_jax yet: "
                     "only its CPU backend serves it, the reference for those kernels; te_jax never runs an FP8 call "
                     "at another precision silently")
  # The core's own validation, so a configuration this backend refuses is a ValueError at jit time on either path.
  backend.extension.validate(params, backend.code, direction)
  if kv_cache and not backend.serves_fp8:
    _refuse_unread_kv_cache(backend, params, direction)
  choice = backend.choose_engine(params, direction, config)
  params = params_for_engine(params, choice.engine)
  merge_sinks_here = config.has_sinks and not params["has_sinks"]
  config = dataclasses.replace(config, has_sinks=params["has_sinks"])
  backend.ensure_registered()
  if backend.prepare is not None:
    backend.prepare(params, direction, choice.why)
  path = current_custom_call_path()
  target = backend.target_name(direction, path)
  if path == "ffi":
    lowering, attributes = jax.ffi.ffi_lowering(target), config.ffi_attributes(params["engine"], flex)
  else:
    descriptor = backend.extension.pack_descriptor(params)
    lowering = jax.ffi.ffi_lowering(target, api_version=backend.legacy_api_version, backend_config=descriptor)
    attributes = {}
  workspace = jax.core.ShapedArray((backend.extension.workspace_bytes(params, direction),), jnp.uint8)
  # The workspace follows the fixed results; the backward's capture gradients come after it.
  fixed = 2 if direction == "forward" else 4
  avals_out = [*ctx.avals_out[:fixed], workspace, *ctx.avals_out[fixed:]]
  results = lowering(ctx.replace(avals_out=avals_out), *operands, **attributes)
  results = [*results[:fixed], *results[fixed + 1:]]
  if merge_sinks_here:
    merge_ctx = ctx.replace(avals_in=[*ctx.avals_out, ctx.avals_in[_SINKS]])
    results = mlir.lower_fun(apply_sinks, multiple_results=True)(merge_ctx, *results, operands[_SINKS])
  return results


def _refuse_unread_kv_cache(backend, params: dict, direction: str) -> None:
  """A ValueError for an FP8 KV cache call the backend's kernels do not read (Backend.fp8_kv_refusal says why)."""
  refusal = (f"te_jax has no {backend.platform} kernels that read one" if backend.fp8_kv_refusal is None else
             backend.fp8_kv_refusal(params, direction))
  if refusal is not None:
    raise ValueError(f"this FP8 KV cache call has no {backend.platform} kernel: {refusal}. Dequantize the cache to "
                     "q's dtype first (te_jax.dequantize_fp8(k8, k_descale, q.dtype), and v's), or split the queries "
                     "into calls the kernels serve")


def _mod_libraries(config: AttentionConfig, backend) -> tuple[str, str]:
  """The paths of the libraries serving the call's score_mod and mask_mod ("" for none), compiled for the backend or
  found in its disk cache; a backend that serves no mods refuses the call."""
  if not config.has_mods:
    return "", ""
  if backend.flex_library is None:
    raise ValueError(f"score_mod/mask_mod have no {backend.platform} kernels in te_jax (the CPU and CUDA backends "
                     "serve them): run the call on one of those, or write it with fused_attn's built-in options "
                     "(mask_type, window_size, segment ids, bias, softcap, alibi_slopes)")
  return tuple(backend.flex_library(mod) if mod is not None else "" for mod in (config.score_mod, config.mask_mod))


def register_lowering(platform: str) -> None:
  """Registers both primitives' lowering for a platform (each backend module calls this once)."""
  for prim, direction in ((attention_forward_p, "forward"), (attention_backward_p, "backward")):
    mlir.register_lowering(prim, partial(_lowering, direction=direction, platform=platform), platform=platform)


def register_unavailable(platform: str, reason: str) -> None:
  """Lowering either primitive for the platform raises RuntimeError(reason): a clear error where JAX would only say
  that no lowering rule exists."""
  def refuse(ctx, *operands, **params):
    raise RuntimeError(reason)

  for prim in (attention_forward_p, attention_backward_p):
    mlir.register_lowering(prim, refuse, platform=platform)


def _fold_into_batch(args, dims, size, keep=()):
  """vmap: operands [B, ...] mapped over N -> [B * N, ...], batch-major, so a sharded batch stays sharded (folding
  the mapped axis in front would split the batch's shards, and XLA would all-gather them). The operands at the indices
  in `keep` are not batch-major and pass as they are."""
  folded = []
  for i, (x, d) in enumerate(zip(args, dims)):
    if i in keep:
      folded.append(x)
      continue
    x = jnp.broadcast_to(x[:, None], (x.shape[0], size) + x.shape[1:]) if d is None else jnp.moveaxis(x, d, 1)
    folded.append(x.reshape((x.shape[0] * size,) + x.shape[2:]))
  return folded


_POOLS = (1, 2)  # k and v: the page pools of a paged call


def _stack_pools(args, dims, size):
  """vmap of a paged call (`args` without the kv_descale and dropout operands): k and v are page pools, not batch-major,
  and the page table (second from the end, before the bias) indexes them. Pools every example shares stay one pool (the
  folded page table indexes it). Per-example pools are stacked, example-major, into one pool of N * num_pages pages, and
  example n's page ids move into its part: an id outside its own pool becomes -1, still outside the pool, so it stays an
  error instead of reading another example's pages."""
  if dims[1] is None and dims[2] is None:
    return args, dims
  stacked = lambda x, d: jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
  k, v, table = (stacked(args[i], dims[i]) for i in (1, 2, -2))
  num_pages = k.shape[1]
  first = (jnp.arange(size, dtype=jnp.int32) * num_pages)[:, None, None]
  table = jnp.where((table >= 0) & (table < num_pages), table + first, -1)
  args, dims = list(args), list(dims)
  args[1], args[2] = (x.reshape((size * num_pages,) + x.shape[2:]) for x in (k, v))
  args[-2], dims[-2] = table, 0
  dims[1] = dims[2] = None
  return args, dims


def _bias_with_full_batch(bias, bias_dim, batch: int):
  """bias with its per-example batch dim broadcast to `batch` when it is 1 (and the batch is not): folding the mapped
  axis into the batch makes B * N entries, which a size-1 dim of N entries would not broadcast to."""
  axis = 1 if bias_dim == 0 else 0
  if bias.shape[axis] == batch:
    return bias, False
  shape = list(bias.shape)
  shape[axis] = batch
  return jnp.broadcast_to(bias, shape), True


def _fold_kv_descale(kv_descale, dim, size: int, paged: bool, stacked: bool, blocks_per_example: int):
  """vmap: the kv_descale operand [2, blocks, heads] of the folded call. Its blocks are a paged call's pages (per-example
  pools of blocks_per_example pages are stacked example-major, _stack_pools) or a contiguous call's batch entries
  (blocks_per_example of them, folded batch-major, _fold_into_batch); one descale per tensor or head (blocks 1) stays
  as it is unless it is mapped."""
  blocks = kv_descale.shape[1 if dim is None else 2]
  if dim is None:
    if blocks == 1 or paged and not stacked:
      return kv_descale
    return jnp.tile(kv_descale, (1, size, 1)) if paged else jnp.repeat(kv_descale, size, axis=1)
  if paged and not stacked:
    raise ValueError("paged_attention under vmap: the FP8 descales are mapped but the page pools are not: a pool "
                     "every example shares has one set of descales")
  x = jnp.moveaxis(kv_descale, dim, 0)  # [N, 2, blocks, heads]
  x = jnp.broadcast_to(x, (size, 2, blocks_per_example, x.shape[3]))
  if paged:
    return jnp.moveaxis(x, 0, 1).reshape(2, size * blocks_per_example, x.shape[3])  # example n's pages after n - 1's
  return jnp.moveaxis(x, 0, 2).reshape(2, blocks_per_example * size, x.shape[3])  # entry b * N + n


def batch_rule(prim, args, dims, *, returns_dbias: bool, **params):
  """vmap rule for any te_jax primitive whose operands and results all have the batch axis first, the last four operands
  being the page table, kv_descale (_fold_kv_descale), the bias and the dropout operand and, with returns_dbias, the
  last result the bias's gradient. Placeholders (placeholder_operands; without a bias its placeholder and its zero
  gradient) stay as they are: unbatched, one element. The dropout operand stays one per call: example n of batch entry b
  becomes batch entry b * N + n of the folded call, so it gets that entry's part of the one key's mask. A paged call's
  pools are the exception to batch-major k and v (_stack_pools); its page table folds like q_seqlens. The mods' captures
  stay one per call too (a mapped capture is an error), and the mods see b // flex_batch_fold, each example's own b."""
  config = params["config"]
  (*args, dropout), captures = split_captures(args, config)
  (*dims, dropout_dim), capture_dims = split_captures(dims, config)
  batched_capture = next((i for i, d in enumerate(capture_dims) if d is not None), None)
  if batched_capture is not None:
    raise ValueError(f"fused_attn under vmap: score_mod/mask_mod capture {batched_capture} "
                     f"({captures[batched_capture].dtype}{list(captures[batched_capture].shape)}) is mapped by vmap, "
                     "and te_jax cannot batch captured arrays yet: capture arrays that are the same for every example "
                     "(the mods see the example's own b, h, q_idx, kv_idx), or call fused_attn per example")
  if dropout_dim is not None:
    raise ValueError("fused_attn under vmap: dropout_rng must be one key for the whole vmapped call (each example "
                     "gets its own part of its mask), not mapped")
  kv_descale, kv_descale_dim = args.pop(-2), dims.pop(-2)
  size = next(x.shape[d] for x, d in zip((*args, kv_descale), (*dims, kv_descale_dim)) if d is not None)
  paged = config.page_size > 0
  stacked = paged and (dims[1] is not None or dims[2] is not None)
  q, q_dim = args[0], dims[0]
  k, k_dim = args[1], dims[1]
  blocks = k.shape[1 if k_dim == 0 else 0] if paged else q.shape[1 if q_dim == 0 else 0]  # pages or batch entries
  kv_descale = _fold_kv_descale(kv_descale, kv_descale_dim, size, paged, stacked, blocks)
  if config.has_mods:  # the mods see each example's own batch index: b // flex_batch_fold of the folded batch
    config = dataclasses.replace(config, flex_batch_fold=config.flex_batch_fold * size)
    params = dict(params, config=config)
  lengths = 7 if returns_dbias else 3  # q_seqlens' index
  keep = tuple(lengths + i for i in placeholder_operands(config, backward=returns_dbias))
  if config.page_size:
    args, dims = _stack_pools(args, dims, size)
    keep += _POOLS
  has_bias = config.has_bias
  if has_bias:
    bias, expanded = _bias_with_full_batch(args[-1], dims[-1], q.shape[1 if q_dim == 0 else 0])
    operands = _fold_into_batch([*args[:-1], bias], dims, size, keep)
  else:
    operands = [*_fold_into_batch(args[:-1], dims[:-1], size, keep), args[-1]]
  outs = prim.bind(*operands[:-1], kv_descale, operands[-1], dropout, *captures, **params)
  # Batched: out and lse, or dq, dk, dv and a bias's gradient; not a placeholder's dbias nor the captures' gradients
  # (sums over every example).
  batched = 2 if not returns_dbias else 4 if has_bias else 3
  outs = [o.reshape((o.shape[0] // size, size) + o.shape[1:]) if i < batched else o for i, o in enumerate(outs)]
  if returns_dbias and has_bias and expanded:  # the bias was broadcast over the batch: its gradient sums over it
    outs[3] = outs[3].astype(jnp.float32).sum(axis=0, keepdims=True).astype(outs[3].dtype)
  return outs, [1 if i < batched else None for i in range(len(outs))]


for _prim, _abstract in ((attention_forward_p, _forward_abstract_eval),
                         (attention_backward_p, _backward_abstract_eval)):
  _prim.def_impl(partial(dispatch.apply_primitive, _prim))
  _prim.def_abstract_eval(_abstract)
  batching.primitive_batchers[_prim] = partial(batch_rule, _prim, returns_dbias=_prim is attention_backward_p)

register_lowering("cpu")
