"""fused_attn under JAX transformations: jit, grad, value_and_grad, checkpoint (remat), vmap (against a loop of
unbatched calls) and vmap of grad, on both custom-call paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.reference import attention_reference
from helpers import tolerance

KW = dict(mask_type="causal_bottom_right", window_size=(5, 2), softcap=3.0)


def _data(seed=0, b=2, sq=13, skv=19, h=4, hkv=2, d=16, dv=24, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)
  return arr(b, sq, h, d), arr(b, skv, hkv, d), arr(b, skv, hkv, dv), arr(b, sq, h, dv)


def _bits_equal(a, b):
  a, b = np.atleast_1d(np.asarray(a)), np.atleast_1d(np.asarray(b))
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.fixture(autouse=True)
def _check_legacy(path):
  """Every test here runs on both paths; afterwards no legacy call may have failed."""
  with te_jax.custom_call_path(path):
    yield
  te_jax.raise_legacy_failures()


def _loss(w, **kw):
  return lambda q, k, v: (te_jax.fused_attn(q, k, v, **(kw or KW)).astype(jnp.float32) * w).sum()


def test_jit_matches_eager(path):
  q, k, v, _ = _data()
  eager = te_jax.fused_attn(q, k, v, return_lse=True, **KW)
  jitted = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **KW))(q, k, v)
  assert all(_bits_equal(a, b) for a, b in zip(eager, jitted))


def test_grad_matches_reference_and_vjp(path):
  q, k, v, w = _data()
  grads = jax.jit(jax.grad(_loss(w), argnums=(0, 1, 2)))(q, k, v)
  # d(sum(out * w))/d(q, k, v) is the VJP with cotangent w.
  _, vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, **KW), q, k, v)
  for a, b in zip(grads, vjp(w)):
    assert _bits_equal(a, b)
  ref = attention_reference(q, k, v, dout=w, window_size=KW["window_size"], mask_type=KW["mask_type"],
                            softcap=KW["softcap"])
  tol = tolerance("float32", grad=True)
  for name, g in zip(("dq", "dk", "dv"), grads):
    r = ref[name]
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * np.abs(r).max(), err_msg=name)


def test_grad_single_argnum(path):
  q, k, v, w = _data()
  dq_only = jax.grad(_loss(w))(q, k, v)
  dk_only = jax.grad(_loss(w), argnums=1)(q, k, v)
  dq, dk, _ = jax.grad(_loss(w), argnums=(0, 1, 2))(q, k, v)
  assert _bits_equal(dq_only, dq) and _bits_equal(dk_only, dk)


def test_differentiated_alibi_slopes_are_refused_not_zero(path):
  """The kernels compute no gradient for the slopes: differentiating them is a ValueError at trace time, in fused_attn
  and paged_attention alike; slopes held fixed (closed over, or through stop_gradient) leave q, k, v's gradients as
  they were."""
  q, k, v, w = _data()
  slopes = jnp.linspace(0.1, 0.4, q.shape[2])
  loss = lambda q, k, v, s: (te_jax.fused_attn(q, k, v, alibi_slopes=s, **KW) * w).sum()
  with pytest.raises(ValueError, match=r"alibi_slopes are being differentiated.*jax.lax.stop_gradient"):
    jax.grad(loss, argnums=3)(q, k, v, slopes)
  with pytest.raises(ValueError, match="alibi_slopes are being differentiated"):
    jax.grad(lambda q, t: loss(q, k, v, slopes * t), argnums=(0, 1))(q, 1.0)
  fixed = jax.grad(loss)(q, k, v, slopes)
  stopped = jax.grad(lambda q, t: loss(q, k, v, jax.lax.stop_gradient(slopes * t)))(q, 1.0)
  assert _bits_equal(fixed, stopped) and np.abs(np.asarray(fixed)).max() > 0
  k_pages = jnp.asarray(np.random.default_rng(1).standard_normal((6, 8, 2, 16)), jnp.float32)
  table, lengths = np.asarray([[0, 1, 2], [3, 4, 5]], np.int32), np.asarray([20, 9], np.int32)
  paged = lambda s: te_jax.paged_attention(q[:, :1], k_pages, k_pages, table, lengths, alibi_slopes=s).sum()
  with pytest.raises(ValueError, match="alibi_slopes are being differentiated"):
    jax.grad(paged)(slopes)
  assert np.isfinite(np.asarray(jax.grad(lambda q: te_jax.paged_attention(
      q, k_pages, k_pages, table, lengths, alibi_slopes=slopes).sum())(q[:, :1]))).all()


def test_second_derivatives_are_refused_by_name(path):
  q, k, v, w = _data()
  first = lambda q: jax.grad(_loss(w))(q, k, v).sum()
  with pytest.raises(NotImplementedError, match="te_jax computes first derivatives only"):
    jax.grad(first)(q)
  assert jax.jacrev(lambda q: te_jax.fused_attn(q, k, v, **KW)[0, 0, 0, :2])(q).shape == (2,) + q.shape


def test_value_and_grad(path):
  q, k, v, w = _data(seed=1, dtype=jnp.bfloat16)
  loss = _loss(w)
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert _bits_equal(value, jax.jit(loss)(q, k, v))
  for a, b in zip(grads, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)):
    assert _bits_equal(a, b)
  assert all(a.dtype == jnp.bfloat16 for a in grads)


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.nothing_saveable,
                                    jax.checkpoint_policies.everything_saveable], ids=["default", "nothing", "all"])
def test_checkpoint(path, policy):
  q, k, v, w = _data(seed=2)

  def block(q, k, v):
    return jnp.tanh(te_jax.fused_attn(q, k, v, **KW)) * w

  loss = lambda f: (lambda q, k, v: f(q, k, v).sum())
  remat = jax.checkpoint(block, policy=policy) if policy is not None else jax.checkpoint(block)
  plain_grads = jax.jit(jax.grad(loss(block), argnums=(0, 1, 2)))(q, k, v)
  remat_grads = jax.jit(jax.grad(loss(remat), argnums=(0, 1, 2)))(q, k, v)
  for a, b in zip(plain_grads, remat_grads):
    assert _bits_equal(a, b)
  assert all(np.abs(np.asarray(g)).max() > 0 for g in remat_grads)


def test_checkpoint_recomputes_forward(path):
  """Under nothing_saveable the backward pass re-runs the forward kernel: two forward custom calls in the HLO (with
  value_and_grad, so the primal forward is not dead code)."""
  q, k, v, w = _data(seed=2)
  remat = jax.checkpoint(lambda q, k, v: te_jax.fused_attn(q, k, v, **KW) * w,
                         policy=jax.checkpoint_policies.nothing_saveable)
  loss = lambda q, k, v: remat(q, k, v).sum()
  hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
  assert hlo.count(f"custom_call @te_jax_attention_forward_cpu_{path}") == 2
  assert hlo.count(f"custom_call @te_jax_attention_backward_cpu_{path}") == 1


# vmap: a new leading axis of size N over [B, ...]; compared with a Python loop of unbatched calls.
N = 3


def _vmap_inputs(seed=3):
  rng = np.random.default_rng(seed)
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  qs, ks, vs = arr(N, 2, 11, 4, 16), arr(N, 2, 17, 2, 16), arr(N, 2, 17, 2, 8)
  return qs, ks, vs


VMAP_CASES = {
    # name: (in_axes for (q, k, v), how to slice the stacked inputs for iteration i)
    "all_batched": ((0, 0, 0), lambda x, i, a: x[i]),
    "kv_unbatched": ((0, None, None), lambda x, i, a: x if a is None else x[i]),
    "q_unbatched": ((None, 0, 0), lambda x, i, a: x if a is None else x[i]),
    "q_axis1": ((1, 0, 0), lambda x, i, a: x[:, i] if a == 1 else x[i]),
    "v_axis4": ((0, 0, 4), lambda x, i, a: x[..., i] if a == 4 else x[i]),
}


def _stack_inputs(in_axes):
  qs, ks, vs = _vmap_inputs()
  out = []
  for x, a in zip((qs, ks, vs), in_axes):
    if a is None:
      out.append(x[0])
    else:
      out.append(jnp.moveaxis(x, 0, a))
  return out


@pytest.mark.parametrize("name", list(VMAP_CASES))
def test_vmap_matches_loop(path, name):
  in_axes, take = VMAP_CASES[name]
  args = _stack_inputs(in_axes)
  fn = lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **KW)
  out, lse = jax.jit(jax.vmap(fn, in_axes=in_axes))(*args)
  assert out.shape == (N, 2, 11, 4, 8) and lse.shape == (N, 2, 4, 11)
  single = jax.jit(fn)
  for i in range(N):
    o, l = single(*(take(x, i, a) for x, a in zip(args, in_axes)))
    np.testing.assert_allclose(out[i], o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse[i], l, rtol=1e-6, atol=1e-6)


def test_vmap_with_batched_seqlens_and_alibi(path):
  qs, ks, vs = _vmap_inputs(seed=4)
  q_lens = jnp.array([[11, 0], [3, 11], [7, 7]], jnp.int32)
  kv_lens = jnp.array([[17, 5], [0, 17], [2, 16]], jnp.int32)
  slopes = jnp.linspace(-0.2, 0.3, N * 4).reshape(N, 4)

  def fn(q, k, v, ql, kl, s):
    return te_jax.fused_attn(q, k, v, mask_type="padding_causal_bottom_right", q_seqlens=ql, kv_seqlens=kl,
                             alibi_slopes=s)

  out = jax.jit(jax.vmap(fn))(qs, ks, vs, q_lens, kv_lens, slopes)
  single = jax.jit(fn)
  for i in range(N):
    np.testing.assert_allclose(out[i], single(qs[i], ks[i], vs[i], q_lens[i], kv_lens[i], slopes[i]), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None)], ids=["all_batched", "kv_unbatched"])
def test_vmap_of_grad_matches_loop(path, in_axes):
  qs, ks, vs = _vmap_inputs(seed=5)
  if in_axes[1] is None:
    ks, vs = ks[0], vs[0]
  w = jnp.asarray(np.random.default_rng(6).standard_normal((2, 11, 4, 8)), jnp.float32)
  grad = jax.grad(_loss(w), argnums=(0, 1, 2))
  dqs, dks, dvs = jax.jit(jax.vmap(grad, in_axes=in_axes))(qs, ks, vs)
  grad = jax.jit(grad)
  assert dks.shape == (N,) + ks.shape[-4:]  # per-example gradients even for the unbatched k, v
  for i in range(N):
    k_i, v_i = (ks, vs) if in_axes[1] is None else (ks[i], vs[i])
    for a, b in zip((dqs[i], dks[i], dvs[i]), grad(qs[i], k_i, v_i)):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_grad_of_vmap(path):
  qs, ks, vs = _vmap_inputs(seed=7)
  fn = lambda q, k, v: te_jax.fused_attn(q, k, v, **KW)
  g = jax.grad(lambda q, k, v: (jax.vmap(fn)(q, k, v) ** 2).sum(), argnums=(0, 1, 2))(qs, ks, vs)
  single = jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
  for i in range(N):
    gi = single(qs[i], ks[i], vs[i])
    for a, b in zip(g, gi):
      np.testing.assert_allclose(a[i], b, rtol=1e-6, atol=1e-6)
