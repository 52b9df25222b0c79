"""Packed sequences: segment ids and positions from document lengths, for fused_attn's q_segment_ids / q_positions,
or from the cumulative offsets (cu_seqlens) of FlashAttention's and TransformerEngine's variable-length layout.

A packed row holds documents back to back, then padding: with lengths [3, 2] and seqlen 7 the ids are
[1, 1, 1, 2, 2, 0, 0] and the positions [0, 1, 2, 0, 1, 0, 0]. A document of length 0 takes no token (its id is
skipped, so ids stay the document's index + 1); documents past seqlen are cut."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.arguments import as_array, is_int


def _document_of_token(lengths, seqlen: int):
  if not is_int(seqlen):
    raise TypeError(f"seqlen must be an int, got {seqlen!r}")
  if not 0 <= seqlen < 2**30:
    raise ValueError(f"seqlen must lie in [0, 2**30), got {seqlen}")
  lengths = as_array(lengths, "lengths", allow_sequence=True)
  if lengths.ndim != 2:
    raise ValueError(f"lengths must have shape [B, N] (N documents per row), got {tuple(lengths.shape)}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"lengths must be an integer array, got {lengths.dtype}")
  # Each length clamped to [0, seqlen] in its own type before it becomes int32 (a document cannot take more than the
  # row), and the running ends saturated at seqlen: no length or sum wraps around into a small value.
  clip = np.clip if isinstance(lengths, np.ndarray) else jnp.clip
  lengths = jnp.asarray(clip(lengths, 0, seqlen)).astype(jnp.int32)
  ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, seqlen), lengths, axis=-1)  # [B, N]
  token = jnp.arange(seqlen, dtype=jnp.int32)
  doc = jnp.sum(ends[:, None, :] <= token[None, :, None], axis=-1).astype(jnp.int32)  # [B, S]: documents before
  valid = token[None, :] < ends[:, -1:] if lengths.shape[1] else jnp.zeros((lengths.shape[0], seqlen), bool)
  return ends, token, doc, valid


def segment_ids_from_lengths(lengths, seqlen: int):
  """[B, N] document lengths -> int32 [B, seqlen] segment ids: document n's tokens get n + 1, tokens after the last
  document 0 (padding)."""
  _, _, doc, valid = _document_of_token(lengths, seqlen)
  return jnp.where(valid, doc + 1, 0).astype(jnp.int32)


def positions_from_lengths(lengths, seqlen: int):
  """[B, N] document lengths -> int32 [B, seqlen] positions: each token's index within its document, 0 after the last
  document."""
  ends, token, doc, valid = _document_of_token(lengths, seqlen)
  if ends.shape[1] == 0:
    return jnp.zeros((ends.shape[0], seqlen), jnp.int32)
  starts = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=-1)
  start = jnp.take_along_axis(starts, jnp.minimum(doc, ends.shape[1] - 1), axis=-1)
  return jnp.where(valid, token[None, :] - start, 0).astype(jnp.int32)


def _cu_seqlens_lengths(cu_seqlens):
  """[N + 1] cumulative document offsets -> [1, N] lengths (one packed row)."""
  cu_seqlens = as_array(cu_seqlens, "cu_seqlens", allow_sequence=True)
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
    raise ValueError(f"cu_seqlens must have shape [N + 1] (the offsets of N documents, from 0), got "
                     f"{tuple(cu_seqlens.shape)}")
  if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
    raise TypeError(f"cu_seqlens must be an integer array, got {cu_seqlens.dtype}")
  if not isinstance(cu_seqlens, jax.core.Tracer):
    values = np.asarray(cu_seqlens)
    if values[0] != 0 or np.any(np.diff(values) < 0):
      raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {values.tolist()}")
  cu_seqlens = jnp.asarray(cu_seqlens)
  return (cu_seqlens[1:] - cu_seqlens[:-1])[None, :]


def segment_ids_from_cu_seqlens(cu_seqlens, total: int):
  """[N + 1] cumulative offsets of N documents packed back to back (FlashAttention's varlen `cu_seqlens`) -> int32
  [1, total] segment ids of the packed row: document n's tokens get n + 1, tokens from cu_seqlens[-1] on 0 (padding).
  The varlen tensors [total, H, D] become fused_attn's q, k, v with a batch of one: `x[None]`."""
  return segment_ids_from_lengths(_cu_seqlens_lengths(cu_seqlens), total)


def positions_from_cu_seqlens(cu_seqlens, total: int):
  """[N + 1] cumulative offsets -> int32 [1, total] positions: each token's index within its document, 0 after the
  last document."""
  return positions_from_lengths(_cu_seqlens_lengths(cu_seqlens), total)
