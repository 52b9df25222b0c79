"""FP8 attention's operands: te_jax.quantize_fp8 and the conventions fused_attn's FP8 arguments follow.

An FP8 array x8 (float8_e4m3fn or float8_e5m2) with its float32 descale stands for `x8.astype(float32) * descale`; the
descale is a scalar, one per head along axis 2 of a [B, S, H, D] operand ([H] for q, [Hkv] for k and v), or for a KV
cache's page pool [num_pages, page_size, Hkv, D] one per page and kv head. Current scaling maps a tensor's (a head's, a
page's) largest magnitude onto the format's largest finite value: descale = amax / max.

fused_attn takes FP8 two ways (te_jax/attention.py): pre-quantized q, k, v (or k and v alone, an FP8 KV cache) with
their descales, where differentiating an FP8 operand or a descale is an error; and `fp8=True | "per_head"` on
bfloat16/float16/float32 q, k, v, quantized inside exactly as quantize_fp8 does, whose gradients are those with respect
to the dequantized values, returned in the operands' dtype (the straight-through convention of FP8 training). Off a GPU
the attention runs on the dequantized values in float32, the reference the FP8 kernels are measured against. On CUDA,
pre-quantized q, k and v go to the sm90 FP8 kernel as they are (fp8_native_operands, chosen per platform at lowering)
where TE_JAX_CUDA_FP8_ATTENTION=1 enables it (it has not yet run on a GPU); otherwise a GPU refuses FP8 attention
(te_jax/_backends.py: Backend.serves_fp8), never computing it at another precision silently.

An FP8 KV cache (FP8 k and v, q in a wider dtype; te_jax.paged_attention's FP8 pools) reaches the kernels as it is:
its descales become the kv_descale operand (kv_descale_operand), which the kernels apply as they read each key's row,
so the cache's bytes are read once, in FP8. Under context parallelism, and in the backward (the gradient for q), the
cache is dequantized instead.
"""

from __future__ import annotations

import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.symbolic_zeros import primal_values

# The formats and their largest finite values.
FORMAT_MAX = {np.dtype(jnp.float8_e4m3fn): 448.0, np.dtype(jnp.float8_e5m2): 57344.0}
# The output dtypes an FP8 call may ask for.
OUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))
MODES = (False, True, "per_head")


def is_fp8(dtype) -> bool:
  return np.dtype(dtype) in FORMAT_MAX


def _format(dtype):
  try:
    if is_fp8(dtype):
      return np.dtype(dtype)
  except TypeError:
    pass
  raise TypeError(f"dtype must be jnp.float8_e4m3fn or jnp.float8_e5m2, got {dtype!r}")


def _heads(x, per_head: bool, name: str) -> int | None:
  if not per_head:
    return None
  if x.ndim != 4:
    raise ValueError(f"{name}: per-head scaling takes a [B, S, H, D] array, got shape {tuple(x.shape)}")
  return x.shape[2]


def _float32_scale(value, shapes: list[tuple[int, ...]], name: str, what: str):
  """A descale or an amax checked: float32, of one of `shapes` (() a scalar)."""
  value = jnp.asarray(value)
  if value.shape not in shapes or value.dtype != jnp.float32:
    allowed = " or ".join("a scalar" if not shape else str(list(shape)) for shape in shapes)
    raise ValueError(f"{name} must be float32, {allowed} ({what}), got {value.dtype} {tuple(value.shape)}")
  return value


def descale_operand(descale, heads: int, name: str, pages: int | None = None):
  """An operand's descale checked: a float32 scalar, one per head ([heads]) or, for a page pool of `pages` pages, one
  per page and head ([pages, heads])."""
  shapes = [(), (heads,)] + ([] if pages is None else [(pages, heads)])
  what = "the tensor's descale, or one per head" + ("" if pages is None else ", or one per page and head")
  return _float32_scale(descale, shapes, f"{name}_descale", what)


def kv_descale_operand(k_descale, v_descale):
  """The kernels' kv_descale operand, float32 [2, blocks, heads], from an FP8 KV cache's checked descales (each a
  scalar, [Hkv], or a pool's [num_pages, Hkv]; the two broadcast to one shape): k's, then v's."""
  as_2d = lambda d: d.reshape((1,) * (2 - d.ndim) + d.shape)
  k2, v2 = as_2d(k_descale), as_2d(v_descale)
  shape = jnp.broadcast_shapes(k2.shape, v2.shape)
  return jnp.stack([jnp.broadcast_to(k2, shape), jnp.broadcast_to(v2, shape)])


def refuse_kv_cache_gradients(k, v, kv_descale):
  """An FP8 KV cache read by the kernels as it is (symbolic-zero primals that say what is differentiated): like a
  dequantized FP8 operand, it and its descales get no gradient, and asking for one is an error."""
  for name, x in (("k", k), ("v", v)):
    if x.perturbed:
      raise ValueError(f"{name} is an FP8 operand being differentiated (an FP8 KV cache): te_jax computes no FP8 "
                       f"gradient (q's gradient flows); pass jax.lax.stop_gradient({name})")
  if kv_descale.perturbed:
    raise ValueError("k_descale or v_descale is being differentiated, but te_jax computes no gradient for descales (it "
                     "would be a silent zero): pass them through jax.lax.stop_gradient")


def kv_cache_compute_dtype(q_dtype, platform: str | None):
  """The dtype an FP8 KV cache is dequantized to where the kernels do not read it as it is (a backward, a gathered
  paged call): float32, the reference (AttentionConfig.fp8), or on CUDA, whose kernels compute in bfloat16/float16,
  q's dtype (a call in that dtype)."""
  return q_dtype if platform == "cuda" else jnp.float32


def dequantize_kv_operand(x8, kv_descale, which: int, dtype=jnp.float32):
  """k (which 0) or v (1) of an FP8 KV cache in dtype from the kv_descale operand (blocks 1 or pages, along axis 0 of
  a pool; heads along axis 2)."""
  descale = kv_descale[which]  # [blocks, heads]
  scale = descale[:, None, :, None] if descale.shape[0] > 1 else descale.reshape(1, 1, -1, 1)
  return (x8.astype(jnp.float32) * scale).astype(dtype)


def _per_head(scale, ndim: int):
  """A descale (scalar, [H], or [num_pages, H] of a page pool) shaped to broadcast against a [B or num_pages, S, H, D]
  operand (or any operand, when scalar)."""
  if scale.ndim == 2:
    return scale[:, None, :, None]
  return scale if scale.ndim == 0 else scale.reshape((1,) * (ndim - 2) + (-1, 1))


def quantize_fp8(x, *, dtype=jnp.float8_e4m3fn, per_head: bool = False, amax=None):
  """Quantizes x to FP8 with current scaling: returns (x8, descale) with x ~= x8.astype(float32) * descale.

  Args:
    x: a floating array; with per_head, [B, S, H, D].
    dtype: jnp.float8_e4m3fn (max 448) or jnp.float8_e5m2 (max 57344).
    per_head: one descale per head (axis 2), [H]; else one float32 scalar for the tensor.
    amax: the largest magnitude to map onto the format's max (delayed scaling from an amax history), float32 of the
      descale's shape; defaults to max |x| (over the tensor, or per head over B, S and D). Values beyond it saturate.

  Returns:
    x8 in dtype, and the float32 descale: amax / the format's max, or 1 where amax is 0 (an all-zero tensor or
    head). A NaN or inf in x makes amax (and so every value scaled by it) NaN, as current scaling's formula says.
  """
  heads = _heads(_floating(x, "quantize_fp8: x"), per_head, "quantize_fp8")
  if amax is not None:
    amax = _float32_scale(amax, [() if heads is None else (heads,)], "quantize_fp8: amax",
                          "the magnitude mapped onto the format's max")
  return _quantize(x, _format(dtype), None if heads is None else (0, 1, 3), amax)


def quantize_kv_pages(pages, *, dtype=jnp.float8_e4m3fn, granularity: str = "head"):
  """Quantizes a KV cache's page pool [num_pages, page_size, Hkv, D] for te_jax.paged_attention: returns (pages8,
  descale) with current scaling, the descale float32 of one granularity: "tensor" (a scalar), "head" ([Hkv], the
  default) or "page" ([num_pages, Hkv]: each page and head its own, as a cache that quantizes pages as they fill keeps
  them). An all-zero page or head gets descale 1."""
  _floating(pages, "quantize_kv_pages: pages")
  if pages.ndim != 4:
    raise ValueError(f"quantize_kv_pages: pages must be [num_pages, page_size, Hkv, D], got shape {tuple(pages.shape)}")
  axes = {"tensor": None, "head": (0, 1, 3), "page": (1, 3)}
  if granularity not in axes:
    raise ValueError(f"granularity must be 'tensor', 'head' or 'page', got {granularity!r}")
  return _quantize(pages, _format(dtype), axes[granularity], None)


def _floating(x, name: str):
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating) or is_fp8(x.dtype):
    raise TypeError(f"{name} must be a float32, bfloat16 or float16 array, got {getattr(x, 'dtype', type(x).__name__)}")
  return x


def _quantize(x, fmt, axes, amax):
  """Current scaling over `axes` (None: the whole tensor) or with the given amax."""
  x32 = jnp.asarray(x, jnp.float32)
  if amax is None:
    amax = jnp.max(jnp.abs(x32), axis=axes)
  top = FORMAT_MAX[fmt]
  descale = jnp.where(amax == 0, jnp.float32(1), amax / jnp.float32(top))
  # e4m3fn has no infinity (out-of-range values would become NaN): saturate at the format's max.
  x8 = jnp.clip(x32 / _per_head(descale, x32.ndim), -top, top).astype(fmt)
  return x8, descale


def dequantize_fp8(x8, descale, dtype=jnp.float32):
  """x8.astype(float32) * descale (a scalar, [H] along axis 2, or a page pool's [num_pages, H]), in dtype."""
  return (x8.astype(jnp.float32) * _per_head(descale, x8.ndim)).astype(dtype)


# Pre-quantized operands: dequantized for the float32 attention; an FP8 operand or a descale being differentiated is an
# error, not a silent zero (an FP8 gradient is of no use, and te_jax computes none for the descales).
def _refusing_fwd(name, x8, descale):
  _refused_gradient(name, x8, descale)
  x8, descale = primal_values((x8, descale))
  return dequantize_fp8(x8, descale), None


def _dequantized_named(name):
  f = jax.custom_vjp(lambda x8, descale: dequantize_fp8(x8, descale))
  f.defvjp(partial(_refusing_fwd, name), lambda _, ct: (None, None), symbolic_zeros=True)
  return f


_DEQUANTIZE = {name: _dequantized_named(name) for name in ("q", "k", "v")}


# The training entry: x quantized as quantize_fp8 does and dequantized; the gradient passes straight through, in x's
# dtype.
@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fake_quantized(x, amax, fmt, per_head):
  return dequantize_fp8(*quantize_fp8(x, dtype=fmt, per_head=per_head, amax=amax))


def _fake_quantized_fwd(x, amax, fmt, per_head):
  # The residual only carries x's dtype (an empty array of it), which the cotangent must take.
  return _fake_quantized(x, amax, fmt, per_head), jnp.zeros((0,), x.dtype)


def _fake_quantized_bwd(fmt, per_head, x_like, ct):
  return ct.astype(x_like.dtype), None


_fake_quantized.defvjp(_fake_quantized_fwd, _fake_quantized_bwd)


# The CUDA sm90 forward's FP8 kernel (kernels/sm90/attention_fwd.cuh): compiled and tested by NVRTC, not yet run on a
# GPU, so calls reach it only where TE_JAX_CUDA_FP8_ATTENTION=1 asks (else a CUDA lowering refuses FP8 attention).
FP8_ATTENTION_ENV = "TE_JAX_CUDA_FP8_ATTENTION"


def native_fp8_attention() -> bool:
  value = os.environ.get(FP8_ATTENTION_ENV, "0")
  if value not in ("0", "1"):
    raise ValueError(f"{FP8_ATTENTION_ENV} must be 0 or 1, got {value!r}")
  return value == "1"


# The FP8 kernel's k slots of each 16 keys: slot i of V^T holds key FP8_KEY_OF_SLOT[i] (the order in which a thread's
# accumulator columns fill its A fragment, kernels/primitives/fragment.h Fp8KeyOfSlot).
FP8_KEY_OF_SLOT = np.array([8 * ((i >> 1) & 1) + 2 * (i >> 2) + (i & 1) for i in range(16)])


def fp8_values_transposed(v8):
  """v [B, Skv, Hkv, Dv] as the FP8 kernel reads it: each K/V head's V^T [Dv, Skv] with the keys of every 16 in
  FP8_KEY_OF_SLOT's order, returned in v's shape (the same bytes' count, so the call's shapes hold). Skv must be a
  multiple of 16: other calls are returned as they are, for the core's validation to refuse."""
  b, s, h, d = v8.shape
  if s % 16:
    return v8
  grouped = v8.reshape(b, s // 16, 16, h, d)[:, :, FP8_KEY_OF_SLOT]
  return grouped.reshape(b, s, h, d).transpose(0, 2, 3, 1).reshape(b, s, h, d)


def fp8_descales(q_descale, k_descale, v_descale, num_heads: int):
  """The FP8 kernel's descales operand, float32 [3, 1, H]: q's, k's and v's per query head (k's and v's [Hkv] repeated
  over each group of query heads)."""
  def per_head(d):
    d = jnp.asarray(d, jnp.float32)
    return jnp.broadcast_to(d, (num_heads,)) if d.ndim == 0 else jnp.repeat(d, num_heads // d.shape[0])
  return jnp.stack([per_head(d) for d in (q_descale, k_descale, v_descale)])[:, None, :]


def _refused_gradient(name, x8, descale):
  if x8.perturbed:
    raise ValueError(f"{name} is an FP8 operand being differentiated: te_jax computes no FP8 gradient. Train with "
                     f"fp8=True on {name} in bfloat16/float16/float32 (quantized inside, gradients in its dtype), or "
                     f"pass jax.lax.stop_gradient({name})")
  if descale.perturbed:
    raise ValueError(f"{name}_descale is being differentiated, but te_jax computes no gradient for descales (it would "
                     f"be a silent zero): pass jax.lax.stop_gradient({name}_descale)")


def _native_named(name):
  f = jax.custom_vjp(lambda x8, descale: x8)

  def fwd(x8, descale):
    _refused_gradient(name, x8, descale)
    return primal_values(x8), None
  f.defvjp(fwd, lambda _, ct: (None, None), symbolic_zeros=True)
  return f


_NATIVE = {name: _native_named(name) for name in ("q", "k", "v")}


def fp8_operands(q, k, v, q_descale, k_descale, v_descale, fp8, fp8_amax, out_dtype, native_kv_cache: bool):
  """fused_attn's FP8 arguments checked and applied: returns (q, k, v, out_dtype, is_fp8_call, kv_descale, native),
  where an FP8 call's q, k, v are the float32 dequantized values and out_dtype the dtype its out is cast to (None: no
  cast); with native_kv_cache an FP8 KV cache stays FP8, q as given, and kv_descale is the kernels' operand (else
  None). native: for FP8 q, k and v, (q8, k8, v8, q_descale, k_descale, v_descale) as given (checked), which the CUDA
  FP8 kernel reads (fp8_native_operands), else None."""
  if not any(x is not None for x in (q_descale, k_descale, v_descale, fp8_amax, out_dtype)) and fp8 is False and \
      not any(is_fp8(x.dtype) for x in (q, k, v)):
    return q, k, v, None, False, None, None
  if fp8 not in MODES or isinstance(fp8, (int, np.integer)) and not isinstance(fp8, bool):
    raise ValueError(f"fp8 must be False, True (one descale per tensor) or 'per_head', got {fp8!r}")
  if out_dtype is not None and np.dtype(out_dtype) not in OUT_DTYPES:
    raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype!r}")
  descales = (q_descale, k_descale, v_descale)
  if any(is_fp8(x.dtype) for x in (q, k, v)):
    # All three FP8, or k and v alone (an FP8 KV cache; q stays bfloat16/float16/float32 and out takes its dtype).
    kv_cache = not is_fp8(q.dtype)
    if not (is_fp8(k.dtype) and k.dtype == v.dtype and (kv_cache or q.dtype == k.dtype)):
      raise TypeError(f"FP8 attention takes q, k and v in one FP8 dtype (float8_e4m3fn or float8_e5m2), or k and v "
                      f"in one with q in bfloat16, float16 or float32 (an FP8 KV cache); got {q.dtype}, {k.dtype}, "
                      f"{v.dtype}")
    if fp8 is not False or fp8_amax is not None:
      raise ValueError("fp8= and fp8_amax= quantize bfloat16/float16/float32 operands inside; the operands are already "
                       "FP8 (pass their descales instead)")
    names = "kv" if kv_cache else "qkv"
    if kv_cache and q_descale is not None:
      raise ValueError(f"q_descale goes with an FP8 q; q is {q.dtype}")
    missing = [f"{n}_descale" for n, d in zip("qkv", descales) if n in names and d is None]
    if missing:
      raise ValueError(f"FP8 {', '.join(names)} need their descales (x8.astype(float32) * descale is the value): "
                       f"{', '.join(missing)} missing; te_jax.quantize_fp8 returns them")
    for x, name in zip((q, k, v), "qkv"):
      if x.ndim != 4:
        raise ValueError(f"{name} must have rank 4, got shape {tuple(x.shape)}")
    checked = {name: descale_operand(d, x.shape[2], name) for x, d, name in zip((q, k, v), descales, "qkv")
               if name in names}
    out = np.dtype(out_dtype or (q.dtype if kv_cache else jnp.bfloat16))
    if kv_cache and native_kv_cache:
      return q, k, v, out, True, kv_descale_operand(checked["k"], checked["v"]), None
    values = [q.astype(jnp.float32)] if kv_cache else []
    values += [_DEQUANTIZE[name](x, checked[name]) for x, name in zip((q, k, v), "qkv") if name in names]
    native = None if kv_cache else (q, k, v, checked["q"], checked["k"], checked["v"])
    return (*values, out, True, None, native)
  if any(d is not None for d in descales):
    raise ValueError("q_descale, k_descale and v_descale go with FP8 q, k and v (float8_e4m3fn or float8_e5m2); got "
                     f"{q.dtype} operands (fp8=True quantizes them inside)")
  if fp8 is False:
    raise ValueError("fp8_amax and out_dtype go with FP8 attention: FP8 q, k, v with descales, or fp8=True | "
                     "'per_head'")
  per_head = fp8 == "per_head"
  if fp8_amax is not None:
    if not isinstance(fp8_amax, (tuple, list)) or len(fp8_amax) != 3:
      raise ValueError("fp8_amax must be a tuple (q_amax, k_amax, v_amax) of float32 "
                       f"{'[H] / [Hkv]' if per_head else 'scalars'}")
  amaxes = fp8_amax or (None, None, None)
  values = []
  for x, amax, name in zip((q, k, v), amaxes, "qkv"):
    if amax is not None:
      heads = _heads(x, per_head, name)
      amax = jax.lax.stop_gradient(_float32_scale(amax, [() if heads is None else (heads,)], f"fp8_amax for {name}",
                                                  "its amax"))
    values.append(_fake_quantized(x, amax, np.dtype(jnp.float8_e4m3fn), per_head))
  return (*values, np.dtype(out_dtype or q.dtype), True, None, None)


def fp8_native_operands(native):
  """The CUDA FP8 kernel's operands from fp8_operands' `native`: q8, k8, V^T (fp8_values_transposed) and the descales
  operand [3, 1, H]; differentiating an FP8 operand or a descale is an error, as on the dequantized path."""
  q8, k8, v8, q_descale, k_descale, v_descale = native
  q8, k8, v8 = (_NATIVE[name](x, d) for x, d, name in zip((q8, k8, v8), (q_descale, k_descale, v_descale), "qkv"))
  descales = jax.lax.stop_gradient(fp8_descales(q_descale, k_descale, v_descale, q8.shape[2]))
  return q8, k8, fp8_values_transposed(v8), descales


def fp8_pools(q, k_pages, v_pages, k_descale, v_descale):
  """te_jax.paged_attention's FP8 KV cache checked: returns its kv_descale operand (kv_descale_operand of descales of
  any granularity of quantize_kv_pages), None for pools in q's dtype."""
  if not (is_fp8(k_pages.dtype) or is_fp8(v_pages.dtype)):
    if k_descale is not None or v_descale is not None:
      raise ValueError(f"k_descale and v_descale go with an FP8 KV cache (float8_e4m3fn or float8_e5m2 pages); the "
                       f"pages are {k_pages.dtype}")
    return None
  if not (k_pages.dtype == v_pages.dtype and not is_fp8(q.dtype)):
    raise TypeError(f"an FP8 KV cache takes k_pages and v_pages in one FP8 dtype and q in bfloat16, float16 or float32, "
                    f"got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    if pages.ndim != 4:
      raise ValueError(f"{name} must have shape [num_pages, page_size, Hkv, D], got {tuple(pages.shape)}")
  missing = [f"{n}_descale" for n, d in (("k", k_descale), ("v", v_descale)) if d is None]
  if missing:
    raise ValueError(f"FP8 pages need their descales (pages.astype(float32) * descale is the value): "
                     f"{', '.join(missing)} missing; te_jax.quantize_kv_pages returns them")
  return kv_descale_operand(*(descale_operand(d, pages.shape[2], name, pages=pages.shape[0])
                               for pages, d, name in ((k_pages, k_descale, "k"), (v_pages, v_descale, "v"))))


def append_kv_pages(pages, descale, values, page_table, positions):
  """Writes new tokens into a KV cache's page pool, so a serving loop never dequantizes the cache: returns (pages,
  descale).

  Args:
    pages: the pool [num_pages, page_size, Hkv, D], FP8 (float8_e4m3fn / float8_e5m2) or bfloat16/float16/float32.
    descale: an FP8 pool's float32 descale (None for another pool): a scalar or [Hkv], with which the new tokens are
      quantized (values beyond it saturate: a static or delayed scale), or [num_pages, Hkv], where every page that
      receives tokens is quantized anew with current scaling over its tokens (those already there included, so its
      descale follows what it holds, and a page written from its first slot forgets what it held before).
    values: [B, T, Hkv, D] (float32, bfloat16 or float16): the tokens at positions[b] .. positions[b] + T - 1 of
      sequence b.
    page_table: int32 [B, max_pages_per_seq]: sequence b's pages in order. The pages one call writes must be distinct
      pages of the pool (positions past the table's capacity or page ids outside the pool are not written).
    positions: int32 [B], where each sequence's new tokens start (its length before them).
  """
  pages, values = jnp.asarray(pages), jnp.asarray(values)
  page_table, positions = jnp.asarray(page_table, jnp.int32), jnp.asarray(positions, jnp.int32)
  if pages.ndim != 4 or values.ndim != 4 or values.shape[2:] != pages.shape[2:]:
    raise ValueError(f"append_kv_pages: pages [num_pages, page_size, Hkv, D] and values [B, T, Hkv, D] must agree on "
                     f"Hkv and D, got {tuple(pages.shape)} and {tuple(values.shape)}")
  if page_table.ndim != 2 or positions.shape != (values.shape[0],) or page_table.shape[0] != values.shape[0]:
    raise ValueError(f"append_kv_pages: page_table must be [B, max_pages] and positions [B] with B = {values.shape[0]}, "
                     f"got {tuple(page_table.shape)} and {tuple(positions.shape)}")
  _floating(values, "append_kv_pages: values")
  num_pages, page_size, heads = pages.shape[:3]
  if is_fp8(pages.dtype):
    if descale is None:
      raise ValueError("append_kv_pages: an FP8 pool needs its descale (te_jax.quantize_kv_pages returns it)")
    descale = descale_operand(descale, heads, "append_kv_pages: the pool's", pages=num_pages)
  elif descale is not None:
    raise ValueError(f"append_kv_pages: descale goes with an FP8 pool; the pool is {pages.dtype}")
  batch, count = values.shape[:2]
  # The pages the new tokens touch: at most this many per sequence, from the one holding its first new token.
  touched = (count + page_size - 1) // page_size + 1
  index = positions[:, None] // page_size + jnp.arange(touched, dtype=jnp.int32)[None, :]  # [B, touched]
  start = index * page_size  # each touched page's first position
  used = (start < (positions + count)[:, None]) & (index < page_table.shape[1])
  ids = jnp.take_along_axis(page_table, jnp.clip(index, 0, page_table.shape[1] - 1), axis=1)
  used &= (ids >= 0) & (ids < num_pages)
  ids = jnp.where(used, ids, num_pages)  # not written: out of the pool, dropped by the scatters
  # The touched pages' contents: the new tokens where they fall, the pool's (dequantized) tokens elsewhere.
  slot_position = start[:, :, None] + jnp.arange(page_size, dtype=jnp.int32)  # [B, touched, page_size]
  new = (slot_position >= positions[:, None, None]) & (slot_position < (positions + count)[:, None, None])
  token = jnp.clip(slot_position - positions[:, None, None], 0, count - 1)
  incoming = jnp.take_along_axis(values.astype(jnp.float32), token.reshape(batch, -1)[:, :, None, None],
                                 axis=1).reshape(batch, touched, page_size, heads, -1)
  safe_ids = jnp.clip(ids, 0, num_pages - 1)
  old = pages[safe_ids].astype(jnp.float32)
  if descale is not None:
    old_scale = descale[safe_ids] if descale.ndim == 2 else descale
    old = old * (_per_head(old_scale, 5) if descale.ndim < 2 else old_scale[:, :, None, :, None])
  page = jnp.where(new[..., None, None], incoming, old)  # [B, touched, page_size, Hkv, D]
  if descale is None:
    return pages.at[ids].set(page.astype(pages.dtype), mode="drop"), None
  fmt, top = np.dtype(pages.dtype), FORMAT_MAX[np.dtype(pages.dtype)]
  if descale.ndim == 2:
    # Current scaling over each written page's tokens: those before its first new one (none when the page starts at or
    # after the sequence's first new token) and the new ones.
    live = (slot_position < (positions + count)[:, None, None]) & \
        ((slot_position >= positions[:, None, None]) | (start < positions[:, None])[:, :, None])
    amax = jnp.max(jnp.where(live[..., None, None], jnp.abs(page), 0.0), axis=(2, 4))  # [B, touched, Hkv]
    scale = jnp.where(amax == 0, jnp.float32(1), amax / jnp.float32(top))
    page8 = jnp.clip(page / scale[:, :, None, :, None], -top, top).astype(fmt)
    return pages.at[ids].set(page8, mode="drop"), descale.at[ids].set(scale, mode="drop")
  page8 = jnp.clip(page / _per_head(descale, 5), -top, top).astype(fmt)
  return pages.at[ids].set(page8, mode="drop"), descale
