"""GPU tests of the decode kernels (cpp/cuda/kernels/decode/: calls with at most 16 query positions): out, lse and the
gradients against the float64 reference for GQA packings of 1-80 heads, 1-16 positions, split-KV, every mask and
variant, ragged lengths; FFI and legacy bitwise equal; 20 runs bitwise equal; non-finite inputs follow the formula
(also across splits and the warps' key slices); invalid run-time lengths give NaN. Skipped without a GPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

# The CUDA tests' GPU list (importing it skips this module without a GPU, as it skips its own), inputs, runner and
# reference check, shared so both files hold every case to the same bounds.
from test_cuda_attention import (TOL, _check_against_reference, _inputs, _rel,  # noqa: E402
                                 _run_on_both_paths, _run_with_one_nonfinite)

import te_jax  # noqa: E402
from te_jax._cuda_test_configs import DECODE_CASES  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402


@pytest.mark.parametrize("case", DECODE_CASES, ids=[c[0] for c in DECODE_CASES])
def test_decode_matches_reference_and_paths_agree(case):
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=zlib.crc32(case[0].encode()))
  kwargs.update(engine="te")
  ffi, _ = _run_on_both_paths(q, k, v, kwargs, dout, dlse)
  errors = _check_against_reference(case, ffi, q, k, v, kwargs, dout, dlse)
  print(f"{case[0]}: " + " ".join(f"{key}={val:.2e}" for key, val in errors.items()))


def test_decode_is_bitwise_reproducible():
  """20 back-to-back decode steps over many splits give the same bits (the combine's order is fixed)."""
  case = DECODE_CASES[-1]
  q, k, v, _, _, _ = _inputs(case, seed=3)
  f = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal_bottom_right", return_lse=True,
                                                engine="te"))
  first = [np.asarray(x) for x in f(q, k, v)]
  for _ in range(19):
    for a, b in zip(first, f(q, k, v)):
      assert np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))


# One non-finite value: (id, tensor, index). b 2, Sq 16, Skv 700, h 8 / kv 2, bottom-right causal: the last 15 keys are
# seen by the later positions only, so their tile straddles the rows' range edges; 700 keys make several splits.
DECODE_NONFINITE = [
    ("nan_v_seen_by_later_positions", "v", (0, 690, 1, 4), np.nan),
    ("inf_v_seen_by_later_positions", "v", (1, 695, 0, 0), np.inf),
    ("nan_k_seen_by_later_positions", "k", (0, 699, 1, 3), np.nan),
    ("nan_v_early_split", "v", (1, 10, 1, 7), np.nan),
    ("nan_q", "q", (0, 5, 3, 2), np.nan),
]


@pytest.mark.parametrize("name,tensor,index,value", DECODE_NONFINITE, ids=[c[0] for c in DECODE_NONFINITE])
def test_decode_nonfinite_inputs_follow_the_formula(name, tensor, index, value):
  x, out, lse = _run_with_one_nonfinite(dict(q=(2, 16, 8, 128), k=(2, 700, 2, 128), v=(2, 700, 2, 128)), tensor,
                                        index, value, "causal_bottom_right", "te", seed=2)
  ref = attention_reference(x["q"], x["k"], x["v"], mask_type="causal_bottom_right")
  bad = ~np.isfinite(ref["out"])
  assert bad.any() and not bad.all()
  assert np.array_equal(np.isnan(lse), np.isnan(ref["lse"]))
  assert np.array_equal(~np.isfinite(out), bad), "non-finite outputs differ from the formula's"
  assert _rel(out[~bad], ref["out"][~bad]) < TOL["bfloat16"]["out"]


def test_decode_invalid_runtime_seqlens_give_nan():
  """Traced lengths outside [0, S] give NaN in every output of their batch entry, with one split and with many."""
  rng = np.random.default_rng(4)
  for skv in (64, 5000):
    q = jnp.asarray(rng.standard_normal((3, 2, 4, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((3, skv, 1, 64)), jnp.bfloat16) for _ in range(2))
    qs = jnp.asarray([2, 3, 1], jnp.int32)
    ks = jnp.asarray([skv, 7, skv + 1], jnp.int32)
    f = jax.jit(lambda q, k, v, qs, ks: te_jax.fused_attn(q, k, v, mask_type="padding_causal_bottom_right",
                                                          q_seqlens=qs, kv_seqlens=ks, return_lse=True, engine="te"))
    out, lse = (np.asarray(t, np.float32) for t in f(q, k, v, qs, ks))
    for name, x in (("out", out), ("lse", lse)):
      assert np.isnan(x[1]).all() and np.isnan(x[2]).all(), f"{name} of the invalid batches is not all NaN"
      assert not np.isnan(x[0]).any(), f"{name} of the valid batch has NaN"


def test_decode_ignores_nonfinite_cache_rows_past_the_lengths():
  """A KV cache whose rows past each sequence's length hold NaN and inf (never written): the keys no row sees never
  affect it, also where the copies read those rows with the tile (TMA copies whole 64-row boxes) and across splits."""
  rng = np.random.default_rng(5)
  for skv, lengths in ((300, [1, 130, 257]), (9000, [8999, 4100, 70])):
    q = rng.standard_normal((3, 4, 8, 128)).astype(np.float32)
    k, v = (rng.standard_normal((3, skv, 2, 128)).astype(np.float32) for _ in range(2))
    for i, n in enumerate(lengths):
      k[i, n:] = np.nan
      v[i, n:: 2] = np.inf
      v[i, n + 1:: 2] = np.nan
    qs = jnp.asarray([4, 4, 4], jnp.int32)
    ks = jnp.asarray(lengths, jnp.int32)
    f = jax.jit(lambda q, k, v, ks: te_jax.fused_attn(q, k, v, mask_type="padding_causal_bottom_right", q_seqlens=qs,
                                                      kv_seqlens=ks, return_lse=True, engine="te"))
    out, lse = (np.asarray(t, np.float32) for t in f(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), ks))
    assert np.isfinite(out).all() and not np.isnan(lse).any(), f"skv {skv}: a row saw a key past its length"
    bf = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) for x in (q, k, v)]
    ref = attention_reference(*bf, mask_type="padding_causal_bottom_right", q_seqlens=np.asarray(qs),
                              kv_seqlens=np.asarray(lengths))
    assert _rel(out, ref["out"]) < TOL["bfloat16"]["out"], f"skv {skv}"
    assert np.array_equal(np.isinf(lse), np.isinf(ref["lse"])), f"skv {skv}: rows without keys differ"


# Paged KV caches read in place by the decode kernels: (page_size, b, sq, h, hkv, d, mask).
PAGED = [
    (16, 3, 1, 8, 2, 128, "causal_bottom_right"),
    (64, 2, 16, 8, 2, 128, "causal_bottom_right"),
    (24, 2, 3, 4, 4, 64, "no_mask"),
    (256, 1, 1, 16, 1, 64, "causal_bottom_right"),
]


@pytest.mark.parametrize("case", PAGED, ids=[f"page{c[0]}_sq{c[2]}_g{c[3] // c[4]}" for c in PAGED])
@pytest.mark.parametrize("path", ["ffi", "legacy"])
def test_paged_in_place_is_bitwise_the_contiguous_decode(case, path):
  """The decode kernels read a shuffled pool with shared pages through the page table (no gather in the GPU program)
  and give the bits of the same call on the gathered contiguous K/V, ragged lengths (one of them 0) included."""
  page_size, b, sq, h, hkv, d, mask = case
  rng = np.random.default_rng(page_size + sq)
  max_pages = 3000 // page_size + 1
  num_pages = b * max_pages
  table = rng.permutation(num_pages).reshape(b, max_pages).astype(np.int32)
  table[-1, : max_pages // 2] = table[0, : max_pages // 2]  # two sequences share a prefix's pages
  lengths = rng.integers(sq, max_pages * page_size + 1, size=b).astype(np.int32)
  lengths[0] = 0 if mask == "no_mask" else lengths[0]
  q = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.bfloat16)
  k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)), jnp.bfloat16) for _ in range(2))
  paged = jax.jit(lambda q, kp, vp, t, n: te_jax.paged_attention(q, kp, vp, t, n, mask_type=mask, return_lse=True))
  with te_jax.custom_call_path(path):
    assert "gather" not in paged.lower(q, k_pages, v_pages, table, lengths).as_text()
    out, lse = (np.asarray(x) for x in paged(q, k_pages, v_pages, table, lengths))
    capacity = max_pages * page_size
    gather = lambda pool: pool[jnp.asarray(table)].reshape(b, capacity, hkv, d)
    contiguous = jax.jit(lambda q, k, v, n: te_jax.fused_attn(
        q, k, v, mask_type="padding" if mask == "no_mask" else "padding_causal_bottom_right",
        q_seqlens=jnp.full((b,), sq, jnp.int32), kv_seqlens=n, return_lse=True, engine="te"))
    ref_out, ref_lse = (np.asarray(x) for x in contiguous(q, gather(k_pages), gather(v_pages), lengths))
  te_jax.raise_legacy_failures()
  assert out.tobytes() == ref_out.tobytes() and lse.tobytes() == ref_lse.tobytes()
  assert np.isfinite(out.astype(np.float32)).all()


@pytest.mark.parametrize("max_pages", [2, 200], ids=["one_split", "split_kv"])
@pytest.mark.parametrize("window", [(-1, -1), (32, 0)], ids=["no_window", "window32"])
@pytest.mark.parametrize("path", ["ffi", "legacy"])
def test_paged_out_of_range_ids_and_lengths_poison_their_entry_in_the_kernel(max_pages, window, path):
  """Traced page ids outside the pool that a sequence uses, and a length past the capacity, give NaN in every output of
  their batch entry, found by the decode kernels themselves (the GPU program computes nothing else: no reduction or
  select of the ids), every split of the entry agreeing; an unused entry of the table may hold anything; the other
  entries keep the bits of a valid call. With a 32-key window the first page (entry 2's bad id) is one no query sees:
  it still poisons its entry."""
  b, page_size, h, hkv, d = 4, 16, 8, 2, 128
  rng = np.random.default_rng(max_pages)
  num_pages = b * max_pages
  table = rng.permutation(num_pages).reshape(b, max_pages).astype(np.int32)
  lengths = np.full(b, max_pages * page_size - 5, np.int32)
  lengths[0] = (max_pages - 1) * page_size  # its last entry of the table is not read
  q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
  k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, page_size, hkv, d)), jnp.bfloat16) for _ in range(2))
  bad_table, bad_lengths = table.copy(), lengths.copy()
  bad_table[0, -1] = -7
  bad_table[1, -1] = num_pages  # the last page: in the last split's keys only
  bad_table[2, 0] = -1
  bad_lengths[3] = max_pages * page_size + 1
  f = jax.jit(lambda q, kp, vp, t, n: te_jax.paged_attention(q, kp, vp, t, n, window_size=window, return_lse=True))
  with te_jax.custom_call_path(path):
    program = f.lower(q, k_pages, v_pages, bad_table, bad_lengths).as_text()
    assert "stablehlo.reduce" not in program and "stablehlo.select" not in program
    out, lse = (np.asarray(x, np.float32) for x in f(q, k_pages, v_pages, bad_table, bad_lengths))
    good_out, good_lse = (np.asarray(x, np.float32) for x in f(q, k_pages, v_pages, table, lengths))
  te_jax.raise_legacy_failures()
  assert np.isfinite(good_out).all() and np.isfinite(good_lse).all()
  for entry in (1, 2, 3):
    assert np.isnan(out[entry]).all() and np.isnan(lse[entry]).all(), f"entry {entry} is not all NaN"
  assert out[0].tobytes() == good_out[0].tobytes() and lse[0].tobytes() == good_lse[0].tobytes()
