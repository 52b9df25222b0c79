"""te_jax.flax: te_jax's fused attention as the `attention_fn` of Flax's MultiHeadAttention (Linen and NNX).

    from flax import nnx
    import te_jax.flax
    mha = nnx.MultiHeadAttention(num_heads=8, in_features=512, attention_fn=te_jax.flax.attention_fn, rngs=rngs)
    y = mha(x, is_causal=True)            # causal: NNX passes is_causal to the attention function

    from flax import linen as nn
    mha = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=te_jax.flax.make_attention_fn(mask_type="causal"))
    y = mha(x)                            # causal from the attention function; pass no mask

The functions follow the contract of flax's `dot_product_attention` (query, key, value, bias, mask,
broadcast_dropout, dropout_rng, dropout_rate, deterministic, dtype, precision, module; NNX's is_causal). They need
nothing from Flax, so this module imports no Flax: install Flax itself (`pip install "te_jax[flax]"`).

The module's `bias` and boolean `mask` become fused_attn's additive bias (te_jax.drop_in.attention_bias). Packed
documents: pass `mask=te_jax.flax.PackedSequences(segment_ids)` to the module (te_jax's segment ids). Attention dropout
while training needs broadcast_dropout=False (one mask per batch entry and head). What te_jax cannot serve is a
ValueError that says what to do instead, never a silent fallback: broadcast dropout, sowing the attention weights
(`module`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp

from te_jax.attention import fused_attn
from te_jax.drop_in import attention_bias
from te_jax.mask_type import MaskType

# fused_attn's options that make_attention_fn takes: its static keywords (and the ALiBi slopes, fixed per model); not
# per-batch data such as lengths (a Flax module passes none), nor return_lse (an attention_fn returns one array).
_OPTIONS = ("mask_type", "window_size", "scale", "softcap", "alibi_slopes", "deterministic", "engine",
            "context_parallel_axis", "context_parallel_strategy", "context_parallel_load_balanced", "fp8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedSequences:
  """Segment ids (and positions) of packed sequences, passed where a Flax module takes its `mask`:

      y = mha(x, mask=te_jax.flax.PackedSequences(segment_ids), is_causal=True)   # NNX

  te_jax's attention_fn hands them to fused_attn (q_segment_ids, kv_segment_ids, q_positions, kv_positions; see
  te_jax.fused_attn): a query sees only keys of its own segment, id 0 is padding. Each is int32 `[batch..., L]` with
  the module's batch dims. A padding mask is ids 1 for tokens and 0 for padding: `PackedSequences(valid.astype(int))`
  (padded query rows give 0, where Flax's attention gives the mean of value). The same mask for Flax's default attention is
  `nn.make_attention_mask(segment_ids, segment_ids, jnp.equal)` (which, unlike te_jax, lets id-0 tokens see each
  other). Only te_jax's attention_fn understands this object (CPU and GPU).
  """
  q_segment_ids: jax.Array
  kv_segment_ids: jax.Array | None = None
  q_positions: jax.Array | None = None
  kv_positions: jax.Array | None = None

  def fused_attn_kwargs(self, batch_dims: tuple[int, ...], batch: int) -> dict:
    kwargs = {}
    for field in dataclasses.fields(self):
      x = getattr(self, field.name)
      if x is None:
        continue
      x = jnp.asarray(x)
      if x.ndim < 1 or x.shape[:-1] != batch_dims:
        raise ValueError(f"PackedSequences.{field.name} must be [batch..., L] with the batch dims {batch_dims} of "
                         f"query, got shape {tuple(x.shape)}")
      kwargs[field.name] = x.reshape(batch, x.shape[-1])
    return kwargs


def make_attention_fn(*, ignore_mask: bool = False, **te_jax_options):
  """An attention_fn for Flax's MultiHeadAttention that calls te_jax.fused_attn with `te_jax_options`.

  Args:
    ignore_mask: drop the `mask` the module passes instead of applying it as a bias. Only for a mask that is exactly
      what the options already say (e.g. Linen's `nn.make_causal_mask(x)` with `mask_type="causal"`), to save the
      bias's memory and bandwidth: te_jax does not look at it. Do not rely on it for anything else (padding, segment
      masks): that mask would simply not apply.
    te_jax_options: fused_attn's keyword options: mask_type ("no_mask", "causal", "causal_bottom_right"; the padding
      masks need lengths, which a Flax module does not pass), window_size, scale, softcap, alibi_slopes,
      deterministic (fused_attn's: a bitwise reproducible backward; not Flax's dropout flag), engine,
      context_parallel_axis, context_parallel_strategy, context_parallel_load_balanced, fp8 (True or "per_head":
      q, k and v quantized to FP8 inside, current scaling each call, straight-through gradients).

  Returns:
    A function with the signature of flax's dot_product_attention (see attention_fn).
  """
  unknown = sorted(set(te_jax_options) - set(_OPTIONS))
  if unknown:
    raise TypeError(f"make_attention_fn: unknown te_jax option(s) {', '.join(unknown)}; the options are "
                    f"{', '.join(_OPTIONS)}")
  mask_type = MaskType.parse(te_jax_options.pop("mask_type", "no_mask"))
  if mask_type.is_padding:
    raise ValueError(f"make_attention_fn: mask_type {mask_type.name.lower()!r} needs q_seqlens/kv_seqlens, which "
                     f"a Flax module does not pass to its attention function; call te_jax.fused_attn or "
                     f"te_jax.dot_product_attention(query_seq_lengths=..., key_value_seq_lengths=...) directly")
  if not isinstance(ignore_mask, bool):
    raise TypeError(f"ignore_mask must be a bool, got {ignore_mask!r}")

  def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
                   dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None, module=None,
                   force_fp32_for_softmax: bool = False, einsum_dot_general=None, qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None, is_causal: bool = False):
    """Flax's dot_product_attention contract on te_jax.fused_attn.

    query `[batch..., Lq, H, D]`, key `[batch..., Lkv, Hkv, D]`, value `[batch..., Lkv, Hkv, Dv]` (any number of
    batch dims, also none); H a multiple of Hkv. Returns `[batch..., Lq, H, Dv]` in `dtype` (default: the promoted
    dtype of query, key and value, as Flax).

    bias: an additive logit bias broadcastable to `[batch..., H, Lq, Lkv]`, with its gradient. mask: broadcastable
    likewise, nonzero = keep (Flax's), ANDed with is_causal and the options' mask; a PackedSequences (segment ids of
    packed documents); or anything when made with ignore_mask=True (then dropped). Both become fused_attn's additive
    bias (the mask as -inf where masked out): prefer is_causal (NNX) or make_attention_fn(mask_type="causal") to a
    causal mask. A query row that keeps no key gives 0, where Flax gives the mean of value. dropout_rate > 0 with
    deterministic=False is fused_attn's dropout keyed by dropout_rng, which draws an independent
    mask per batch entry and head (te_jax.dropout_keep_mask): it needs broadcast_dropout=False (Flax's default, True,
    shares one mask across them, which te_jax does not draw, so it is refused); with deterministic=True dropout does
    nothing, as in Flax. module (sow_weights) is refused: the fused kernel never forms the attention weights. precision and force_fp32_for_softmax are
    accepted and have nothing to change: te_jax's kernels accumulate and take the softmax in float32.
    """
    packed = mask if isinstance(mask, PackedSequences) else None
    if packed is not None or ignore_mask:
      mask = None
    dropout = _dropout_options(dropout_rate, dropout_rng, deterministic, broadcast_dropout)
    if module is not None:
      raise ValueError("te_jax attention_fn: sow_weights needs the attention weights, which te_jax's fused kernel "
                       "never forms; use Flax's default attention_fn to inspect them")
    for name, fn in (("einsum_dot_general", einsum_dot_general), ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                     ("attn_weights_value_einsum", attn_weights_value_einsum)):
      if fn is not None:
        raise ValueError(f"te_jax attention_fn: {name} must be None: te_jax's kernels do their own matmuls")
    del precision, force_fp32_for_softmax  # nothing to do (docstring)

    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    if query.ndim < 3 or not query.ndim == key.ndim == value.ndim:
      raise ValueError(f"query, key and value must be [batch..., length, heads, head_dim] with the same batch dims, "
                       f"got shapes {query.shape}, {key.shape}, {value.shape}")
    batch_dims = query.shape[:-3]
    if key.shape[:-3] != batch_dims or value.shape[:-3] != batch_dims:
      raise ValueError(f"query, key and value must have the same batch dims, got shapes {query.shape}, {key.shape}, "
                       f"{value.shape}")
    batch = math.prod(batch_dims)
    query, key, value = (x.reshape((batch,) + x.shape[-3:]) for x in (query, key, value))

    mask_used = mask_type
    if is_causal and not mask_type.is_causal:
      mask_used = MaskType.CAUSAL
    tokens = {} if packed is None else packed.fused_attn_kwargs(batch_dims, batch)
    logit_shape = (batch, query.shape[2], query.shape[1], key.shape[1])
    bias = attention_bias(_batch_flattened(bias, batch_dims), _batch_flattened(_as_bool(mask), batch_dims),
                          logit_shape, dtype)
    out = fused_attn(query, key, value, mask_type=mask_used, bias=bias, **tokens, **dropout, **te_jax_options)
    return out.reshape(batch_dims + out.shape[1:])

  return attention_fn


def _dropout_options(dropout_rate, dropout_rng, deterministic: bool, broadcast_dropout: bool) -> dict:
  """fused_attn's dropout arguments for Flax's: none when Flax applies no dropout (rate 0 or deterministic)."""
  if not dropout_rate or deterministic:
    return {}
  if broadcast_dropout:
    raise ValueError("te_jax attention_fn: broadcast_dropout=True (Flax's default) shares one dropout mask across the "
                     "batch and heads, and te_jax draws an independent one per batch entry and head; set the "
                     "module's broadcast_dropout=False")
  if dropout_rng is None:
    raise ValueError(f"te_jax attention_fn: dropout_rate={dropout_rate} with deterministic=False needs a dropout_rng")
  return dict(dropout_rate=float(dropout_rate), dropout_rng=dropout_rng)


def _as_bool(mask):
  """Flax's mask (any dtype, nonzero = keep; nn.make_attention_mask's is float32) as jax.nn's boolean one."""
  return None if mask is None else jnp.asarray(mask) != 0


def _batch_flattened(x, batch_dims: tuple[int, ...]):
  """x broadcastable to [batch..., H, Lq, Lkv] (Flax's bias and mask) as [B|1, H|1, Lq|1, Lkv|1], B the product of the
  batch dims: 1 where x does not vary over them, so its gradient stays small."""
  if x is None:
    return None
  x = jnp.asarray(x)
  rank = len(batch_dims) + 3
  if x.ndim > rank:
    raise ValueError(f"bias and mask must be broadcastable to [batch..., heads, q_length, kv_length] with batch dims "
                     f"{batch_dims}, got shape {tuple(x.shape)}")
  x = x.reshape((1,) * (rank - x.ndim) + x.shape)
  if all(extent == 1 for extent in x.shape[:-3]):
    return x.reshape((1,) + x.shape[-3:])
  return jnp.broadcast_to(x, batch_dims + x.shape[-3:]).reshape((math.prod(batch_dims),) + x.shape[-3:])


attention_fn = make_attention_fn()
attention_fn.__doc__ = (
    "te_jax's attention with Flax's attention_fn contract and te_jax's defaults (no mask unless the NNX module is "
    "called with is_causal=True).\n\n" + inspect.getdoc(attention_fn))
