"""Attention over a paged KV cache: each sequence's keys and values live in fixed-size pages of a shared pool, listed in
order by its row of the page table (vLLM's and FlashInfer's layout).

Today the pages a call needs are gathered into contiguous K/V with one XLA gather, then fused_attn runs with the
sequence lengths as kv_seqlens. The gather costs one extra read and write of the gathered K/V per call (the kernels
reading pages in place are the next step, docs/ARCHITECTURE.md); the API stays when they come."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.attention import fused_attn
from te_jax.mask_type import MaskType

# Queries sit at the end of their sequence: "causal_bottom_right" lets query i of Sq see the keys up to position
# kv_length - Sq + i; "no_mask" lets every query see all kv_length keys. Each maps to the padding variant of fused_attn.
_MASKS = {MaskType.CAUSAL_BOTTOM_RIGHT: "padding_causal_bottom_right", MaskType.NO_MASK: "padding"}


def paged_attention(q, k_pages, v_pages, page_table, kv_lengths, *, mask_type="causal_bottom_right",
                    window_size=(-1, -1), scale=None, softcap=0.0, alibi_slopes=None, return_lse=False, engine=None):
  """Attention of q over a paged KV cache.

  Args:
    q: [B, Sq, H, D], the newest Sq tokens of each sequence (Sq = 1 when decoding).
    k_pages, v_pages: [num_pages, page_size, Hkv, D] / [..., Dv], the page pool; page_size a multiple of 8 up to 256.
    page_table: int32 [B, max_pages_per_seq]: row b lists the pages of sequence b in order; entries past the
      sequence's last page are never read (any value).
    kv_lengths: int32 [B], the tokens in each sequence's cache (its queries included), 0 .. max_pages * page_size.
    mask_type: "causal_bottom_right" (default: query i sees keys up to kv_length - Sq + i) or "no_mask" (every key of
      the sequence).
    window_size, scale, softcap, alibi_slopes, return_lse, engine: as in te_jax.fused_attn.

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
  q, k_pages, v_pages = (jnp.asarray(x) for x in (q, k_pages, v_pages))
  if q.ndim != 4:
    raise ValueError(f"q must have shape [B, Sq, H, D], got {tuple(q.shape)}")
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    if pages.ndim != 4:
      raise ValueError(f"{name} must have shape [num_pages, page_size, Hkv, D], got {tuple(pages.shape)}")
  if k_pages.shape[:3] != v_pages.shape[:3]:
    raise ValueError(f"k_pages and v_pages must agree on [num_pages, page_size, Hkv], got {tuple(k_pages.shape)} and "
                     f"{tuple(v_pages.shape)}")
  num_pages, page_size = k_pages.shape[:2]
  if page_size % 8 or not 8 <= page_size <= 256:
    raise ValueError(f"the page size (k_pages.shape[1]) must be a multiple of 8 from 8 to 256, got {page_size}")
  batch = q.shape[0]
  page_table = _int32_operand(page_table, "page_table", ndim=2)
  kv_lengths = _int32_operand(kv_lengths, "kv_lengths", ndim=1)
  if page_table.shape[0] != batch or kv_lengths.shape != (batch,):
    raise ValueError(f"page_table must be [B, max_pages] and kv_lengths [B] with B = {batch} (q's batch), got "
                     f"{tuple(page_table.shape)} and {tuple(kv_lengths.shape)}")
  max_pages = page_table.shape[1]
  capacity = max_pages * page_size
  used = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size < kv_lengths[:, None]  # [B, max_pages]
  bad_page = used & ((page_table < 0) | (page_table >= num_pages))
  bad_length = (kv_lengths < 0) | (kv_lengths > capacity)
  if not any(isinstance(x, jax.core.Tracer) for x in (page_table, kv_lengths)):
    _raise_if_out_of_range(np.asarray(bad_page), np.asarray(bad_length), np.asarray(page_table),
                           np.asarray(kv_lengths), num_pages, capacity)
  # Clamped, so the gather never leaves the pool; the entries that needed clamping are poisoned below.
  pages = jnp.clip(page_table, 0, max(num_pages - 1, 0))
  gather = lambda pool: pool[pages].reshape(batch, capacity, *pool.shape[2:])
  result = fused_attn(q, gather(k_pages), gather(v_pages), mask_type=_MASKS[mask],
                      q_seqlens=jnp.full((batch,), q.shape[1], jnp.int32),
                      kv_seqlens=jnp.clip(kv_lengths, 0, capacity), window_size=window_size, scale=scale,
                      softcap=softcap, alibi_slopes=alibi_slopes, return_lse=return_lse, engine=engine)
  bad = jnp.any(bad_page, axis=1) | bad_length  # [B]
  # A factor, not a select: the gradients of a poisoned entry are NaN too.
  poison = lambda x, shape: x * jnp.where(bad, jnp.nan, 1.0).astype(x.dtype).reshape(shape)
  if return_lse:
    out, lse = result
    return poison(out, (batch, 1, 1, 1)), poison(lse, (batch, 1, 1))
  return poison(result, (batch, 1, 1, 1))


def _int32_operand(x, name: str, ndim: int):
  x = jnp.asarray(x)
  if x.ndim != ndim:
    raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array, got {x.dtype}")
  return x.astype(jnp.int32)


def _raise_if_out_of_range(bad_page, bad_length, page_table, kv_lengths, num_pages: int, capacity: int) -> None:
  if bad_length.any():
    b = int(np.flatnonzero(bad_length)[0])
    raise ValueError(f"kv_lengths must lie in [0, {capacity}] (max_pages_per_seq x page_size), got {int(kv_lengths[b])} "
                     f"for sequence {b}")
  if bad_page.any():
    b, j = (int(i) for i in np.argwhere(bad_page)[0])
    raise ValueError(f"page_table[{b}, {j}] = {int(page_table[b, j])} is not a page of the pool (0 .. {num_pages - 1}), "
                     f"and sequence {b} (kv_length {int(kv_lengths[b])}) uses it")
