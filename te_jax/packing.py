"""Packed sequences: segment ids and positions from document lengths, for fused_attn's q_segment_ids / q_positions.

A packed row holds documents back to back, then padding: with lengths [3, 2] and seqlen 7 the ids are
[1, 1, 1, 2, 2, 0, 0] and the positions [0, 1, 2, 0, 1, 0, 0]. A document of length 0 takes no token (its id is
skipped, so ids stay the document's index + 1); documents past seqlen are cut."""

from __future__ import annotations

import jax.numpy as jnp


def _document_of_token(lengths, seqlen: int):
  lengths = jnp.asarray(lengths)
  if lengths.ndim != 2:
    raise ValueError(f"lengths must have shape [B, N] (N documents per row), got {tuple(lengths.shape)}")
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(f"lengths must be an integer array, got {lengths.dtype}")
  lengths = jnp.maximum(lengths.astype(jnp.int32), 0)
  ends = jnp.cumsum(lengths, axis=-1)  # [B, N]
  token = jnp.arange(seqlen, dtype=jnp.int32)
  doc = jnp.sum(ends[:, None, :] <= token[None, :, None], axis=-1).astype(jnp.int32)  # [B, S]: documents before
  valid = token[None, :] < ends[:, -1:] if lengths.shape[1] else jnp.zeros((lengths.shape[0], seqlen), bool)
  return lengths, ends, token, doc, valid


def segment_ids_from_lengths(lengths, seqlen: int):
  """[B, N] document lengths -> int32 [B, seqlen] segment ids: document n's tokens get n + 1, tokens after the last
  document 0 (padding)."""
  _, _, _, doc, valid = _document_of_token(lengths, seqlen)
  return jnp.where(valid, doc + 1, 0).astype(jnp.int32)


def positions_from_lengths(lengths, seqlen: int):
  """[B, N] document lengths -> int32 [B, seqlen] positions: each token's index within its document, 0 after the last
  document."""
  lengths, ends, token, doc, valid = _document_of_token(lengths, seqlen)
  if lengths.shape[1] == 0:
    return jnp.zeros((lengths.shape[0], seqlen), jnp.int32)
  starts = ends - lengths
  start = jnp.take_along_axis(starts, jnp.minimum(doc, lengths.shape[1] - 1), axis=-1)
  return jnp.where(valid, token[None, :] - start, 0).astype(jnp.int32)
