"""te_jax.merge_states: attention over two disjoint key sets, merged by lse, equals attention over their union (float64
reference); empty parts are no-ops, non-finite values propagate, bad shapes are clear errors; jit, vmap and grad."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.reference import attention_reference


def _parts(rng, b=2, sq=5, skv=23, h=4, hkv=2, d=16, split=9):
  q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
  k = rng.standard_normal((b, skv, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, skv, hkv, d)).astype(np.float32)
  return q, k, v, split


@pytest.mark.parametrize("mask_type", ["no_mask", "causal_bottom_right"])
def test_merged_parts_equal_attention_over_all_keys(mask_type):
  """Cascade attention: a shared prefix of keys and a suffix, attended separately (the suffix with the mask aligned
  to the end of all keys), merged."""
  rng = np.random.default_rng(0)
  q, k, v, split = _parts(rng)
  sq, skv = q.shape[1], k.shape[1]
  scale = 1 / np.sqrt(q.shape[-1])
  out_a, lse_a = te_jax.fused_attn(q, k[:, :split], v[:, :split], scale=scale, return_lse=True)
  out_b, lse_b = te_jax.fused_attn(q, k[:, split:], v[:, split:], mask_type=mask_type, scale=scale, return_lse=True)
  out, lse = jax.jit(te_jax.merge_states)(out_a, lse_a, out_b, lse_b)
  ref = attention_reference(q, k, v, mask_type=mask_type, scale=scale)
  # The suffix holds every key a bottom-right causal row may skip (sq <= skv - split), so the prefix is unmasked.
  assert sq <= skv - split
  np.testing.assert_allclose(np.asarray(out), ref["out"], rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), ref["lse"], rtol=2e-5, atol=2e-5)
  assert out.dtype == jnp.float32 and lse.dtype == jnp.float32


def test_empty_parts_and_dtype():
  rng = np.random.default_rng(1)
  out_a = jnp.asarray(rng.standard_normal((1, 3, 2, 8)), jnp.bfloat16)
  lse_a = jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32)
  zeros, empty = jnp.zeros_like(out_a), jnp.full_like(lse_a, -jnp.inf)
  out, lse = te_jax.merge_states(out_a, lse_a, zeros, empty)
  assert out.dtype == jnp.bfloat16
  assert np.array_equal(np.asarray(out), np.asarray(out_a)) and np.array_equal(np.asarray(lse), np.asarray(lse_a))
  out, lse = te_jax.merge_states(zeros, empty, zeros, empty)
  assert (np.asarray(out, np.float32) == 0).all() and (np.asarray(lse) == -np.inf).all()


def test_non_finite_values_propagate():
  rng = np.random.default_rng(2)
  out_a, out_b = (jnp.asarray(rng.standard_normal((1, 3, 2, 4)), jnp.float32) for _ in range(2))
  lse_a, lse_b = (jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32) for _ in range(2))
  out, lse = te_jax.merge_states(out_a, lse_a.at[0, 1, 2].set(jnp.nan), out_b, lse_b)
  assert np.isnan(np.asarray(lse)[0, 1, 2]) and np.isnan(np.asarray(out)[0, 2, 1]).all()
  assert np.isfinite(np.delete(np.asarray(lse).ravel(), 5)).all()
  out, _ = te_jax.merge_states(out_a.at[0, 0, 0, 3].set(jnp.inf), lse_a, out_b, lse_b)
  assert np.isinf(np.asarray(out)[0, 0, 0, 3])
  # A NaN out of a part that saw no key stays out of the result only through its zero weight: 0 * NaN is NaN.
  out, _ = te_jax.merge_states(out_a, lse_a, out_b.at[0, 0, 0, 0].set(jnp.nan), jnp.full_like(lse_b, -jnp.inf))
  assert np.isnan(np.asarray(out)[0, 0, 0, 0])


def test_vmap_and_grad():
  rng = np.random.default_rng(3)
  args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 1, 4, 2, 8), (3, 1, 2, 4)) * 2]
  batched = jax.vmap(te_jax.merge_states)(*args)
  single = te_jax.merge_states(*(a[1] for a in args))
  np.testing.assert_allclose(np.asarray(batched[0][1]), np.asarray(single[0]), rtol=1e-6)
  # Gradients stay finite next to an empty part (lse -inf on both sides of some rows).
  lse_empty = args[1][0].at[0, 0].set(-jnp.inf)
  grads = jax.grad(lambda oa, la, ob, lb: jnp.sum(te_jax.merge_states(oa, la, ob, lb)[0]), argnums=(0, 1, 2, 3))(
      args[0][0], lse_empty, args[2][0], lse_empty)
  assert all(np.isfinite(np.asarray(g)).all() for g in grads)


@pytest.mark.parametrize("bad, message", [
    (dict(out_b=np.zeros((1, 3, 2, 5), np.float32)), "out_b must have out_a's shape"),
    (dict(lse_a=np.zeros((1, 3, 2), np.float32)), r"lse_a must have shape \[B, H, S\]"),
    (dict(out_a=np.zeros((3, 2, 4), np.float32)), r"out_a must have shape \[B, S, H, Dv\]"),
])
def test_bad_shapes_are_clear_errors(bad, message):
  args = dict(out_a=np.zeros((1, 3, 2, 4), np.float32), lse_a=np.zeros((1, 2, 3), np.float32),
              out_b=np.zeros((1, 3, 2, 4), np.float32), lse_b=np.zeros((1, 2, 3), np.float32))
  args.update(bad)
  with pytest.raises(ValueError, match=message):
    te_jax.merge_states(**args)


def test_lists_are_refused_like_fused_attn():
  with pytest.raises(TypeError, match="out_a must be a JAX or NumPy array, got list"):
    te_jax.merge_states([[[[0.0]]]], np.zeros((1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32),
                        np.zeros((1, 1, 1), np.float32))


def test_integer_inputs_are_refused():
  with pytest.raises(TypeError, match="lse_b must be a floating-point array"):
    te_jax.merge_states(np.zeros((1, 3, 2, 4), np.float32), np.zeros((1, 2, 3), np.float32),
                        np.zeros((1, 3, 2, 4), np.float32), np.zeros((1, 2, 3), np.int32))
