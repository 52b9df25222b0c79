"""Packed sequences: segment ids and explicit positions. Forward, lse and gradients against the float64
reference for random packings and positions, on both custom-call paths (bitwise equal with deterministic=True); a
packed row equals its documents run as separate batch entries; argument errors name the argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import (Case, assert_bitwise_equal, check_against_reference, make_inputs, reference, run_on_path,
                     tolerance)
from te_jax.packing import positions_from_lengths, segment_ids_from_lengths

# Sequences long enough for several query tiles (64) and key tiles (128) of the CPU kernel.
BASE = Case(batch=4, seqlen_q=200, seqlen_kv=200, heads=4, kv_heads=2, head_dim=32, mask="causal", with_dlse=True)


def random_lengths(rng, batch: int, seqlen: int) -> np.ndarray:
  """[B, 8] document lengths: 1..8 documents of lengths 1..S per row (cut at S), row 1 empty, the last row one
  document filling it."""
  lengths = np.zeros((batch, 8), np.int32)
  for b in range(batch):
    if b == 1:
      continue  # an empty row: every id 0
    if b == batch - 1:
      lengths[b, 0] = seqlen
      continue
    n = rng.integers(1, 9)
    cuts = np.sort(rng.integers(1, seqlen + 1, n))
    lengths[b, :n] = np.diff(np.concatenate([[0], cuts]))
    lengths[b, :n] = np.maximum(lengths[b, :n], 1)
  return lengths


def packed_tokens(case: Case, kind: str) -> dict:
  rng = np.random.default_rng(abs(hash((case.id(), kind))) % 2**32)
  b, sq, skv = case.batch, case.seqlen_q, case.seqlen_kv
  if kind == "ids":
    return dict(q_segment_ids=np.asarray(segment_ids_from_lengths(random_lengths(rng, b, sq), sq)))
  if kind == "ids+positions":
    lengths = random_lengths(rng, b, sq)
    return dict(q_segment_ids=np.asarray(segment_ids_from_lengths(lengths, sq)),
                q_positions=np.asarray(positions_from_lengths(lengths, sq)),
                kv_positions=np.asarray(positions_from_lengths(lengths, sq)))
  if kind == "random_ids":  # unsorted ids from a small set, with zeros: only conservative tile bounds hold
    return dict(q_segment_ids=rng.integers(0, 4, (b, sq)).astype(np.int32),
                kv_segment_ids=rng.integers(0, 4, (b, skv)).astype(np.int32))
  if kind == "random_positions":  # unsorted, repeated
    return dict(q_positions=rng.integers(-20, sq + 20, (b, sq)).astype(np.int32),
                kv_positions=rng.integers(0, skv, (b, skv)).astype(np.int32))
  if kind == "decode":  # q_positions = cache length + i, the keys by index
    return dict(q_positions=(skv - sq + np.arange(sq, dtype=np.int32))[None].repeat(b, 0))
  if kind == "huge_positions":  # near int32's ends, where pos +- window must not wrap
    top = np.iinfo(np.int32).max
    return dict(q_positions=(top - sq + np.arange(sq))[None].repeat(b, 0).astype(np.int32),
                kv_positions=(top - skv + np.arange(skv))[None].repeat(b, 0).astype(np.int32),
                q_segment_ids=np.ones((b, sq), np.int32), kv_segment_ids=np.ones((b, skv), np.int32))
  raise ValueError(kind)


CASES = [
    (BASE, "ids"),
    (BASE.replace(mask="no_mask"), "ids"),
    (BASE, "ids+positions"),
    (BASE.replace(mask="no_mask", window=(16, 8)), "ids+positions"),
    (BASE.replace(window=(30, -1)), "ids"),
    (BASE.replace(softcap=3.0, alibi="bh"), "ids+positions"),
    (BASE.replace(alibi="h", head_dim_v=16), "ids"),
    (BASE.replace(seqlen_kv=300), "random_ids"),
    (BASE.replace(mask="no_mask", seqlen_kv=150), "random_ids"),
    (BASE, "random_positions"),
    (BASE.replace(mask="no_mask", window=(10, 5), alibi="h"), "random_positions"),
    (BASE.replace(seqlen_q=7, seqlen_kv=300), "decode"),
    (BASE.replace(seqlen_q=70, seqlen_kv=300, window=(100, -1), alibi="h"), "decode"),
    (BASE.replace(mask="no_mask", window=(2**31 - 1, 20)), "huge_positions"),
    (BASE.replace(window=(30, 2**31 - 1)), "huge_positions"),
    (BASE.replace(dtype="bfloat16"), "ids+positions"),
    (BASE.replace(dtype="float16", heads=2, kv_heads=1, head_dim=64, head_dim_v=32), "ids"),
]


@pytest.mark.parametrize("case,kind", CASES, ids=[f"{c.id()}-{k}" for c, k in CASES])
def test_against_reference_both_paths(case, kind):
  case = case.replace(deterministic=True)
  inputs = make_inputs(case)
  inputs.tokens = packed_tokens(case, kind)
  got = {path: run_on_path(case, inputs, path) for path in ("ffi", "legacy")}
  check_against_reference(case, inputs, got["ffi"], reference(case, inputs))
  assert_bitwise_equal(got["ffi"], got["legacy"])


def test_all_padding_rows_give_zero_and_minus_inf():
  case = BASE.replace(batch=2)
  inputs = make_inputs(case)
  inputs.tokens = dict(q_segment_ids=np.zeros((2, 200), np.int32))
  got = run_on_path(case, inputs, "ffi")
  assert np.all(got["out"] == 0) and np.all(got["lse"] == -np.inf)
  for n in ("dq", "dk", "dv"):
    assert np.all(got[n] == 0), n


@pytest.mark.parametrize("mask,alibi", [("causal", None), ("no_mask", "h"), ("causal", "h")])
def test_packed_row_equals_documents_as_batch(mask, alibi):
  """A row holding documents of 70, 130 and 56 tokens (and padding) gives, for each document, the outputs and
  gradients of that document alone."""
  lengths = [70, 130, 56]
  seqlen, heads, d = 300, 2, 32
  rng = np.random.default_rng(3)
  q, k, v, dout = (rng.standard_normal((1, seqlen, heads, d)).astype(np.float32) for _ in range(4))
  slopes = rng.uniform(-0.3, 0.3, heads).astype(np.float32) if alibi else None
  ids = segment_ids_from_lengths(np.array([lengths]), seqlen)
  pos = positions_from_lengths(np.array([lengths]), seqlen)

  def loss(q, k, v, **kw):
    return jnp.sum(te_jax.fused_attn(q, k, v, mask_type=mask, alibi_slopes=slopes, **kw) * dout)

  out = te_jax.fused_attn(q, k, v, mask_type=mask, alibi_slopes=slopes, q_segment_ids=ids, q_positions=pos,
                          kv_positions=pos)
  grads = jax.grad(lambda q, k, v: loss(q, k, v, q_segment_ids=ids, q_positions=pos, kv_positions=pos),
                   argnums=(0, 1, 2))(q, k, v)
  start = 0
  for n in lengths:
    part = slice(start, start + n)
    qd, kd, vd = q[:, part], k[:, part], v[:, part]
    ref_out = te_jax.fused_attn(qd, kd, vd, mask_type=mask, alibi_slopes=slopes)
    ref_grads = jax.grad(lambda q, k, v: jnp.sum(te_jax.fused_attn(q, k, v, mask_type=mask, alibi_slopes=slopes) *
                                                 dout[:, part]), argnums=(0, 1, 2))(qd, kd, vd)
    tol = tolerance("float32")
    np.testing.assert_allclose(out[:, part], ref_out, atol=tol, rtol=tol)
    for g, rg in zip(grads, ref_grads):
      np.testing.assert_allclose(g[:, part], rg, atol=2 * tol, rtol=2 * tol)
    start += n
  assert np.all(np.asarray(out)[:, start:] == 0)
  for g in grads:
    assert np.all(np.asarray(g)[:, start:] == 0)


def test_vmap_and_jit_with_segment_ids():
  case = BASE.replace(batch=2, seqlen_q=100, seqlen_kv=100)
  inputs = make_inputs(case)
  ids = packed_tokens(case, "ids")["q_segment_ids"]
  f = lambda q, k, v, ids: te_jax.fused_attn(q, k, v, mask_type="causal", q_segment_ids=ids)
  batched = jax.jit(jax.vmap(f))(*(x[None].repeat(2, 0) for x in (inputs.q, inputs.k, inputs.v, ids)))
  single = f(inputs.q, inputs.k, inputs.v, ids)
  np.testing.assert_array_equal(batched[0], single)
  np.testing.assert_array_equal(batched[1], single)


def test_helpers_from_lengths():
  ids = segment_ids_from_lengths(np.array([[3, 2], [0, 4], [0, 0]]), 7)
  pos = positions_from_lengths(np.array([[3, 2], [0, 4], [0, 0]]), 7)
  np.testing.assert_array_equal(ids, [[1, 1, 1, 2, 2, 0, 0], [2, 2, 2, 2, 0, 0, 0], [0] * 7])
  np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0, 0], [0, 1, 2, 3, 0, 0, 0], [0] * 7])
  assert ids.dtype == jnp.int32 and pos.dtype == jnp.int32
  np.testing.assert_array_equal(segment_ids_from_lengths(np.array([[5, 5]]), 7), [[1, 1, 1, 1, 1, 2, 2]])
  # A document cut by the row's end keeps its start; lengths whose sum (or value) passes int32 never wrap.
  np.testing.assert_array_equal(positions_from_lengths(np.array([[5, 10, 3]]), 8), [[0, 1, 2, 3, 4, 0, 1, 2]])
  for lengths in ([[2**31 - 1, 5]], np.array([[2**32 + 2, 5]], np.int64), np.array([[2**32 - 1, 1]], np.uint32)):
    np.testing.assert_array_equal(segment_ids_from_lengths(lengths, 4), [[1, 1, 1, 1]])
    np.testing.assert_array_equal(positions_from_lengths(lengths, 4), [[0, 1, 2, 3]])
  np.testing.assert_array_equal(segment_ids_from_lengths(np.array([[3, 2**30, 2**30, 2**30]], np.int32), 6),
                                [[1, 1, 1, 2, 2, 2]])
  # Traced (jit) lengths alike.
  np.testing.assert_array_equal(jax.jit(segment_ids_from_lengths, static_argnums=1)(jnp.asarray([[2**31 - 1, 5]]), 4),
                                [[1, 1, 1, 1]])


@pytest.mark.parametrize("lengths, seqlen, error, match", [
    (np.array([[3, 2]]), -1, ValueError, r"seqlen must lie in \[0, 2\*\*30\), got -1"),
    (np.array([[3, 2]]), 7.0, TypeError, "seqlen must be an int, got 7.0"),
    (np.array([[3, 2]]), True, TypeError, "seqlen must be an int"),
    (np.array([3, 2]), 7, ValueError, r"lengths must have shape \[B, N\]"),
    (np.array([[3.0, 2.0]]), 7, TypeError, "lengths must be an integer array"),
    ("3, 2", 7, TypeError, "lengths must be a JAX or NumPy array"),
])
def test_helpers_from_lengths_refuse_bad_arguments(lengths, seqlen, error, match):
  for helper in (segment_ids_from_lengths, positions_from_lengths):
    with pytest.raises(error, match=match):
      helper(lengths, seqlen)


def test_helpers_from_cu_seqlens():
  # FlashAttention's offsets [0, 3, 5] over 7 tokens: two documents, then padding; the same as lengths [3, 2].
  ids = te_jax.segment_ids_from_cu_seqlens(np.array([0, 3, 5], np.int32), 7)
  pos = te_jax.positions_from_cu_seqlens(np.array([0, 3, 5]), 7)
  np.testing.assert_array_equal(ids, [[1, 1, 1, 2, 2, 0, 0]])
  np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0, 0]])
  assert ids.dtype == jnp.int32 and pos.dtype == jnp.int32
  np.testing.assert_array_equal(te_jax.segment_ids_from_cu_seqlens([0, 0, 4], 4), [[2, 2, 2, 2]])  # an empty document
  np.testing.assert_array_equal(te_jax.segment_ids_from_cu_seqlens([0], 3), [[0, 0, 0]])  # no document
  traced = jax.jit(te_jax.positions_from_cu_seqlens, static_argnums=1)(jnp.asarray([0, 2, 6]), 6)
  np.testing.assert_array_equal(traced, [[0, 1, 0, 1, 2, 3]])


def test_varlen_layout_equals_each_document_alone():
  """q, k, v in FlashAttention's varlen layout ([total, H, D] with cu_seqlens) as one packed row: each document's
  output and gradients are those of the document alone."""
  cu_seqlens, total, heads, d = np.array([0, 40, 41, 100]), 110, 2, 16
  rng = np.random.default_rng(7)
  q, k, v, dout = (rng.standard_normal((total, heads, d)).astype(np.float32) for _ in range(4))
  ids = te_jax.segment_ids_from_cu_seqlens(cu_seqlens, total)
  pos = te_jax.positions_from_cu_seqlens(cu_seqlens, total)

  def varlen(q, k, v):
    return te_jax.fused_attn(q[None], k[None], v[None], mask_type="causal", q_segment_ids=ids, q_positions=pos,
                             kv_positions=pos)[0]

  out, vjp = jax.vjp(varlen, q, k, v)
  grads = vjp(dout)
  tol = tolerance("float32")
  for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
    part = slice(start, end)
    alone = lambda q, k, v: te_jax.fused_attn(q[None], k[None], v[None], mask_type="causal")[0]  # noqa: E731
    ref_out, ref_vjp = jax.vjp(alone, q[part], k[part], v[part])
    np.testing.assert_allclose(out[part], ref_out, atol=tol, rtol=tol)
    for g, rg in zip(grads, ref_vjp(dout[part])):
      np.testing.assert_allclose(g[part], rg, atol=2 * tol, rtol=2 * tol)
  assert np.all(np.asarray(out)[cu_seqlens[-1]:] == 0)  # the padding tail sees no key


@pytest.mark.parametrize("cu_seqlens, error, match", [
    (np.array([1, 3]), ValueError, r"cu_seqlens must start at 0 and never decrease, got \[1, 3\]"),
    (np.array([0, 5, 3]), ValueError, "never decrease"),
    (np.array([[0, 3]]), ValueError, r"cu_seqlens must have shape \[N \+ 1\]"),
    (np.zeros((0,), np.int32), ValueError, r"cu_seqlens must have shape \[N \+ 1\]"),
    (np.array([0.0, 3.0]), TypeError, "cu_seqlens must be an integer array"),
])
def test_helpers_from_cu_seqlens_refuse_bad_arguments(cu_seqlens, error, match):
  for helper in (te_jax.segment_ids_from_cu_seqlens, te_jax.positions_from_cu_seqlens):
    with pytest.raises(error, match=match):
      helper(cu_seqlens, 8)


def _qkv(sq=16, skv=16):
  return jnp.ones((2, sq, 2, 8)), jnp.ones((2, skv, 2, 8)), jnp.ones((2, skv, 2, 8))


@pytest.mark.parametrize("kw,error,match", [
    (dict(mask_type="padding", q_seqlens=[16, 16], kv_seqlens=[16, 16], q_segment_ids=np.ones((2, 16), np.int32)),
     ValueError, "segment id 0"),
    (dict(mask_type="causal_bottom_right", q_positions=np.zeros((2, 16), np.int32)), ValueError, "positions"),
    (dict(q_segment_ids=np.ones((2, 15), np.int32)), ValueError, "q_segment_ids"),
    (dict(q_segment_ids=np.ones((2, 16), np.float32)), TypeError, "q_segment_ids"),
    (dict(q_segment_ids=np.ones((2, 16), np.int32), kv_segment_ids=np.ones((16,), np.int32)), ValueError,
     "kv_segment_ids"),
    (dict(kv_segment_ids=np.ones((2, 16), np.int32)), ValueError, "q_segment_ids"),
    (dict(q_positions=np.ones((1, 16), np.int32)), ValueError, "q_positions"),
    (dict(kv_positions=np.ones((2, 16), np.float16)), TypeError, "kv_positions"),
])
def test_argument_errors(kw, error, match):
  with pytest.raises(error, match=match):
    te_jax.fused_attn(*_qkv(), **kw)


def test_q_segment_ids_alone_needs_equal_lengths():
  with pytest.raises(ValueError, match="Sq == Skv"):
    te_jax.fused_attn(*_qkv(16, 24), q_segment_ids=np.ones((2, 16), np.int32))


def test_core_takes_tokens_on_both_backends_but_not_with_padding_masks():
  from te_jax import _te_jax_cpu as _cpu
  from te_jax.attention_config import AttentionConfig
  from te_jax.mask_type import MaskType
  config = AttentionConfig(MaskType.CAUSAL, -1, -1, 0.125, 0.0, False, has_segment_ids=True)
  params = config.core_params((1, 16, 2, 64), (1, 16, 2, 64), (1, 16, 2, 64), jnp.bfloat16)
  _cpu.validate(params, 0)
  _cpu.validate(params, 1)
  for backend in (0, 1):
    with pytest.raises(ValueError, match="no_mask or causal"):
      _cpu.validate(dict(params, mask_type=int(MaskType.PADDING_CAUSAL)), backend)


@pytest.mark.parametrize("mask", ["no_mask", "causal"])
def test_nonfinite_v_reaches_only_its_document(mask):
  """A NaN in V of a key of document 1 and an inf in V of document 2, inside key tiles that straddle the documents'
  boundary: the other document's rows stay finite and exact (keys a row does not see never affect it)."""
  from helpers import assert_close
  from te_jax.reference import attention_reference
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((1, 200, 2, 32)).astype(np.float32) for _ in range(3))
  v[0, 90, 1, 3] = np.nan
  v[0, 120, 0, 7] = np.inf
  ids = np.asarray(segment_ids_from_lengths(np.array([[100, 100]]), 200))
  out, lse = te_jax.fused_attn(q, k, v, mask_type=mask, q_segment_ids=ids, return_lse=True)
  ref = attention_reference(q, k, v, mask_type=mask, q_segment_ids=ids)
  out = np.asarray(out)
  assert np.isfinite(out[0, :100, 0]).all() and np.isfinite(out[0, 100:, 1]).all()  # the other document's values
  assert np.isnan(out[0, 90:100, 1, 3]).all() and np.isinf(out[0, 120:, 0, 7]).all()  # their own document's rows
  assert_close("out", out, ref["out"], tolerance("float32"))
  assert_close("lse", np.asarray(lse), ref["lse"], tolerance("float32"))


def test_padding_tokens_never_reach_other_tokens():
  """The id-0 tokens after the last document hold garbage: NaN or huge finite values. Every other token's forward and
  gradients stay finite and exact (the GPU kernels' backward products over a straddling tile may still carry such a
  NaN into that tile's gradients: docs/ARCHITECTURE.md "NaN and inf", so their gradients are checked with finite
  garbage only). The padding rows give out 0, lse -inf and zero gradients."""
  from te_jax.reference import attention_reference
  rng = np.random.default_rng(9)
  q, k, v, dout = (rng.standard_normal((2, 200, 2, 32)).astype(np.float32) for _ in range(4))
  ids = np.asarray(segment_ids_from_lengths(np.array([[60, 70], [150, 0]]), 200))
  pad = (ids == 0)[..., None, None]
  ref = attention_reference(q, k, v, mask_type="causal", q_segment_ids=ids, dout=dout)
  f = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", q_segment_ids=ids, return_lse=True)
  tol = tolerance("float32")
  for garbage in (np.nan, 1e4):
    qg, kg, vg = (np.where(pad, np.float32(garbage), x) for x in (q, k, v))
    (out, lse), vjp = jax.vjp(f, qg, kg, vg)
    results = dict(out=out)
    if np.isfinite(garbage) or jax.default_backend() == "cpu":
      results.update(zip(("dq", "dk", "dv"), vjp((dout, np.zeros_like(lse)))))
    for name, got in results.items():
      got = np.asarray(got)
      assert np.isfinite(got).all(), (garbage, name)
      np.testing.assert_allclose(got, np.where(pad, 0.0, ref[name]), rtol=2 * tol, atol=2 * tol, err_msg=name)
    assert np.all(np.asarray(lse).transpose(0, 2, 1)[ids == 0] == -np.inf)


@pytest.mark.parametrize("operand", ["q", "k", "v", "dout"])
def test_nonfinite_in_one_document_leaves_the_others_gradients_exact(operand):
  """A NaN in one operand of document 2's tokens: document 1's gradients are those of document 1 alone (the CPU
  backward's products skip the pairs a row does not see where an operand is non-finite; the GPU kernels' may not yet:
  docs/ARCHITECTURE.md "NaN and inf")."""
  if jax.default_backend() != "cpu":
    pytest.skip("the GPU kernels' backward products may carry a non-finite value across a straddling tile")
  rng = np.random.default_rng(11)
  arrays = dict(zip(("q", "k", "v", "dout"), (rng.standard_normal((1, 200, 2, 32)).astype(np.float32)
                                                for _ in range(4))))
  arrays[operand][0, 150, 1, 5] = np.nan
  ids = segment_ids_from_lengths(np.array([[100, 100]]), 200)
  q, k, v, dout = (arrays[name] for name in ("q", "k", "v", "dout"))
  grads = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", q_segment_ids=ids), q, k, v)[1](dout)
  alone = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal"), q[:, :100], k[:, :100],
                  v[:, :100])[1](dout[:, :100])
  tol = tolerance("float32")
  for name, got, want in zip(("dq", "dk", "dv"), grads, alone):
    np.testing.assert_allclose(np.asarray(got)[:, :100], want, rtol=2 * tol, atol=2 * tol, err_msg=name)
