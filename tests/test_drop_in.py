"""te_jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla"): every argument combination
it accepts (bias and boolean mask included), forward and gradients, jitted with traced lengths; the one pinned
difference (rows that see no key); the arguments it refuses."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import assert_close, tolerance

# name: (B, T, S, N, K, H). T == S, T > S and T < S; MHA, GQA and MQA.
SHAPES = {"self_gqa": (2, 9, 9, 4, 2, 16), "qlong_mha": (2, 12, 7, 2, 2, 16), "kvlong_mqa": (2, 5, 11, 4, 1, 8)}
WINDOWS = (None, 2, (4, 0), (0, 3))
LENGTHS = (None, "q", "kv", "both")


def _lengths(which, batch, seqlen_q, seqlen_kv):
  """Lengths inside and outside [0, T] / [0, S] (jax.nn's meaning of the latter: no masking)."""
  q = np.array([seqlen_q - 3, seqlen_q + 5][:batch], np.int32) if which in ("q", "both") else None
  kv = np.array([seqlen_kv - 4, seqlen_kv + 2][:batch], np.int32) if which in ("kv", "both") else None
  return q, kv


def _visible(batch, seqlen_q, seqlen_kv, is_causal, window, q_len, kv_len, mask=None):
  """bool [B, T, N|1, S] by jax.nn's definition (written here, not taken from te_jax); mask is [B|1, N|1, T|1, S|1]."""
  i = np.arange(seqlen_q)[None, :, None]
  j = np.arange(seqlen_kv)[None, None, :]
  q_len = np.full(batch, seqlen_q) if q_len is None else np.asarray(q_len)
  kv_len = np.full(batch, seqlen_kv) if kv_len is None else np.asarray(kv_len)
  vis = (i < q_len[:, None, None]) & (j < kv_len[:, None, None])
  if is_causal:
    vis &= j <= i
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    vis &= (i - left <= j) & (j <= i + right)
  vis = vis[:, :, None, :]
  return vis if mask is None else vis & np.transpose(np.asarray(mask), (0, 2, 1, 3))


def _run(fn, q, k, v, dout, q_len, kv_len, return_residual=False, bias=None, mask=None, **kw):
  """Jitted forward + VJP, lengths, bias and mask traced. Returns numpy (out, residual or None, dq, dk, dv, dbias or
  None)."""

  def f(q, k, v, bias, dout, q_len, kv_len, mask):
    def attn(q, k, v, bias):
      r = fn(q, k, v, bias, mask, query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
             return_residual=return_residual, **kw)
      return r if return_residual else (r, None)
    (out, res), vjp = jax.vjp(attn, q, k, v, bias)
    grads = vjp((dout, None if res is None else jnp.zeros_like(res)))
    return (out, res) + tuple(grads)

  return tuple(None if x is None else np.asarray(x) for x in jax.jit(f)(q, k, v, bias, dout, q_len, kv_len, mask))


def _inputs(shape, dtype, seed=0, unbatched=False):
  b, t, s, n, kh, h = shape
  rng = np.random.default_rng(seed)
  normal = lambda *sh: jnp.asarray(rng.standard_normal(sh), dtype)
  q, k, v, dout = normal(b, t, n, h), normal(b, s, kh, h), normal(b, s, kh, h), normal(b, t, n, h)
  if unbatched:
    q, k, v, dout = (x[0] for x in (q, k, v, dout))
  return q, k, v, dout


def _bias(bias_shape, seed=5):
  """A float32 bias of bias_shape (any rank jax.nn takes), or None."""
  if bias_shape is None:
    return None
  return jnp.asarray(np.random.default_rng(seed).standard_normal(bias_shape), jnp.float32)


def _mask(kind, batch, heads, seqlen_q, seqlen_kv, seed=6):
  """A boolean mask [B|1, N|1, T|1, S|1] in which every row keeps a key (before is_causal, lengths, window), or None.
  random: [B, N, T, S] with one kept key forced per row; padding: keys < a length per batch, [B, 1, 1, S]; causal:
  bottom-right aligned, [1, 1, T, S] (is_causal is top-left, so the two differ when T != S)."""
  if kind is None:
    return None
  rng = np.random.default_rng(seed)
  if kind == "random":
    mask = rng.random((batch, heads, seqlen_q, seqlen_kv)) < 0.5
    mask[..., np.arange(seqlen_q), rng.integers(0, seqlen_kv, seqlen_q)] = True
  elif kind == "padding":
    mask = np.arange(seqlen_kv)[None, None, None, :] < rng.integers(1, seqlen_kv + 1, (batch, 1, 1, 1))
  else:
    mask = np.tril(np.ones((seqlen_q, seqlen_kv), bool), k=max(seqlen_kv - seqlen_q, 0))[None, None]
  return jnp.asarray(mask)


def _compare(shape, is_causal, window, lengths, *, scale=None, return_residual=False, unbatched=False,
             implementation=None, dtype_name="float32", bias_shape=None, mask_kind=None, peer="xla"):
  dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype_name]
  b, t, s, n, kh, h = shape
  if unbatched:
    b, shape = 1, (1,) + shape[1:]
  q, k, v, dout = _inputs(shape, dtype, unbatched=unbatched)
  q_len, kv_len = _lengths(lengths, b, t, s)
  bias, mask = _bias(bias_shape), _mask(mask_kind, b, n, t, s)
  vis = _visible(b, t, s, is_causal, window, q_len, kv_len, mask)
  dead = np.broadcast_to(~vis.any(axis=3), (b, t, n))  # rows that see no key; jax.nn and te_jax differ only there
  dead_rows = dead[0] if unbatched else dead
  # No cotangent on dead rows, so jax.nn's gradient through its (uniform) dead rows does not enter the comparison.
  dout = jnp.where(jnp.asarray(dead_rows)[..., None], 0, dout).astype(dtype)
  kw = dict(is_causal=is_causal, local_window_size=window, scale=scale, bias=bias, mask=mask)
  got = _run(te_jax.dot_product_attention, q, k, v, dout, q_len, kv_len, return_residual, implementation=implementation,
             **kw)
  want = _run(jax.nn.dot_product_attention, q, k, v, dout, q_len, kv_len, return_residual, implementation=peer, **kw)
  for name, g, w in zip(("out", "residual", "dq", "dk", "dv", "dbias"), got, want):
    if w is None:
      assert g is None
      continue
    assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape, g.dtype, w.dtype)
    g, w = g.astype(np.float64), w.astype(np.float64)
    if name in ("out", "residual"):
      assert_close(name, g[~dead_rows], w[~dead_rows], tolerance(dtype_name))
    else:
      assert_close(name, g, w, tolerance(dtype_name, grad=True))
  out, res = got[0].astype(np.float32), got[1]
  assert np.all(out[dead_rows] == 0), "te_jax: a row that sees no key is 0"
  if res is not None:
    assert np.all(res[dead_rows].astype(np.float32) == -np.inf), "te_jax: a row that sees no key has residual -inf"
  return got, want, dead_rows


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda x: f"len_{x}")
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"win_{w}".replace(" ", ""))
@pytest.mark.parametrize("is_causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_jax_nn(shape, is_causal, window, lengths):
  _compare(shape, is_causal, window, lengths)


@pytest.mark.parametrize("scale,return_residual,unbatched", list(itertools.product((None, 0.37), (False, True),
                                                                                  (False, True))))
def test_scale_residual_unbatched(scale, return_residual, unbatched):
  _compare(SHAPES["qlong_mha"], True, (4, 1), "both" if not unbatched else "kv", scale=scale,
           return_residual=return_residual, unbatched=unbatched)


@pytest.mark.parametrize("implementation", (None, "te", "auto"))
def test_implementations(implementation):
  _compare(SHAPES["self_gqa"], True, None, "kv", implementation=implementation)


# bfloat16 only: jax.nn's XLA attention in float16 does not run on the CPU (it asks dot_general for F16_F16_F32).
@pytest.mark.parametrize("dtype_name", ("bfloat16",))
def test_half_dtypes(dtype_name):
  got, _, _ = _compare(SHAPES["self_gqa"], True, 3, "both", return_residual=True, dtype_name=dtype_name)
  assert got[0].dtype == np.dtype(dtype_name) and got[1].dtype == np.dtype(dtype_name)


# The bias shapes jax.nn takes for [B, T, N, S] = self_gqa's (2, 9, 4, 9): rank 4 with each broadcast pattern, and
# lower ranks (leading unit dims added). None is constant along S: such a bias has a gradient of exactly 0, which both
# sides give as rounding noise only.
BIAS_SHAPES = ((2, 4, 9, 9), (1, 4, 9, 9), (2, 1, 1, 9), (1, 1, 9, 9), (2, 4, 1, 9), (9, 9), (4, 1, 9))
# (is_causal, window, lengths) that the bias and the mask are combined with.
MASK_COMBINATIONS = ((False, None, None), (True, None, "kv"), (False, (3, 1), "both"))


def _ids(cases):
  return ["-".join(str(x).replace(" ", "") for x in case) for case in cases]


# Each bias shape, mask kind and shape once, with the combinations in turn (the product would take minutes).
BIAS_CASES = list(zip(BIAS_SHAPES, itertools.cycle(MASK_COMBINATIONS)))
MASK_CASES = [(kind, shape, combination) for kind in ("random", "padding", "causal")
              for shape, combination in zip(SHAPES.values(), MASK_COMBINATIONS)]


@pytest.mark.parametrize("bias_shape,combination", BIAS_CASES, ids=_ids(BIAS_CASES))
def test_bias_matches_jax_nn(bias_shape, combination):
  got, _, _ = _compare(SHAPES["self_gqa"], *combination, bias_shape=bias_shape)
  assert got[5].shape == bias_shape, "the bias gradient has the bias's shape"


@pytest.mark.parametrize("bias_shape", ((4, 9, 9), (1, 1, 9)), ids=("NTS", "11S"))
def test_bias_unbatched(bias_shape):
  _compare(SHAPES["self_gqa"], True, None, None, bias_shape=bias_shape, unbatched=True, return_residual=True)


@pytest.mark.parametrize("mask_kind,shape,combination", MASK_CASES, ids=_ids(MASK_CASES))
def test_mask_matches_jax_nn(mask_kind, shape, combination):
  _compare(shape, *combination, mask_kind=mask_kind, return_residual=True)


@pytest.mark.parametrize("bias_shape,mask_kind,combination", [((1, 4, 9, 9), "random", MASK_COMBINATIONS[1]),
                                                              ((2, 1, 1, 9), "padding", MASK_COMBINATIONS[2])],
                         ids=("random", "padding"))
def test_bias_and_mask_add_up(bias_shape, mask_kind, combination):
  _compare(SHAPES["self_gqa"], *combination, bias_shape=bias_shape, mask_kind=mask_kind)


def test_mask_unbatched_bfloat16():
  _compare(SHAPES["kvlong_mqa"], False, 2, None, mask_kind="random", unbatched=True, dtype_name="bfloat16",
           bias_shape=(1, 5, 11))


def test_rows_with_no_visible_key_differ_from_jax_nn():
  """The pinned difference: te_jax gives 0 (residual -inf, no gradient); jax.nn's large-negative masking makes the row
  the mean of value over all keys (residual a large negative number) and sends gradient to those values."""
  b, t, s, n, kh, h = 2, 6, 5, 2, 1, 8
  q, k, v, dout = _inputs((b, t, s, n, kh, h), jnp.float32, seed=3)
  kv_len = jnp.array([0, 3], jnp.int32)  # batch 0 sees no key at all
  got, got_res = te_jax.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, return_residual=True)
  want, want_res = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, return_residual=True,
                                                implementation="xla")
  np.testing.assert_array_equal(np.asarray(got[0]), 0.0)
  np.testing.assert_array_equal(np.asarray(got_res[0]), -np.inf)
  mean_v = np.broadcast_to(np.asarray(v[0]).mean(axis=0), (t, n, h))  # one kv head serves both query heads
  np.testing.assert_allclose(np.asarray(want[0]), mean_v, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(want_res[0]) < -1e30) and np.all(np.isfinite(np.asarray(want_res[0])))
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-5, atol=1e-6)  # batch 1 agrees
  # A window that leaves late rows with no key (T > S): the same difference, row by row.
  got_w = te_jax.dot_product_attention(q, k, v, local_window_size=(0, 0))
  want_w = jax.nn.dot_product_attention(q, k, v, local_window_size=(0, 0), implementation="xla")
  np.testing.assert_array_equal(np.asarray(got_w[:, s:]), 0.0)
  np.testing.assert_allclose(np.asarray(want_w[:, s:]),
                             np.broadcast_to(np.asarray(v).mean(axis=1, keepdims=True), (b, t - s, n, h)), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(got_w[:, :s]), np.asarray(want_w[:, :s]), rtol=1e-5, atol=1e-6)

  def dv(fn, **kw):
    return jax.grad(lambda v: (fn(q, k, v, key_value_seq_lengths=kv_len, **kw) * dout).sum())(v)

  np.testing.assert_array_equal(np.asarray(dv(te_jax.dot_product_attention)[0]), 0.0)
  assert np.abs(np.asarray(dv(jax.nn.dot_product_attention, implementation="xla")[0])).max() > 1e-3


def test_a_mask_row_that_keeps_no_key_differs_from_jax_nn():
  """The same difference for a boolean mask: a row with no True gives 0 here, the mean of value in jax.nn; the other
  rows agree."""
  b, t, s, n, kh, h = 1, 4, 6, 2, 2, 8
  q, k, v, _ = _inputs((b, t, s, n, kh, h), jnp.float32, seed=7)
  mask = jnp.ones((1, 1, t, s), bool).at[:, :, 2].set(False)  # query row 2 keeps no key
  got = np.asarray(te_jax.dot_product_attention(q, k, v, mask=mask))
  want = np.asarray(jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla"))
  np.testing.assert_array_equal(got[:, 2], 0.0)
  np.testing.assert_allclose(want[:, 2], np.asarray(v).mean(axis=1), rtol=1e-5, atol=1e-6)
  kept = np.array([0, 1, 3])
  np.testing.assert_allclose(got[:, kept], want[:, kept], rtol=1e-5, atol=1e-6)


def test_lengths_outside_the_range_mean_what_they_mean_to_jax_nn():
  q, k, v, _ = _inputs((3, 5, 6, 2, 2, 8), jnp.float32, seed=4)
  kw = dict(query_seq_lengths=jnp.array([-2, 9, 3], jnp.int32), key_value_seq_lengths=jnp.array([7, 100, -1], jnp.int32))
  got = np.asarray(te_jax.dot_product_attention(q, k, v, **kw))
  want = np.asarray(jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw))
  np.testing.assert_array_equal(got[0], 0.0)  # q length < 0: no rows; jax.nn agrees
  np.testing.assert_array_equal(want[0], 0.0)
  np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)  # both past the end: nothing masked
  np.testing.assert_array_equal(got[2], 0.0)  # kv length < 0: no keys (jax.nn: the mean of v for rows < 3)


def _qkv():
  return _inputs((2, 8, 8, 2, 2, 16), jnp.float32)[:3]


@pytest.mark.parametrize("kwargs,match", [
    (dict(bias=jnp.zeros((1, 1, 3, 8))), r"bias must be broadcastable to \[B, N, T, S\] = \(2, 2, 8, 8\)"),
    (dict(bias=jnp.zeros((1, 1, 1, 8, 8))), "at most rank 4"),
    (dict(mask=jnp.ones((2, 1, 8, 8), jnp.float32)), "mask must be a boolean array"),
    (dict(implementation="xla"), "jax.nn.dot_product_attention"),
    (dict(implementation="flash"), "implementation must be None or one of"),
    (dict(local_window_size=-1), "local_window_size left must be >= 0"),
    (dict(local_window_size=(2, -1)), "local_window_size right must be >= 0"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), r"query_seq_lengths must have shape \[B\]"),
    (dict(key_value_seq_lengths=jnp.ones((2,), jnp.float32)), "key_value_seq_lengths dtype must be int32"),
    (dict(scale=0.0), "scale"),
])
def test_refused_arguments(kwargs, match):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match):
    te_jax.dot_product_attention(q, k, v, **kwargs)


def test_refused_shapes_and_dtypes():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"head dim H of query, key and value must be a multiple of 8 .*got 12"):
    te_jax.dot_product_attention(q[..., :12], k[..., :12], v[..., :12])
  with pytest.raises(ValueError, match="query dtype must be key's dtype"):
    te_jax.dot_product_attention(q.astype(jnp.bfloat16), k, v)
  with pytest.raises(ValueError, match="value shape must be"):
    te_jax.dot_product_attention(q, k, v[:, :4])
  with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
    te_jax.dot_product_attention(jnp.concatenate([q, q[:, :, :1]], axis=2), k, v)
  with pytest.raises(ValueError, match="multiple of the number of key/value heads, got 2 and 0"):
    te_jax.dot_product_attention(q, k[:, :, :0], v[:, :, :0])
  with pytest.raises(TypeError, match="local_window_size"):
    te_jax.dot_product_attention(q, k, v, local_window_size=(1, 2, 3))


def test_cudnn_on_the_cpu_says_why():
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU has no cuDNN")
  q, k, v = _qkv()
  with pytest.raises(ValueError):
    jax.block_until_ready(te_jax.dot_product_attention(q, k, v, implementation="cudnn"))
