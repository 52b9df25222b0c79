"""A paged KV cache built from contiguous K/V, for the te_jax-paged backends: every sequence's keys and values cut into
pages, the pages of all sequences shuffled through one pool by a fixed permutation (as a serving system's allocator
leaves them), and the page table that finds them again. Built in setup, on the host, never timed."""

from __future__ import annotations

import dataclasses

import numpy as np

PERMUTATION_SEED = 17  # fixed: every run and every process shuffles the pool alike


@dataclasses.dataclass(frozen=True)
class PagedKV:
  k_pages: np.ndarray  # [num_pages, page_size, Hkv, D]
  v_pages: np.ndarray  # [num_pages, page_size, Hkv, Dv]
  page_table: np.ndarray  # int32 [B, Skv / page_size]: sequence b's pages in order
  kv_lengths: np.ndarray  # int32 [B]


def paged_layout(k: np.ndarray, v: np.ndarray, page_size: int) -> PagedKV:
  """k [B, Skv, Hkv, D] and v [B, Skv, Hkv, Dv] as a shuffled page pool; Skv must be a multiple of page_size."""
  batch, seq_kv = k.shape[:2]
  if seq_kv % page_size:
    raise ValueError(f"Skv ({seq_kv}) must be a multiple of the page size ({page_size})")
  pages_per_seq = seq_kv // page_size
  num_pages = batch * pages_per_seq
  # Pool slot s holds page shuffle[s] of the contiguous order (sequence b's page j is b * pages_per_seq + j); the page
  # table is the inverse: where each contiguous page went.
  shuffle = np.random.default_rng(PERMUTATION_SEED).permutation(num_pages)
  slot_of_page = np.empty(num_pages, np.int32)
  slot_of_page[shuffle] = np.arange(num_pages, dtype=np.int32)
  pool = lambda x: x.reshape(num_pages, page_size, *x.shape[2:])[shuffle]
  return PagedKV(pool(k), pool(v), slot_of_page.reshape(batch, pages_per_seq), np.full(batch, seq_kv, np.int32))

