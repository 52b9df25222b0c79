"""The CPU forward reads float32 K/V rows where they lie or from a compact copy (cpp/cpu/key_rows.h: with AVX2's
products, a copy when a tile's products read its rows several times and the rows are a 4 KB page or more apart; with
AVX-512's always in place; a paged call's rows in place page run by page run). The same values in the same order
either way, so the same bits: a call whose rows are 4 KB apart (8 K/V heads of d 128) against each K/V head alone
(512 B apart), decode, packed and prefill tiles (on an AVX-512 CPU again in a subprocess capped at AVX2, where the
rows are copied); and a paged call read in place in page runs against the gathered pages, with a NaN in V that only
some rows of a tile see (the products then go key by key, run by run). Against the float64 reference too."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import tolerance
from te_jax.reference import attention_reference


def _per_kv_head(q, k, v, **kwargs):
  """fused_attn of each K/V head and its query heads alone, put back together (out [B, Sq, H, Dv], lse [B, H, Sq])."""
  group = q.shape[2] // k.shape[2]
  parts = [te_jax.fused_attn(q[:, :, j * group:(j + 1) * group], k[:, :, j:j + 1], v[:, :, j:j + 1], return_lse=True,
                             **kwargs) for j in range(k.shape[2])]
  return jnp.concatenate([o for o, _ in parts], axis=2), jnp.concatenate([l for _, l in parts], axis=1)


# Sq 1: a decode tile (4 rows, read once: in place either way); 16: a packed tile of 64 rows; 150: prefill tiles.
@pytest.mark.parametrize("seqlen_q", [1, 16, 150])
def test_copied_rows_give_the_bits_of_rows_read_in_place(seqlen_q):
  rng = np.random.default_rng(seqlen_q)
  b, h, hkv, d, skv = 2, 32, 8, 128, 300
  q = rng.standard_normal((b, seqlen_q, h, d)).astype(np.float32)
  k, v = (rng.standard_normal((b, skv, hkv, d)).astype(np.float32) for _ in range(2))
  kwargs = dict(mask_type="causal_bottom_right")
  out, lse = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **kwargs))(q, k, v)
  want_out, want_lse = jax.jit(lambda q, k, v: _per_kv_head(q, k, v, **kwargs))(q, k, v)
  assert np.asarray(out).tobytes() == np.asarray(want_out).tobytes()
  assert np.asarray(lse).tobytes() == np.asarray(want_lse).tobytes()
  ref = attention_reference(*(x.astype(np.float64) for x in (q, k, v)), mask_type="causal_bottom_right")
  np.testing.assert_allclose(np.asarray(out, np.float64), ref["out"], rtol=tolerance("float32"),
                             atol=tolerance("float32"))


@pytest.mark.skipif(te_jax.cpu_isa() != "avx512", reason="below AVX-512 the test above runs the copies in process")
def test_copied_rows_give_the_bits_of_rows_read_in_place_under_avx2():
  env = dict(os.environ, JAX_PLATFORMS="cpu", TE_JAX_CPU_ISA="avx2")
  test = f"{__file__}::test_copied_rows_give_the_bits_of_rows_read_in_place"
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env,
                        cwd=os.path.dirname(__file__), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_paged_rows_in_page_runs_with_a_nan_value_give_the_gathered_bits():
  rng = np.random.default_rng(7)
  b, sq, h, hkv, d, page, max_pages = 2, 7, 4, 2, 16, 8, 24
  num_pages = b * max_pages + 3
  q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
  k_pages, v_pages = (rng.standard_normal((num_pages, page, hkv, d)).astype(np.float32) for _ in range(2))
  table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  lengths = np.asarray([max_pages * page, 150], np.int32)
  # Key 100 of entry 0: the window (90 keys back) shows it to every row but the last, so the rows of its tile see
  # different keys and, V holding a NaN, the tile's products go key by key (AddVisibleProducts), page run by page run.
  v_pages[table[0, 100 // page], 100 % page, 1, 3] = np.nan
  kwargs = dict(mask_type="causal_bottom_right", window_size=(90, 0))
  out, lse = jax.jit(lambda *a: te_jax.paged_attention(*a, return_lse=True, **kwargs))(q, k_pages, v_pages, table,
                                                                                        lengths)
  capacity = max_pages * page
  k, v = (pool[table].reshape(b, capacity, hkv, d) for pool in (k_pages, v_pages))
  padded = dict(kwargs, mask_type="padding_causal_bottom_right", q_seqlens=np.full(b, sq, np.int32),
                kv_seqlens=lengths)
  want_out, want_lse = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **padded))(q, k, v)
  assert np.asarray(out).tobytes() == np.asarray(want_out).tobytes()
  assert np.asarray(lse).tobytes() == np.asarray(want_lse).tobytes()
  ref = attention_reference(*(x.astype(np.float64) for x in (q, k, v)), **padded)
  out = np.asarray(out, np.float64)
  # The NaN reaches exactly the outputs the formula puts it in: the rows of K/V head 1 that see key 100, column 3.
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref["out"]))
  assert np.isnan(out[0, :, 2:, 3]).any() and not np.isnan(out[0, :, 2:, 3]).all()
  finite = ~np.isnan(ref["out"])
  np.testing.assert_allclose(out[finite], ref["out"][finite], rtol=tolerance("float32"), atol=tolerance("float32"))
