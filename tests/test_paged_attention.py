"""te_jax.paged_attention against the float64 reference over the gathered pages: random page tables with shuffled and
shared pages, GQA ratios, Sq 1-16, ragged lengths including 0, page sizes, variants; bad inputs are clear errors,
out-of-range traced values poison their batch entry only; jit, vmap, grad; both custom-call paths bitwise equal."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.reference import attention_reference


def _cache(rng, *, b, sq, h, hkv, d, dv, page_size, max_pages, num_pages, dtype=np.float32):
  """A pool with more pages than the sequences use, a table of shuffled pages (two sequences share their first page),
  ragged lengths (one empty, one shorter than Sq) and the keys each sequence sees, gathered in numpy."""
  q = rng.standard_normal((b, sq, h, d)).astype(dtype)
  k_pages = rng.standard_normal((num_pages, page_size, hkv, d)).astype(dtype)
  v_pages = rng.standard_normal((num_pages, page_size, hkv, dv)).astype(dtype)
  table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  if b > 1:
    table[1, 0] = table[0, 0]  # a shared prefix page
  lengths = rng.integers(1, max_pages * page_size + 1, size=b).astype(np.int32)
  if b > 2:
    lengths[2] = 0
  if b > 3:
    lengths[3] = max(sq - 1, 0)
  return q, k_pages, v_pages, table, lengths


def _reference(q, k_pages, v_pages, table, lengths, mask_type, **kwargs):
  b, capacity = table.shape[0], table.shape[1] * k_pages.shape[1]
  k = k_pages[table].reshape(b, capacity, *k_pages.shape[2:])
  v = v_pages[table].reshape(b, capacity, *v_pages.shape[2:])
  mask = {"causal_bottom_right": "padding_causal_bottom_right", "no_mask": "padding"}[mask_type]
  return attention_reference(q, k, v, mask_type=mask, q_seqlens=np.full(b, q.shape[1]), kv_seqlens=lengths, **kwargs)


CASES = [
    # id, b, sq, h, hkv, d, dv, page_size, max_pages, mask, extra
    ("decode_gqa8_p16", 5, 1, 8, 1, 64, 64, 16, 6, "causal_bottom_right", {}),
    ("sq16_gqa4_p8", 4, 16, 8, 2, 32, 32, 8, 5, "causal_bottom_right", {}),
    ("sq3_mha_p64_dv", 3, 3, 2, 2, 16, 24, 64, 2, "no_mask", {}),
    ("decode_gqa2_softcap_window", 4, 2, 4, 2, 32, 32, 16, 4, "causal_bottom_right",
     dict(softcap=5.0, window_size=(20, 0))),
    ("sq4_alibi", 4, 4, 4, 4, 16, 16, 8, 4, "causal_bottom_right", dict(alibi=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_over_gathered_pages(case):
  _, b, sq, h, hkv, d, dv, page_size, max_pages, mask, extra = case
  rng = np.random.default_rng(len(case[0]))
  q, k_pages, v_pages, table, lengths = _cache(rng, b=b, sq=sq, h=h, hkv=hkv, d=d, dv=dv, page_size=page_size,
                                               max_pages=max_pages, num_pages=b * max_pages + 3)
  kwargs = {key: val for key, val in extra.items() if key != "alibi"}
  if extra.get("alibi"):
    kwargs["alibi_slopes"] = rng.uniform(0.01, 0.3, size=(b, h)).astype(np.float32)
  f = jax.jit(lambda *a: te_jax.paged_attention(*a, mask_type=mask, return_lse=True, **kwargs))
  out, lse = f(q, k_pages, v_pages, table, lengths)
  ref = _reference(q, k_pages, v_pages, table, lengths, mask, **kwargs)
  np.testing.assert_allclose(np.asarray(out), ref["out"], rtol=1e-4, atol=1e-4)
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], ref["lse"][finite], rtol=1e-4, atol=1e-4)


def test_gradients_reach_the_pages_and_paths_agree():
  rng = np.random.default_rng(7)
  q, k_pages, v_pages, table, lengths = _cache(rng, b=3, sq=2, h=4, hkv=2, d=16, dv=16, page_size=8, max_pages=3,
                                               num_pages=12)
  loss = lambda q, kp, vp: jnp.sum(te_jax.paged_attention(q, kp, vp, table, lengths) ** 2)
  grads = {}
  for path in ("ffi", "legacy"):
    with te_jax.custom_call_path(path):
      grads[path] = [np.asarray(g) for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k_pages, v_pages)]
  te_jax.raise_legacy_failures()
  for a, b in zip(grads["ffi"], grads["legacy"]):
    assert a.tobytes() == b.tobytes()
  # Pages no sequence uses get no gradient; used ones do.
  dk = grads["ffi"][1]
  used = {int(table[i, j]) for i in range(3) for j in range(3) if j * 8 < lengths[i]}
  unused = sorted(set(range(12)) - set(table.ravel().tolist()))
  assert all(np.abs(dk[p]).sum() == 0 for p in unused)
  assert any(np.abs(dk[p]).sum() > 0 for p in used)
  # Against finite differences of the reference through the gather: dq of one element.
  eps = 1e-3
  bump = np.zeros_like(q)
  bump[0, 1, 2, 3] = eps
  ref_loss = lambda qq: np.sum(_reference(qq, k_pages, v_pages, table, lengths, "causal_bottom_right")["out"] ** 2)
  numeric = (ref_loss(q + bump) - ref_loss(q - bump)) / (2 * eps)
  assert abs(grads["ffi"][0][0, 1, 2, 3] - numeric) < 1e-2 * max(1.0, abs(numeric))


def test_vmap_over_a_leading_axis():
  rng = np.random.default_rng(8)
  caches = [_cache(rng, b=2, sq=1, h=2, hkv=1, d=8, dv=8, page_size=8, max_pages=2, num_pages=5) for _ in range(3)]
  stacked = [np.stack(x) for x in zip(*caches)]
  out = jax.vmap(lambda *a: te_jax.paged_attention(*a))(*stacked)
  for i, cache in enumerate(caches):
    np.testing.assert_allclose(np.asarray(out[i]), np.asarray(te_jax.paged_attention(*cache)), rtol=1e-6, atol=1e-6)


def test_out_of_range_values_under_jit_poison_their_entry_only():
  rng = np.random.default_rng(9)
  q, k_pages, v_pages, table, lengths = _cache(rng, b=4, sq=1, h=2, hkv=2, d=8, dv=8, page_size=8, max_pages=3,
                                               num_pages=14)
  lengths[:] = 20  # every sequence uses all three pages
  table[1, 2] = 99  # past the pool
  lengths[3] = 25  # past max_pages * page_size
  f = jax.jit(lambda q, kp, vp, t, n: te_jax.paged_attention(q, kp, vp, t, n, return_lse=True))
  out, lse = (np.asarray(x) for x in f(q, k_pages, v_pages, table, lengths))
  for b in (1, 3):
    assert np.isnan(out[b]).all() and np.isnan(lse[b]).all()
  for b in (0, 2):
    assert np.isfinite(out[b]).all() and np.isfinite(lse[b]).all()
  # Entries past a sequence's last page are never read: any value there is fine.
  table[0, 2] = -5
  lengths[0] = 16
  out = np.asarray(f(q, k_pages, v_pages, table, lengths)[0])
  assert np.isfinite(out[0]).all()


@pytest.mark.parametrize("change, error, message", [
    (dict(mask_type="causal"), ValueError, "must be 'causal_bottom_right' or 'no_mask'"),
    (dict(k_pages=np.zeros((6, 12, 2, 8), np.float32), v_pages=np.zeros((6, 12, 2, 8), np.float32)), ValueError,
     "page size .* multiple of 8"),
    (dict(v_pages=np.zeros((5, 8, 2, 8), np.float32)), ValueError, "must agree on"),
    (dict(page_table=np.zeros((2, 3), np.float32)), TypeError, "page_table must be an integer array"),
    (dict(page_table=np.zeros((3, 3), np.int32)), ValueError, "B = 2"),
    (dict(kv_lengths=np.asarray([4, 30], np.int32)), ValueError, r"kv_lengths must lie in \[0, 24\]"),
    (dict(page_table=np.asarray([[0, 1, 2], [3, 6, 0]], np.int32)), ValueError, r"page_table\[1, 1\] = 6"),
])
def test_bad_inputs_are_clear_errors(change, error, message):
  args = dict(q=np.zeros((2, 1, 4, 8), np.float32), k_pages=np.zeros((6, 8, 2, 8), np.float32),
              v_pages=np.zeros((6, 8, 2, 8), np.float32), page_table=np.asarray([[0, 1, 2], [3, 4, 0]], np.int32),
              kv_lengths=np.asarray([20, 12], np.int32))
  args.update(change)
  mask = args.pop("mask_type", "causal_bottom_right")
  with pytest.raises(error, match=message):
    te_jax.paged_attention(**args, mask_type=mask)
