"""Attention over a paged KV cache: each sequence's keys and values live in fixed-size pages of a shared pool, listed in
order by its row of the page table (vLLM's and FlashInfer's layout).

Where the backend's kernels read pages in place (the CPU backend's always, the CUDA backend's decode kernels for at
most 16 query positions: cpp/core/kv_rows.h), the forward binds the attention primitive with the pool and the page table,
and nothing is gathered (_attend_in_place). Otherwise (longer queries on the GPU) the pages a call needs are gathered
into contiguous K/V with one XLA gather and fused_attn runs on them (_attend_gathered), which costs one extra read and
write of the gathered K/V per call. The choice is made per platform at lowering (jax.lax.platform_dependent), so one
program serves both. Gradients always differentiate the gather formulation (see _attend)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import _primitives
from te_jax import sharding as _sharding
from te_jax.arguments import (alibi_operand, as_array, check_bool, check_qkv, check_scale, check_softcap, check_window,
                              saturate_to_int32)
from te_jax.attention import _attention
from te_jax.attention_config import AttentionConfig
from te_jax.engine import requested_engine
from te_jax.fp8 import dequantize_kv_operand, fp8_pools, is_fp8, kv_cache_compute_dtype, refuse_kv_cache_gradients
from te_jax.mask_type import MaskType
from te_jax.symbolic_zeros import instantiate_zeros, primal_values, refuse_slope_gradient

# Queries sit at the end of their sequence: "causal_bottom_right" lets query i of Sq see the keys up to position
# kv_length - Sq + i; "no_mask" lets every query see all kv_length keys. Each maps to the padding variant of fused_attn.
_MASKS = {MaskType.CAUSAL_BOTTOM_RIGHT: MaskType.PADDING_CAUSAL_BOTTOM_RIGHT, MaskType.NO_MASK: MaskType.PADDING}


def paged_attention(q, k_pages, v_pages, page_table, kv_lengths, *, mask_type="causal_bottom_right",
                    window_size=(-1, -1), scale=None, softcap=0.0, alibi_slopes=None, return_lse=False, engine=None,
                    k_descale=None, v_descale=None):
  """Attention of q over a paged KV cache.

  Args:
    q: [B, Sq, H, D], the newest Sq tokens of each sequence (Sq = 1 when decoding).
    k_pages, v_pages: [num_pages, page_size, Hkv, D] / [..., Dv], the page pool (num_pages >= 1); page_size a multiple
      of 8 up to 256.
    page_table: int32 [B, max_pages_per_seq]: row b lists the pages of sequence b in order; entries past the
      sequence's last page are never read (any value).
    kv_lengths: int32 [B], the tokens in each sequence's cache (its queries included), 0 .. max_pages * page_size.
    mask_type: "causal_bottom_right" (default: query i sees keys up to kv_length - Sq + i) or "no_mask" (every key of
      the sequence).
    window_size, scale, softcap, alibi_slopes, return_lse, engine: as in te_jax.fused_attn.
    k_descale, v_descale: an FP8 KV cache: k_pages and v_pages of one FP8 dtype (float8_e4m3fn or float8_e5m2) with q
      in bfloat16, float16 or float32, each pool with its float32 descale: a scalar, one per kv head [Hkv], or one per
      page and kv head [num_pages, Hkv] (te_jax.quantize_kv_pages returns them). Out in q's dtype. The CPU attends
      over the dequantized pages in float32; a GPU reads the pages as they are in its decode kernels (up to 16 query
      positions, f16 products) and attends over them dequantized to q's dtype beyond (the gathered formulation). The
      pages and descales get no gradient.

  Returns:
    out [B, Sq, H, Dv] (and lse float32 [B, H, Sq] if return_lse), as fused_attn over the sequence's keys.

  Concrete page tables and lengths are checked (a page id outside the pool, or a length outside its range, is a
  ValueError). Under jit the values are not known: a sequence whose used page ids or length are out of range gets NaN
  in every output (and gradient) of its batch entry, and nothing outside the pool is read.
  """
  mask = MaskType.parse(mask_type)
  if mask not in _MASKS:
    raise ValueError(f"paged_attention's mask_type must be 'causal_bottom_right' or 'no_mask' (queries sit at the end "
                     f"of their sequence), got {mask.name.lower()!r}")
  q, k_pages, v_pages = (jnp.asarray(as_array(x, name)) for x, name in ((q, "q"), (k_pages, "k_pages"),
                                                                         (v_pages, "v_pages")))
  kv_descale = fp8_pools(q, k_pages, v_pages, k_descale, v_descale)
  num_pages, page_size = _check_pools(q, k_pages, v_pages)
  batch = q.shape[0]
  page_table, kv_lengths = _page_operands(page_table, kv_lengths, batch, num_pages, page_size)
  window_left, window_right = check_window(window_size)
  check_bool(return_lse, "return_lse")
  capacity = page_table.shape[1] * page_size  # k and v as the gather formulation sees them: [B, capacity, Hkv, D(v)]
  check_qkv(q, *(jax.ShapeDtypeStruct((batch, capacity) + pool.shape[2:], pool.dtype) for pool in (k_pages, v_pages)))
  config = AttentionConfig(mask_type=_MASKS[mask], window_left=window_left, window_right=window_right,
                           scale=check_scale(scale, q.shape[3]), softcap=check_softcap(softcap),
                           has_alibi=alibi_slopes is not None, engine=requested_engine(engine),
                           lse_cotangent=bool(return_lse), page_size=page_size, fp8=kv_descale is not None)
  alibi = alibi_operand(alibi_slopes, batch, q.shape[2])
  return _attend(config, bool(return_lse), q, k_pages, v_pages, page_table, kv_lengths, alibi, kv_descale)


# The CUDA backend reads pages in place in its decode kernels, for at most this many query positions
# (BackendServesPagesInPlace, cpp/core/validate.h; tests/test_paged_attention.py checks the two agree).
_CUDA_IN_PLACE_MAX_SEQLEN_Q = 16


# config (the paged call's AttentionConfig) and return_lse are static; `pages` is the page table as given, `lengths` the
# kv lengths as given, alibi float32 [B, H] (its placeholder without ALiBi). A sequence whose used page ids or length
# are out of range (a traced call's values are not checked) gets NaN in every output and gradient of its batch entry,
# and nothing outside the pool is read: every path clamps the page ids it reads; the CUDA decode kernels find such a
# sequence themselves (so a decode step is one kernel call and its combine, nothing more), the other paths take its
# length as -1 (_poisoned_lengths), which the invalid-length rule makes NaN. The backward recomputes the forward of
# the gather formulation (one gather and one fused_attn forward more than a saved-residual VJP would cost) and takes
# its VJP with the lengths clamped into range and a cotangent made NaN on a poisoned entry. kv_descale is None, or the
# kernels' operand of FP8 pools (te_jax/fp8.py), which the in-place kernels read as they are and the gathered
# formulation dequantizes (te_jax/fp8.py kv_cache_compute_dtype); the pools and descales get no gradient
# (refuse_kv_cache_gradients), q's flows.
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(config, return_lse, q, k_pages, v_pages, pages, lengths, alibi, kv_descale):
  in_place, gathered = partial(_attend_in_place, config, return_lse), partial(_attend_gathered, config, return_lse)
  gathered_cuda = partial(_attend_gathered, config, return_lse, dtype=kv_cache_compute_dtype(q.dtype, "cuda"))
  cuda = in_place if q.shape[1] <= _CUDA_IN_PLACE_MAX_SEQLEN_Q else _with_poisoned_lengths(gathered_cuda)
  return jax.lax.platform_dependent(q, k_pages, v_pages, pages, lengths, alibi, kv_descale,
                                    cpu=_with_poisoned_lengths(_poisoned_here(in_place)), cuda=cuda,
                                    default=_with_poisoned_lengths(gathered))


def _poisoned_lengths(pages, lengths, num_pages: int, page_size: int):
  """The lengths with -1 where a sequence's length is outside [0, capacity] or a page id it uses is outside the pool."""
  capacity = pages.shape[1] * page_size
  used = jnp.arange(pages.shape[1], dtype=jnp.int32)[None, :] * page_size < lengths[:, None]  # [B, max_pages]
  bad_page = jnp.any(used & ((pages < 0) | (pages >= num_pages)), axis=1)
  return jnp.where(bad_page | (lengths < 0) | (lengths > capacity), -1, lengths)


def _with_poisoned_lengths(attend):
  """`attend` for a path that does not check the page ids itself: it gets the poisoned lengths."""
  def with_poisoned_lengths(q, k_pages, v_pages, pages, lengths, alibi, kv_descale):
    lengths = _poisoned_lengths(pages, lengths, k_pages.shape[0], k_pages.shape[1])
    return attend(q, k_pages, v_pages, pages, lengths, alibi, kv_descale)
  return with_poisoned_lengths


def _poisoned_here(attend):
  """`attend` for a backend whose handler refuses a length outside the capacity (the CPU's checks its operands): a
  poisoned entry reads no key, and its outputs are made NaN here."""
  def poisoned(q, k_pages, v_pages, pages, lengths, alibi, kv_descale):
    bad = lengths < 0
    result = attend(q, k_pages, v_pages, pages, jnp.where(bad, 0, lengths), alibi, kv_descale)
    return jax.tree.map(lambda x: _poison(x, bad), result)
  return poisoned


def _poison(x, bad):
  """x [B, ...] made NaN on the entries where bad [B] holds; a factor, not a select, so gradients see it too."""
  return x * jnp.where(bad, jnp.nan, 1.0).astype(x.dtype).reshape((-1,) + (1,) * (x.ndim - 1))


def _attend_fwd(config, return_lse, *primals):
  refuse_slope_gradient(primals[5])
  if primals[6] is not None:
    refuse_kv_cache_gradients(primals[1], primals[2], primals[6])
  q, k_pages, v_pages, pages, lengths, alibi, kv_descale = primal_values(primals)
  result = _attend(config, return_lse, q, k_pages, v_pages, pages, lengths, alibi, kv_descale)
  return result, (q, k_pages, v_pages, pages, lengths, alibi, kv_descale)


def _attend_bwd(config, return_lse, residuals, cotangent):
  q, k_pages, v_pages, pages, lengths, alibi, kv_descale = residuals
  bad = _poisoned_lengths(pages, lengths, k_pages.shape[0], config.page_size) < 0
  cotangent = jax.tree.map(lambda c: _poison(c, bad), instantiate_zeros(cotangent))
  clamped = jnp.clip(lengths, 0, pages.shape[1] * config.page_size)
  attend = lambda q, k, v: _attend_gathered(config, return_lse, q, k, v, pages, clamped, alibi, kv_descale)
  # The page table and lengths are integers; ALiBi's slopes are never differentiated (refuse_slope_gradient), nor
  # are FP8 pools and their descales.
  if kv_descale is not None:
    over = lambda platform: lambda q: _attend_gathered(config, return_lse, q, k_pages, v_pages, pages, clamped, alibi,
                                                       kv_descale, dtype=kv_cache_compute_dtype(q.dtype, platform))
    _, vjp = jax.vjp(lambda q: jax.lax.platform_dependent(q, cuda=over("cuda"), default=over(None)), q)
    return (*vjp(cotangent), None, None, None, None, None, None)
  _, vjp = jax.vjp(attend, q, k_pages, v_pages)
  return (*vjp(cotangent), None, None, None, None)


_attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)


def _attend_in_place(config, return_lse, q, k_pages, v_pages, pages, kv_lengths, alibi, kv_descale):
  """The kernels read the pages through the page table (backends where BackendServesPagesInPlace, cpp/core/validate.h),
  FP8 pages as they are."""
  # Every sequence has Sq queries, so no q lengths are passed (a splat constant would be a broadcast kernel per call).
  out, lse = _sharding.forward(config, None, q, k_pages, v_pages, _primitives.no_lengths(), kv_lengths, alibi,
                               _primitives.no_sinks(), _primitives.no_tokens(), pages,
                               _primitives.no_kv_descale() if kv_descale is None else kv_descale,
                               _primitives.no_bias(), _primitives.no_dropout())
  return (out, lse) if return_lse else out


def _attend_gathered(config, return_lse, q, k_pages, v_pages, pages, kv_lengths, alibi, kv_descale, dtype=jnp.float32):
  """Each sequence's pages gathered into contiguous K/V (one XLA gather, of the page ids clamped into the pool as the
  kernels clamp them), then fused_attn's attention on them, with the paged call's configuration (its arguments are
  checked). FP8 pools are dequantized to `dtype` (kv_cache_compute_dtype): in float32 the call stays an FP8 one
  (AttentionConfig.fp8), in q's dtype it is a call in that dtype."""
  if kv_descale is not None:
    k_pages, v_pages = (dequantize_kv_operand(x, kv_descale, i, dtype) for i, x in enumerate((k_pages, v_pages)))
    config = dataclasses.replace(config, fp8=np.dtype(dtype) == np.float32)
    result = _attend_gathered(config, return_lse, q.astype(dtype), k_pages, v_pages, pages, kv_lengths, alibi, None)
    return (result[0].astype(q.dtype), result[1]) if return_lse else result.astype(q.dtype)
  batch, capacity = q.shape[0], pages.shape[1] * config.page_size
  pages = jnp.clip(pages, 0, k_pages.shape[0] - 1)
  gather = lambda pool: pool[pages].reshape(batch, capacity, *pool.shape[2:])
  out, lse = _attention(dataclasses.replace(config, page_size=0), None, q, gather(k_pages), gather(v_pages),
                        jnp.full((batch,), q.shape[1], jnp.int32), kv_lengths, alibi, _primitives.no_tokens(),
                        _primitives.no_bias(), _primitives.no_dropout(), None, ())
  return (out, lse) if return_lse else out


def _check_pools(q, k_pages, v_pages) -> tuple[int, int]:
  """The number of pages and the page size, once q's rank and the pools' ranks, dtypes and shapes are checked."""
  if q.ndim != 4:
    raise ValueError(f"q must have shape [B, Sq, H, D], got {tuple(q.shape)}")
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    if pages.ndim != 4:
      raise ValueError(f"{name} must have shape [num_pages, page_size, Hkv, D], got {tuple(pages.shape)}")
  if not (q.dtype == k_pages.dtype == v_pages.dtype or is_fp8(k_pages.dtype) and k_pages.dtype == v_pages.dtype):
    raise TypeError(f"q, k_pages and v_pages must share one dtype (or k_pages and v_pages one FP8 dtype), got "
                    f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
  if k_pages.shape[:3] != v_pages.shape[:3]:
    raise ValueError(f"k_pages and v_pages must agree on [num_pages, page_size, Hkv], got {tuple(k_pages.shape)} and "
                     f"{tuple(v_pages.shape)}")
  num_pages, page_size = k_pages.shape[:2]
  if page_size % 8 or not 8 <= page_size <= 256:
    raise ValueError(f"the page size (k_pages.shape[1]) must be a multiple of 8 from 8 to 256, got {page_size}")
  if num_pages == 0:
    raise ValueError("k_pages and v_pages hold no pages (num_pages = k_pages.shape[0] = 0): a paged KV cache needs a "
                     "pool of at least one page")
  return num_pages, page_size


def _page_operands(page_table, kv_lengths, batch: int, num_pages: int, page_size: int):
  """The page table and kv lengths as int32 operands, once their ranks, dtypes, shapes and (when concrete) values are
  checked."""
  page_table = _index_operand(page_table, "page_table", ndim=2)
  kv_lengths = _index_operand(kv_lengths, "kv_lengths", ndim=1)
  if page_table.shape[0] != batch or kv_lengths.shape != (batch,):
    raise ValueError(f"page_table must be [B, max_pages] and kv_lengths [B] with B = {batch} (q's batch), got "
                     f"{tuple(page_table.shape)} and {tuple(kv_lengths.shape)}")
  if not any(isinstance(x, jax.core.Tracer) for x in (page_table, kv_lengths)):
    _raise_if_out_of_range(np.asarray(page_table), np.asarray(kv_lengths), num_pages, page_size)
  # A traced id or length beyond int32 (x64 mode) stays out of range, so it poisons its sequence rather than wrapping
  # into range.
  return tuple(saturate_to_int32(jnp.asarray(x)) for x in (page_table, kv_lengths))


def _index_operand(x, name: str, ndim: int):
  """x as given (its values are checked, or saturated, before they become int32), once its rank and dtype are."""
  x = as_array(x, name, allow_sequence=True)
  if x.ndim != ndim:
    raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {x.dtype}")
  return x


def _raise_if_out_of_range(page_table, kv_lengths, num_pages: int, page_size: int) -> None:
  capacity = page_table.shape[1] * page_size
  bad_length = (kv_lengths < 0) | (kv_lengths > capacity)
  if bad_length.any():
    b = int(np.flatnonzero(bad_length)[0])
    raise ValueError(f"kv_lengths must lie in [0, {capacity}] (max_pages_per_seq x page_size), got {int(kv_lengths[b])} "
                     f"for sequence {b}")
  used = np.arange(page_table.shape[1])[None, :] * page_size < kv_lengths[:, None]
  bad_page = used & ((page_table < 0) | (page_table >= num_pages))
  if bad_page.any():
    b, j = (int(i) for i in np.argwhere(bad_page)[0])
    raise ValueError(f"page_table[{b}, {j}] = {int(page_table[b, j])} is not a page of the pool (0 .. {num_pages - 1}), "
                     f"and sequence {b} (kv_length {int(kv_lengths[b])}) uses it")
