"""te_jax.paged_attention: the CPU kernels read the pages in place (no gather in the program) and give the bits of
fused_attn over the gathered pages; against the float64 reference over the gathered pages: random page tables with
shuffled and shared pages, GQA ratios 1-8, Sq 1-16, ragged lengths including 0, page sizes 8-256 (24 too), masks,
windows, soft-cap, ALiBi, lse; bad inputs are clear errors (in Python, and in the kernel for a page table the Python
layer cannot see), out-of-range traced values poison their batch entry only; jit, vmap, grad (equal to the gather
formulation's); both custom-call paths bitwise equal."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import _primitives
from te_jax import context_parallel
from te_jax.attention_config import AttentionConfig
from te_jax.legacy_failures import LegacyCustomCallError
from te_jax.mask_type import MaskType
from te_jax.reference import attention_reference

_PADDING_MASK = {"causal_bottom_right": "padding_causal_bottom_right", "no_mask": "padding"}


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
  return attention_reference(q, k, v, mask_type=_PADDING_MASK[mask_type], q_seqlens=np.full(b, q.shape[1]),
                             kv_seqlens=lengths, **kwargs)


def _gathered(q, k_pages, v_pages, table, lengths, mask_type, **kwargs):
  """fused_attn over the pages gathered into contiguous K/V (out, lse): what the in-place kernels must reproduce."""
  b, capacity = table.shape[0], table.shape[1] * k_pages.shape[1]
  gather = lambda pool: jnp.asarray(pool)[table].reshape(b, capacity, *pool.shape[2:])
  return te_jax.fused_attn(q, gather(k_pages), gather(v_pages), mask_type=_PADDING_MASK[mask_type],
                           q_seqlens=np.full(b, q.shape[1], np.int32), kv_seqlens=lengths, return_lse=True, **kwargs)


CASES = [
    # id, b, sq, h, hkv, d, dv, page_size, max_pages, mask, extra
    ("decode_gqa8_p16", 5, 1, 8, 1, 64, 64, 16, 6, "causal_bottom_right", {}),
    ("sq16_gqa4_p8", 4, 16, 8, 2, 32, 32, 8, 5, "causal_bottom_right", {}),
    ("sq3_mha_p64_dv", 3, 3, 2, 2, 16, 24, 64, 2, "no_mask", {}),
    ("decode_gqa2_softcap_window", 4, 2, 4, 2, 32, 32, 16, 4, "causal_bottom_right",
     dict(softcap=5.0, window_size=(20, 0))),
    ("sq4_alibi", 4, 4, 4, 4, 16, 16, 8, 4, "causal_bottom_right", dict(alibi=True)),
    ("sq5_gqa3_p24", 4, 5, 6, 2, 16, 16, 24, 6, "causal_bottom_right", {}),
    ("decode_gqa4_p256", 3, 1, 4, 1, 32, 32, 256, 2, "no_mask", dict(softcap=3.0)),
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
  """Each example its own pool: the in-place call stacks the pools into one and moves each example's page ids into
  its part; every example gives the bits of its own call."""
  rng = np.random.default_rng(8)
  caches = [_cache(rng, b=2, sq=1, h=2, hkv=1, d=8, dv=8, page_size=8, max_pages=2, num_pages=5) for _ in range(3)]
  stacked = [np.stack(x) for x in zip(*caches)]
  out = jax.vmap(lambda *a: te_jax.paged_attention(*a))(*stacked)
  for i, cache in enumerate(caches):
    assert np.asarray(out[i]).tobytes() == np.asarray(te_jax.paged_attention(*cache)).tobytes()


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


def test_traced_wide_integers_poison_their_entry_rather_than_wrap():
  """Under x64, a traced int64 length or used page id past int32 is clamped (stays out of range), not wrapped into a
  valid-looking value: its entry is NaN, the others are as with int32 operands."""
  rng = np.random.default_rng(10)
  q, k_pages, v_pages, table, lengths = _cache(rng, b=3, sq=1, h=2, hkv=2, d=8, dv=8, page_size=8, max_pages=3,
                                               num_pages=12)
  lengths[:] = 20
  f = jax.jit(lambda q, kp, vp, t, n: te_jax.paged_attention(q, kp, vp, t, n))
  want = np.asarray(f(q, k_pages, v_pages, table, lengths))
  with jax.enable_x64(True):
    wide_table, wide_lengths = table.astype(np.int64), lengths.astype(np.int64)
    wide_lengths[1] = 2**32 + 5  # would wrap to 5
    wide_table[2, 0] = 2**32 + int(table[2, 0])  # would wrap to the page it was
    got = np.asarray(f(q, k_pages, v_pages, wide_table, wide_lengths))
  assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
  np.testing.assert_array_equal(got[0], want[0])


# The in-place kernel against fused_attn over the gathered pages: the same kernel arithmetic on the same Skv (the
# capacity), so the same key tiles, the same float32 rows (copied from the pages instead of read in place) and the same
# products: bitwise equal, out and lse, on either custom-call path.
IN_PLACE = [
    # id, b, sq, h, hkv, d, dv, page_size, max_pages, mask, extra, dtype
    ("p8_mha_decode", 4, 1, 2, 2, 16, 16, 8, 20, "causal_bottom_right", {}, "float32"),
    ("p8_gqa2_sq7_window", 4, 7, 4, 2, 16, 16, 8, 12, "causal_bottom_right", dict(window_size=(30, 0)), "float32"),
    ("p16_gqa8_sq16_bf16", 4, 16, 8, 1, 32, 32, 16, 11, "causal_bottom_right", {}, "bfloat16"),
    ("p24_gqa3_sq5_nomask_dv", 4, 5, 6, 2, 16, 24, 24, 7, "no_mask", {}, "float32"),
    ("p24_gqa4_sq3_alibi_f16", 4, 3, 8, 2, 16, 16, 24, 9, "causal_bottom_right", dict(alibi=True), "float16"),
    ("p64_gqa4_sq2_softcap_window", 4, 2, 4, 1, 32, 32, 64, 4, "causal_bottom_right",
     dict(softcap=4.0, window_size=(70, 0)), "bfloat16"),
    ("p64_gqa1_sq16_nomask_window", 3, 16, 2, 2, 8, 8, 64, 3, "no_mask", dict(window_size=(5, 3)), "float32"),
    ("p256_gqa2_sq4_alibi_softcap", 3, 4, 4, 2, 16, 16, 256, 2, "causal_bottom_right",
     dict(alibi=True, softcap=2.0), "float32"),
]


def _in_place_inputs(case):
  _, b, sq, h, hkv, d, dv, page_size, max_pages, mask, extra, dtype = case
  rng = np.random.default_rng(len(case[0]) + page_size)
  q, k_pages, v_pages, table, lengths = _cache(rng, b=b, sq=sq, h=h, hkv=hkv, d=d, dv=dv, page_size=page_size,
                                               max_pages=max_pages, num_pages=b * max_pages + 5)
  q, k_pages, v_pages = (jnp.asarray(x, dtype) for x in (q, k_pages, v_pages))
  kwargs = {key: val for key, val in extra.items() if key != "alibi"}
  if extra.get("alibi"):
    kwargs["alibi_slopes"] = rng.uniform(0.01, 0.3, size=(h,)).astype(np.float32)
  return (q, k_pages, v_pages, table, lengths), mask, kwargs


@pytest.mark.parametrize("case", IN_PLACE, ids=[c[0] for c in IN_PLACE])
def test_in_place_is_bitwise_the_gathered_fused_attn(case, path):
  args, mask, kwargs = _in_place_inputs(case)
  with te_jax.custom_call_path(path):
    paged = jax.jit(lambda *a: te_jax.paged_attention(*a, mask_type=mask, return_lse=True, **kwargs))
    out, lse = (np.asarray(x) for x in paged(*args))
    want_out, want_lse = (np.asarray(x) for x in jax.jit(lambda *a: _gathered(*a, mask, **kwargs))(*args))
  te_jax.raise_legacy_failures()
  assert out.tobytes() == want_out.tobytes()
  assert lse.tobytes() == want_lse.tobytes()
  # And against the float64 reference, to the dtype's rounding.
  ref = _reference(*(np.asarray(x, np.float64) for x in args[:3]), *args[3:], mask, **kwargs)
  tol = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 5e-3}[case[-1]]
  np.testing.assert_allclose(out.astype(np.float64), ref["out"], rtol=tol, atol=tol)
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(lse), finite)
  np.testing.assert_allclose(lse[finite], ref["lse"][finite], rtol=tol, atol=tol)


def test_cpu_program_reads_the_pages_in_place():
  """No gather in the CPU program: the custom call takes the pools and the page table themselves."""
  args, mask, kwargs = _in_place_inputs(IN_PLACE[1])
  for path in ("ffi", "legacy"):
    with te_jax.custom_call_path(path):
      text = jax.jit(lambda *a: te_jax.paged_attention(*a, mask_type=mask, **kwargs)).lower(*args).as_text()
    assert "gather" not in text
    assert "tensor<4x12xi32>" in text  # the page table, an operand of the custom call
    assert "tensor<53x8x2x16xf32>" in text  # the k pool, unchanged


def test_both_paths_describe_the_same_paged_call():
  """The FFI attributes and the legacy descriptor carry page_size; the descriptor also num_pages and the capacity as
  seqlen_kv, which the FFI handler takes from the pool's and the page table's shapes."""
  from te_jax import _te_jax_cpu
  args, mask, kwargs = _in_place_inputs(IN_PLACE[1])  # 53 pages of 8, tables of 12 pages
  f = jax.jit(lambda *a: te_jax.paged_attention(*a, mask_type=mask, **kwargs))
  assert "page_size = 8 : i64" in f.lower(*args).as_text()
  with te_jax.custom_call_path("legacy"):
    module = f.lower(*args).compiler_ir("stablehlo")
  calls = []

  def walk(op):  # the call sits inside platform_dependent's case op
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if inner.name == "stablehlo.custom_call":
            calls.append(inner)
          walk(inner.operation)

  walk(module.operation)
  (call,) = calls
  params = _te_jax_cpu.unpack_descriptor(call.attributes["backend_config"].value_bytes)
  assert (params["page_size"], params["num_pages"], params["seqlen_kv"], params["batch"]) == (8, 53, 96, 4)


def test_paths_agree_bitwise_on_the_in_place_forward():
  args, mask, kwargs = _in_place_inputs(IN_PLACE[4])
  results = {}
  for path in ("ffi", "legacy"):
    with te_jax.custom_call_path(path):
      f = jax.jit(lambda *a: te_jax.paged_attention(*a, mask_type=mask, return_lse=True, **kwargs))
      results[path] = [np.asarray(x) for x in f(*args)]
  te_jax.raise_legacy_failures()
  for a, b in zip(results["ffi"], results["legacy"]):
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", [IN_PLACE[1], IN_PLACE[6], IN_PLACE[7]], ids=lambda c: c[0])
def test_gradients_equal_the_gather_formulation(case):
  """The VJP differentiates the gather formulation: the same gradients as fused_attn over gathered pages (dq to its
  float32 summation order, which follows the CPU backward's thread scheduling; dk, dv and the pages' sums exactly
  the same additions), with a cotangent for lse too."""
  args, mask, kwargs = _in_place_inputs(case)
  q, k_pages, v_pages, table, lengths = args
  rng = np.random.default_rng(3)
  dout = rng.standard_normal(q.shape[:3] + (v_pages.shape[3],)).astype(np.float32)
  dlse = rng.standard_normal((q.shape[0], q.shape[2], q.shape[1])).astype(np.float32)

  def loss(attend):
    def f(q, kp, vp):
      out, lse = attend(q, kp, vp)
      lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
      return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse * dlse)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

  paged = loss(lambda q, kp, vp: te_jax.paged_attention(q, kp, vp, table, lengths, mask_type=mask, return_lse=True,
                                                        **kwargs))
  gathered = loss(lambda q, kp, vp: _gathered(q, kp, vp, table, lengths, mask, **kwargs))
  for name, got, want in zip(("dq", "dk_pages", "dv_pages"), paged(q, k_pages, v_pages),
                             gathered(q, k_pages, v_pages)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-6, atol=1e-6,
                               err_msg=name)


def test_vmap_shares_one_pool():
  """vmap over the page tables, lengths and queries with one pool for every example: no pool is copied per example,
  and each example gives the bits of its own call."""
  rng = np.random.default_rng(12)
  q, k_pages, v_pages, table, lengths = _cache(rng, b=2, sq=3, h=4, hkv=2, d=16, dv=16, page_size=8, max_pages=4,
                                               num_pages=20)
  qs = rng.standard_normal((3,) + q.shape).astype(np.float32)
  tables = np.stack([np.roll(table, i, axis=1) for i in range(3)])
  lens = np.stack([lengths, lengths // 2, np.full_like(lengths, 32)])
  f = jax.vmap(lambda q, t, n: te_jax.paged_attention(q, k_pages, v_pages, t, n, return_lse=True))
  out, lse = jax.jit(f)(qs, tables, lens)
  for i in range(3):
    want = te_jax.paged_attention(qs[i], k_pages, v_pages, tables[i], lens[i], return_lse=True)
    assert np.asarray(out[i]).tobytes() == np.asarray(want[0]).tobytes()
    assert np.asarray(lse[i]).tobytes() == np.asarray(want[1]).tobytes()


def _paged_primitive(page_size, mask=MaskType.PADDING_CAUSAL_BOTTOM_RIGHT):
  """The kernel primitive bound directly with a paged config (what paged_attention binds), under jit. A fresh jitted
  function per call that should fail: jax raises a run-time error of a cached executable's fast path as ValueError
  rather than JaxRuntimeError."""
  config = AttentionConfig(mask_type=mask, window_left=-1, window_right=-1, scale=0.25, softcap=0.0, has_alibi=False,
                           page_size=page_size)

  def call(q, k_pages, v_pages, table, lengths):  # a paged call's q lengths are a placeholder: Sq each
    return _primitives.attention_forward_p.bind(
        q, k_pages, v_pages, _primitives.no_lengths(), lengths, _primitives.no_alibi(), _primitives.no_sinks(),
        *_primitives.no_tokens(), table, _primitives.no_kv_descale(), _primitives.no_bias(),
        _primitives.no_dropout(), config=config)
  return jax.jit(call)


def _bad_table_inputs():
  rng = np.random.default_rng(13)
  q, k_pages, v_pages, table, lengths = _cache(rng, b=3, sq=2, h=2, hkv=1, d=8, dv=8, page_size=8, max_pages=3,
                                               num_pages=10)
  lengths[:] = [24, 9, 17]
  table[1, 1] = 10  # used by sequence 1 (keys 8 .. 15), one past the pool
  table[2, 2] = -3  # used by sequence 2 (key 16)
  return q, k_pages, v_pages, table, lengths


def test_kernel_refuses_a_traced_page_id_outside_the_pool_ffi(no_pending_legacy_failures):
  """A page table the Python layer cannot see (bound directly, traced): the CPU kernel checks the used ids, as it
  checks lengths, and never reads outside the pool."""
  q, k_pages, v_pages, table, lengths = _bad_table_inputs()
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"INVALID_ARGUMENT: page_table\[1, 1\] = 10 is not a page of "
                                                       r"the pool \[0, 10\), and sequence 1 \(kv_seqlens\[1\] = 9\) "
                                                       r"uses it"):
    jax.block_until_ready(_paged_primitive(8)(q, k_pages, v_pages, table, lengths))
  table[1, 1] = 4
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"page_table\[2, 2\] = -3 is not a page of the pool"):
    jax.block_until_ready(_paged_primitive(8)(q, k_pages, v_pages, table, lengths))
  lengths[2] = 16  # the bad id is now past the sequence's last page: never read, no error
  out, lse = _paged_primitive(8)(q, k_pages, v_pages, table, lengths)
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()


def test_vmap_keeps_an_example_inside_its_own_pool(no_pending_legacy_failures):
  """Per-example pools are stacked into one under vmap: an id one past example 0's pool (a page of example 1's part
  of the stacked pool) is still refused, not read."""
  rng = np.random.default_rng(14)
  caches = [_cache(rng, b=2, sq=1, h=2, hkv=1, d=8, dv=8, page_size=8, max_pages=2, num_pages=5) for _ in range(2)]
  q, k_pages, v_pages, table, lengths = (np.stack(x) for x in zip(*caches))
  lengths[:] = 16
  f = lambda *a: jax.jit(jax.vmap(_paged_primitive(8)))(*a)  # fresh each call: see _paged_primitive
  out, _ = f(q, k_pages, v_pages, table, lengths)
  for i in range(2):  # the stacked call computes each example as its own call would
    want, _ = _paged_primitive(8)(q[i], k_pages[i], v_pages[i], table[i], lengths[i])
    assert np.asarray(out[i]).tobytes() == np.asarray(want).tobytes()
  table[0, 1, 1] = 5  # folded batch entry 1 * 2 + 0 = 2
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"page_table\[2, 1\] = -1 is not a page of the pool \[0, 10\)"):
    jax.block_until_ready(f(q, k_pages, v_pages, table, lengths))


def test_kernel_refuses_a_traced_page_id_outside_the_pool_legacy(no_pending_legacy_failures):
  q, k_pages, v_pages, table, lengths = _bad_table_inputs()
  with te_jax.custom_call_path("legacy"):
    out, lse = (np.asarray(x) for x in _paged_primitive(8)(q, k_pages, v_pages, table, lengths))
  assert np.isnan(out).all() and np.isnan(lse).all()
  with pytest.raises(LegacyCustomCallError, match=r"te_jax_attention_forward_cpu_legacy: page_table\[1, 1\] = 10 is "
                                                  r"not a page of the pool \[0, 10\)"):
    te_jax.raise_legacy_failures()


@pytest.mark.parametrize("mask, page_size, message", [
    (MaskType.PADDING_CAUSAL, 8, "a paged KV cache .* goes with mask_type padding or padding_causal_bottom_right"),
    (MaskType.CAUSAL_BOTTOM_RIGHT, 8, "got causal_bottom_right"),
])
def test_paged_primitive_refuses_other_masks_at_lowering(mask, page_size, message):
  q, k_pages, v_pages, table, lengths = _bad_table_inputs()
  with pytest.raises(ValueError, match=message):
    _paged_primitive(page_size, mask).lower(q, k_pages, v_pages, table, lengths)


def test_paged_backward_is_refused_at_lowering():
  """The backward takes no pages: paged_attention's VJP differentiates the gather formulation instead."""
  config = AttentionConfig(mask_type=MaskType.PADDING, window_left=-1, window_right=-1, scale=0.25, softcap=0.0,
                           has_alibi=False, page_size=8)
  q, k_pages, v_pages, table, lengths = _bad_table_inputs()
  b, sq, h = q.shape[:3]

  def backward(q, k_pages, v_pages):
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.zeros((b, h, sq), jnp.float32)
    return _primitives.attention_backward_p.bind(
        q, k_pages, v_pages, out, lse, out, lse, jnp.full((b,), sq, jnp.int32), jnp.asarray(lengths),
        _primitives.no_alibi(), _primitives.no_sinks(), *_primitives.no_tokens(), jnp.asarray(table),
        _primitives.no_kv_descale(), _primitives.no_bias(), _primitives.no_dropout(), config=config)
  with pytest.raises(ValueError, match=r"the backward takes no paged KV cache \(page_size must be 0, got 8\)"):
    jax.jit(backward).lower(q, k_pages, v_pages)


def test_cuda_in_place_limit_matches_the_core():
  """paged_attention lowers the in-place call on cuda exactly where the core's validation lets the CUDA backend read
  pages (BackendServesPagesInPlace: its decode kernels' query positions); beyond, it gathers."""
  from te_jax import _te_jax_cpu
  from te_jax.paged_attention import _CUDA_IN_PLACE_MAX_SEQLEN_Q as limit
  config = AttentionConfig(mask_type=MaskType.PADDING_CAUSAL_BOTTOM_RIGHT, window_left=-1, window_right=-1,
                           scale=0.125, softcap=0.0, has_alibi=False, page_size=16)
  params = lambda sq: config.core_params((2, sq, 8, 64), (30, 16, 2, 64), (30, 16, 2, 64), jnp.bfloat16,
                                         page_table_shape=(2, 4))
  _te_jax_cpu.validate(params(limit), 1)
  with pytest.raises(ValueError, match=f"at most {limit} query positions"):
    _te_jax_cpu.validate(params(limit + 1), 1)


def test_context_parallelism_refuses_paging():
  config = AttentionConfig(mask_type=MaskType.PADDING, window_left=-1, window_right=-1, scale=0.25, softcap=0.0,
                           has_alibi=False, page_size=16)
  cp = context_parallel.ContextParallel(axis="cp", strategy="ring", load_balanced=False, size=2)
  with pytest.raises(ValueError, match=r"a paged KV cache \(page_size 16\) is not supported with context parallelism"):
    context_parallel.check_supported(config, cp, (2, 64, 4, 8), (2, 64, 2, 8))
  context_parallel.check_supported(dataclasses.replace(config, page_size=0), cp, (2, 64, 4, 8), (2, 64, 2, 8))


@pytest.mark.parametrize("change, error, message", [
    (dict(mask_type="causal"), ValueError, "must be 'causal_bottom_right' or 'no_mask'"),
    (dict(k_pages=np.zeros((6, 12, 2, 8), np.float32), v_pages=np.zeros((6, 12, 2, 8), np.float32)), ValueError,
     "page size .* multiple of 8"),
    (dict(v_pages=np.zeros((5, 8, 2, 8), np.float32)), ValueError, "must agree on"),
    (dict(k_pages=np.zeros((0, 8, 2, 8), np.float32), v_pages=np.zeros((0, 8, 2, 8), np.float32)), ValueError,
     r"hold no pages \(num_pages = k_pages.shape\[0\] = 0\)"),
    (dict(page_table=np.zeros((2, 3), np.float32)), TypeError, "page_table must be an integer array"),
    (dict(page_table=np.zeros((3, 3), np.int32)), ValueError, "B = 2"),
    (dict(kv_lengths=np.asarray([4, 30], np.int32)), ValueError, r"kv_lengths must lie in \[0, 24\]"),
    (dict(page_table=np.asarray([[0, 1, 2], [3, 6, 0]], np.int32)), ValueError, r"page_table\[1, 1\] = 6"),
    (dict(window_size=(-2, 0)), ValueError, "window_size left must be -1"),
    (dict(scale=0.0), ValueError, "scale must be a finite positive number"),
    (dict(softcap=-1.0), ValueError, "softcap must be 0"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, "alibi_slopes must have shape"),
    (dict(engine="nope"), ValueError, "engine must be one of"),
    (dict(q=np.zeros((2, 1, 4, 16), np.float32)), ValueError, "q and k must have the same head dim"),
    (dict(q=np.zeros((2, 1, 3, 8), np.float32)), ValueError, r"number of q heads \(3\) must be a positive multiple"),
    (dict(q=np.zeros((2, 1, 4, 8), np.float16)), TypeError, "q, k_pages and v_pages must share one dtype"),
    (dict(k_pages=np.zeros((6, 8, 2, 8)).tolist()), TypeError, "k_pages must be a JAX or NumPy array, got list"),
    # Wider integers are checked as given, never wrapped into range first.
    (dict(kv_lengths=np.asarray([20, 2**32 + 5], np.int64)), ValueError,
     r"kv_lengths must lie in \[0, 24\] .*got 4294967301 for sequence 1"),
    (dict(kv_lengths=np.asarray([20, 2**32 - 1], np.uint32)), ValueError, "got 4294967295 for sequence 1"),
    (dict(page_table=np.asarray([[0, 1, 2], [2**32 + 3, 4, 0]], np.int64)), ValueError,
     r"page_table\[1, 0\] = 4294967299 is not a page"),
])
def test_bad_inputs_are_clear_errors(change, error, message):
  args = dict(q=np.zeros((2, 1, 4, 8), np.float32), k_pages=np.zeros((6, 8, 2, 8), np.float32),
              v_pages=np.zeros((6, 8, 2, 8), np.float32), page_table=np.asarray([[0, 1, 2], [3, 4, 0]], np.int32),
              kv_lengths=np.asarray([20, 12], np.int32))
  args.update(change)
  with pytest.raises(error, match=message):
    te_jax.paged_attention(**args)
