"""The CPU forward's packed tiles for decode shapes (fewer than 64 query positions with GQA/MQA: the query heads of a
K/V group times the positions share one tile, cpp/cpu/query_rows.h): fused_attn forward and gradients against the
float64 reference on both custom-call paths (the forwards bitwise equal) for Sq 1..63, GQA ratios 1..8 (3 and 6
too), MQA with many heads (a group over several tiles), ragged lengths including 0, masks, windows, soft-cap, ALiBi,
lse, D != Dv and every dtype; paged K/V through te_jax.paged_attention against the reference and bitwise against
fused_attn over the gathered pages; the same bits whatever the size of XLA's thread pool, which sets how a group's
rows are cut into tiles; and, without a left window, the bits of the unpacked tiles."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import (Case, assert_bitwise_equal, assert_same_bits_with_pools_of, attn_kwargs, check_against_reference,
                     check_both_paths, make_inputs, reference, run_on_path)
from te_jax.reference import attention_reference

# 150 keys: two KV tiles of the kernels (128), the second partial. Bottom-right causal: the queries are the last ones.
DECODE = Case(batch=3, seqlen_q=1, seqlen_kv=150, heads=8, kv_heads=2, head_dim=32, mask="causal_bottom_right")

F32_CASES = [
    # Sq x GQA ratio (heads / kv_heads): 1, 2, 3, 4, 6, 8.
    *(DECODE.replace(seqlen_q=sq, heads=h, kv_heads=hkv)
      for sq, h, hkv in ((1, 4, 4), (1, 4, 2), (2, 6, 2), (3, 8, 2), (5, 12, 2), (8, 8, 1), (16, 6, 1), (16, 16, 4))),
    # MQA with many heads: a group's 32 * Sq rows take several tiles (the last partial).
    DECODE.replace(seqlen_q=3, heads=32, kv_heads=1),
    DECODE.replace(seqlen_q=1, heads=40, kv_heads=1, alibi="h"),
    # The rule's edges: 63 positions are packed (3 heads: 189 rows, 3 tiles), 64 are not.
    DECODE.replace(seqlen_q=63, seqlen_kv=200, heads=3, kv_heads=1),
    DECODE.replace(seqlen_q=64, seqlen_kv=200, heads=6, kv_heads=2),
    # Ragged lengths, kv length 0, q length 0, and a kv length below the q length (its first rows see nothing).
    DECODE.replace(seqlen_q=4, mask="padding_causal_bottom_right", q_seqlens=(4, 2, 4), kv_seqlens=(150, 0, 3)),
    DECODE.replace(seqlen_q=7, heads=6, kv_heads=2, mask="padding_causal_bottom_right", q_seqlens=(0, 7, 5),
                   kv_seqlens=(40, 129, 128)),
    DECODE.replace(seqlen_q=2, heads=12, kv_heads=2, mask="padding", q_seqlens=(2, 1, 0), kv_seqlens=(0, 150, 77)),
    # Top-left masks (each position sees a different number of keys) and no mask.
    DECODE.replace(seqlen_q=16, mask="causal"),
    DECODE.replace(seqlen_q=5, heads=6, kv_heads=2, mask="no_mask"),
    # Windows: the rows' key ranges start inside a KV tile (the packed tiles cut the keys at multiples of 128).
    DECODE.replace(seqlen_q=4, window=(20, 0)),
    DECODE.replace(seqlen_q=9, heads=6, kv_heads=1, seqlen_kv=300, window=(140, 0)),
    DECODE.replace(seqlen_q=16, heads=12, kv_heads=4, mask="no_mask", window=(5, 3)),
    DECODE.replace(seqlen_q=3, mask="causal", window=(0, 0)),
    # Soft-cap, ALiBi ([H] and [B, H]: each row its head's slope) and both, lse with its own cotangent.
    DECODE.replace(seqlen_q=2, softcap=2.0, scale=0.5),
    DECODE.replace(seqlen_q=6, heads=12, kv_heads=2, alibi="bh"),
    DECODE.replace(seqlen_q=3, heads=6, kv_heads=1, alibi="h", softcap=3.0, window=(30, 0), with_dlse=True),
    DECODE.replace(seqlen_q=1, heads=8, kv_heads=1, with_dlse=True),
    DECODE.replace(seqlen_q=4, return_lse=False),
    # D != Dv.
    DECODE.replace(seqlen_q=2, head_dim=32, head_dim_v=16),
    DECODE.replace(seqlen_q=5, heads=6, kv_heads=2, head_dim=16, head_dim_v=64, alibi="h"),
]

LOW_PRECISION_BASES = [
    DECODE.replace(seqlen_q=1, heads=8, kv_heads=1),
    DECODE.replace(seqlen_q=3, heads=6, kv_heads=2, alibi="bh", softcap=2.0, scale=0.5),
    DECODE.replace(seqlen_q=16, heads=12, kv_heads=2, mask="padding_causal_bottom_right", q_seqlens=(16, 3, 16),
                   kv_seqlens=(150, 0, 10), window=(40, 0)),
    DECODE.replace(seqlen_q=5, heads=32, kv_heads=1, head_dim=16, head_dim_v=32),
]
LOW_PRECISION_CASES = [c.replace(dtype=dt) for dt in ("bfloat16", "float16") for c in LOW_PRECISION_BASES]


@pytest.mark.parametrize("case", F32_CASES + LOW_PRECISION_CASES, ids=Case.id)
def test_decode_shapes_match_reference(case):
  # The forward's bits; the default backward sums dq over the two KV tiles in an order that follows the threads.
  check_both_paths(case, bitwise=("out", "lse"))


def _paged_inputs(seed, *, b, sq, h, hkv, d, dv, page_size, max_pages, dtype):
  """Shuffled pages with spares in the pool, a shared first page, ragged lengths (one 0, one shorter than Sq)."""
  rng = np.random.default_rng(seed)
  num_pages = b * max_pages + 2
  cast = lambda x: np.asarray(jnp.asarray(x, dtype))
  q = cast(rng.standard_normal((b, sq, h, d)))
  k_pages = cast(rng.standard_normal((num_pages, page_size, hkv, d)))
  v_pages = cast(rng.standard_normal((num_pages, page_size, hkv, dv)))
  table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  table[1, 0] = table[0, 0]
  lengths = rng.integers(1, max_pages * page_size + 1, size=b).astype(np.int32)
  lengths[2] = 0
  lengths[3] = max(sq - 1, 0)
  alibi = rng.uniform(0.01, 0.3, size=(b, h)).astype(np.float32)
  return (q, k_pages, v_pages, table, lengths), alibi


PAGED = [
    # id, sq, h, hkv, d, dv, page_size, max_pages, mask, extra, dtype
    ("gqa3_sq1_p16", 1, 6, 2, 32, 32, 16, 12, "causal_bottom_right", {}, "float32"),
    ("gqa6_sq4_p8_window_alibi", 4, 12, 2, 16, 16, 8, 24, "causal_bottom_right",
     dict(window_size=(50, 0), alibi=True), "bfloat16"),
    ("mqa32_sq2_p64_softcap", 2, 32, 1, 32, 32, 64, 4, "causal_bottom_right", dict(softcap=3.0), "float16"),
    ("gqa8_sq16_p24_nomask_dv", 16, 8, 1, 16, 32, 24, 8, "no_mask", {}, "float32"),
    # Four rows: the keys-in-lanes scores (key_lane_scores.h) over page runs of 16 + 8 keys and d = 4 x 16 + 8.
    ("gqa4_sq1_p24_d72", 1, 8, 2, 72, 72, 24, 6, "causal_bottom_right", {}, "float32"),
]


@pytest.mark.parametrize("case", PAGED, ids=[c[0] for c in PAGED])
def test_paged_decode_matches_reference_and_gathered(case, path):
  name, sq, h, hkv, d, dv, page_size, max_pages, mask, extra, dtype = case
  args, alibi = _paged_inputs(len(name), b=5, sq=sq, h=h, hkv=hkv, d=d, dv=dv, page_size=page_size,
                              max_pages=max_pages, dtype=getattr(jnp, dtype))
  kwargs = {key: val for key, val in extra.items() if key != "alibi"}
  if extra.get("alibi"):
    kwargs["alibi_slopes"] = alibi
  q, k_pages, v_pages, table, lengths = args
  b, capacity = table.shape[0], table.shape[1] * page_size
  padding_mask = {"causal_bottom_right": "padding_causal_bottom_right", "no_mask": "padding"}[mask]

  def gathered(q, k_pages, v_pages):
    gather = lambda pool: pool[table].reshape(b, capacity, *pool.shape[2:])
    return te_jax.fused_attn(q, gather(k_pages), gather(v_pages), mask_type=padding_mask,
                             q_seqlens=np.full(b, sq, np.int32), kv_seqlens=lengths, return_lse=True, **kwargs)

  with te_jax.custom_call_path(path):
    paged = jax.jit(lambda *a: te_jax.paged_attention(*a, mask_type=mask, return_lse=True, **kwargs))
    out, lse = (np.asarray(x) for x in paged(*args))
    want_out, want_lse = (np.asarray(x) for x in jax.jit(gathered)(q, k_pages, v_pages))
  te_jax.raise_legacy_failures()
  assert out.tobytes() == want_out.tobytes()
  assert lse.tobytes() == want_lse.tobytes()
  k = np.asarray(k_pages, np.float64)[table].reshape(b, capacity, hkv, d)
  v = np.asarray(v_pages, np.float64)[table].reshape(b, capacity, hkv, dv)
  ref = attention_reference(np.asarray(q, np.float64), k, v, mask_type=padding_mask, q_seqlens=np.full(b, sq),
                            kv_seqlens=lengths, **kwargs)
  tol = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}[dtype]
  np.testing.assert_allclose(out.astype(np.float64), ref["out"], rtol=tol, atol=tol)
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(lse), finite)
  np.testing.assert_allclose(lse[finite], ref["lse"][finite], rtol=tol, atol=tol)


# Cases whose packed tiles differ with the thread count: a group's rows are cut into enough tiles for every thread
# (24 heads x 2 positions: one tile of 48 rows with 1 thread, 2 of 24 with 2, 3 of 16 with 5), and windows of more
# than a KV tile's keys start the rows at different keys, so tiles cut at their first visible key would cut a row's
# keys differently in each. Deterministic, so that the backward's bits, which these runs compare too, do not follow
# the threads either.
THREAD_CASES = [
    Case(batch=1, seqlen_q=2, seqlen_kv=400, heads=24, kv_heads=1, head_dim=16, mask="causal_bottom_right",
         window=(200, 0), alibi="h", deterministic=True),
    Case(batch=1, seqlen_q=5, seqlen_kv=260, heads=12, kv_heads=1, head_dim=16, mask="causal_bottom_right",
         window=(150, 0), softcap=2.0, dtype="bfloat16", deterministic=True),
]

@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts XLA's pool threads in /proc")
def test_packed_forward_is_independent_of_thread_count(tmp_path):
  """The packed tiles cut the keys at multiples of the KV tile, so a row's bits do not depend on which rows share its
  tile: the FFI path with XLA pools of 1 and 5 threads (subprocesses) agrees bitwise with both paths here."""
  def run_here():
    here = {}
    for path in ("ffi", "legacy"):
      here[path] = []
      for case in THREAD_CASES:
        inputs = make_inputs(case)
        got = run_on_path(case, inputs, path)
        check_against_reference(case, inputs, got, reference(case, inputs))
        here[path].append(got)
    return here

  assert_same_bits_with_pools_of((1, 5), "test_cpu_decode", "THREAD_CASES", run_here, tmp_path)


# Without a left window the packed tiles cut every row's keys where the unpacked ones do (at multiples of the KV tile
# from key 0), so the packed rows give the same bits. A zero bias keeps a call on the unpacked tiles (the packed ones
# take no bias) and adds exact zeros to its logits.
SAME_BITS_CASES = [
    DECODE.replace(seqlen_q=1, heads=32, kv_heads=8),
    DECODE.replace(seqlen_q=6, heads=12, kv_heads=4, alibi="bh", softcap=2.0, scale=0.5),
    DECODE.replace(seqlen_q=3, heads=40, kv_heads=1, mask="padding_causal_bottom_right", q_seqlens=(3, 1, 3),
                   kv_seqlens=(150, 0, 2), dtype="bfloat16"),
    DECODE.replace(seqlen_q=16, heads=6, kv_heads=2, mask="causal", window=(-1, 2), head_dim_v=16, dtype="float16"),
    # Unpacked tiles of 2 rows take the keys-in-lanes scores (key_lane_scores.h), the packed tiles of 16 TileGemm's:
    # d = 72 and 300 keys leave partial blocks of the transpose.
    DECODE.replace(seqlen_q=2, heads=16, kv_heads=2, head_dim=72, seqlen_kv=300),
]


@pytest.mark.parametrize("case", SAME_BITS_CASES, ids=Case.id)
def test_packed_rows_give_the_unpacked_bits(case):
  inputs = make_inputs(case)
  kw = attn_kwargs(case, inputs)
  f = jax.jit(lambda q, k, v, bias: te_jax.fused_attn(q, k, v, bias=bias, **kw))
  packed = f(inputs.q, inputs.k, inputs.v, None)
  unpacked = f(inputs.q, inputs.k, inputs.v, jnp.zeros((1, 1, 1, case.seqlen_kv), jnp.float32))
  assert_bitwise_equal({"out": np.asarray(packed[0]), "lse": np.asarray(packed[1])},
                       {"out": np.asarray(unpacked[0]), "lse": np.asarray(unpacked[1])}, what="packed vs unpacked")
