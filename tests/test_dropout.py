"""fused_attn(dropout_rate=..., dropout_rng=...): attention dropout on the CPU backend. out, lse and every
gradient against the float64 reference applying te_jax.dropout_keep_mask, with masks and variants; the kernel's
effective keep-mask equal to dropout_keep_mask bit for bit; finite differences; rate 0 is plain attention bitwise;
FFI == legacy bitwise; jit, grad, vmap; bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import te_jax
from helpers import Case, assert_bitwise_equal, check_against_reference, make_inputs, reference, run_on_path

KEY = jax.random.key(1234)

# Together: causal and padding masks, a window, soft-cap, ALiBi, GQA, D != Dv, Sq != Skv (over several tiles of both
# sequences), float32 and bfloat16, a gradient through lse; two rates.
CASES = [
    (0.3, Case(mask="causal", seqlen_q=70, seqlen_kv=150)),
    (0.5, Case(mask="padding", q_seqlens=(37, 20), kv_seqlens=(30, 37), softcap=5.0, with_dlse=True)),
    (0.2, Case(heads=4, kv_heads=2, window=(9, 3), alibi="h", head_dim_v=16)),
    (0.7, Case(mask="causal_bottom_right", seqlen_q=20, seqlen_kv=140, dtype="bfloat16")),
    (0.1, Case(mask="padding_causal", q_seqlens=(37, 11), kv_seqlens=(25, 37), heads=4, kv_heads=1, alibi="bh",
               with_dlse=True)),
    (0.4, Case(seqlen_q=130, seqlen_kv=9, softcap=3.0, dtype="bfloat16", with_dlse=True)),
]


def _keep_mask(case: Case, key, rate: float) -> np.ndarray:
  return np.asarray(te_jax.dropout_keep_mask(key, (case.batch, case.heads, case.seqlen_q, case.seqlen_kv), rate))


@pytest.mark.parametrize("rate,case", CASES, ids=[f"{r}-{c.id()}" for r, c in CASES])
def test_matches_reference_and_paths_agree(rate, case):
  inputs = make_inputs(case)
  got = run_on_path(case, inputs, "ffi", dropout_rate=rate, dropout_rng=KEY)
  ref = reference(case, inputs, keep_mask=_keep_mask(case, KEY, rate), dropout_rate=rate)
  check_against_reference(case, inputs, got, ref)
  # Bitwise equality needs the deterministic backward: the default one sums dq in an order that follows the threads.
  fixed = case.replace(deterministic=True)
  assert_bitwise_equal(run_on_path(fixed, inputs, "ffi", dropout_rate=rate, dropout_rng=KEY),
                       run_on_path(fixed, inputs, "legacy", dropout_rate=rate, dropout_rng=KEY))


def _surviving(key, rate: float, batch=2, heads=2, seqlen_q=70, seqlen_kv=131, dtype=jnp.float32) -> np.ndarray:
  """The kernel's effective keep-mask [B, H, Sq, Skv]: with q = 0 every probability is 1 / Skv, and with v the one-hot
  columns (v[j] = e_j) out[b, i, h, j] is probability (i, j) as P.V took it: 0 exactly where it was dropped."""
  q = jnp.zeros((batch, seqlen_q, heads, 8), dtype)
  k = jnp.zeros((batch, seqlen_kv, heads, 8), dtype)
  dv = -(-seqlen_kv // 8) * 8
  v = jnp.broadcast_to(jnp.eye(seqlen_kv, dv, dtype=dtype)[None, :, None, :], (batch, seqlen_kv, heads, dv))
  out = te_jax.fused_attn(q, k, v, dropout_rate=rate, dropout_rng=key)
  return np.asarray(out, np.float32)[..., :seqlen_kv].transpose(0, 2, 1, 3) != 0


@pytest.mark.parametrize("rate", [0.05, 0.5, 0.9])
@pytest.mark.parametrize("key", [jax.random.key(7), jax.random.PRNGKey(99)], ids=["typed", "raw"])
def test_kernel_mask_is_dropout_keep_mask_bitwise(rate, key):
  mask = _surviving(key, rate)
  np.testing.assert_array_equal(mask, np.asarray(te_jax.dropout_keep_mask(key, mask.shape, rate)))
  assert abs(mask.mean() - (1 - rate)) < 0.02  # sanity: the rate is what the mask drops


def test_kept_probabilities_are_scaled_by_one_over_keep_probability():
  rate, seqlen_kv = 0.25, 16
  q, k = jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, seqlen_kv, 1, 8))
  v = jnp.broadcast_to(jnp.eye(seqlen_kv)[None, :, None, :], (1, seqlen_kv, 1, seqlen_kv))
  out = np.asarray(te_jax.fused_attn(q, k, v, dropout_rate=rate, dropout_rng=KEY))
  assert set(np.unique(out).tolist()) <= {0.0, np.float32(1 / seqlen_kv / (1 - rate))}


@pytest.mark.parametrize("key", [None, KEY], ids=["no_key", "key"])
def test_rate_zero_is_plain_attention_bitwise(key):
  case = Case(mask="causal", seqlen_q=70, seqlen_kv=90, with_dlse=True, deterministic=True)
  inputs = make_inputs(case)
  assert_bitwise_equal(run_on_path(case, inputs, "ffi"),
                       run_on_path(case, inputs, "ffi", dropout_rate=0.0, dropout_rng=key), "rate 0 vs none")


def test_lse_is_unchanged_by_dropout():
  case = Case(mask="causal")
  inputs = make_inputs(case)
  plain = run_on_path(case, inputs, "ffi")
  dropped = run_on_path(case, inputs, "ffi", dropout_rate=0.5, dropout_rng=KEY)
  np.testing.assert_array_equal(plain["lse"], dropped["lse"])
  assert not np.array_equal(plain["out"], dropped["out"])


def test_gradients_match_finite_differences():
  rng = np.random.default_rng(5)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(3))

  def f(q, k, v):
    out, lse = te_jax.fused_attn(q, k, v, mask_type="causal", softcap=4.0, dropout_rate=0.3, dropout_rng=KEY,
                                 return_lse=True)
    return jnp.sum(out * jnp.arange(8.0)) + jnp.sum(jnp.sin(lse))

  check_grads(f, (q, k, v), order=1, modes=["rev"], eps=1e-2, atol=2e-2, rtol=2e-2)


def _loss(q, k, v, key):
  return jnp.sum(te_jax.fused_attn(q, k, v, mask_type="causal", dropout_rate=0.4, dropout_rng=key) ** 2)


def test_grad_under_jit_matches_reference_and_keys_differ():
  case = Case(mask="causal", heads=4, kv_heads=2)
  inputs = make_inputs(case)
  grads = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))(inputs.q, inputs.k, inputs.v, KEY)
  out = np.asarray(te_jax.fused_attn(inputs.q, inputs.k, inputs.v, mask_type="causal", dropout_rate=0.4,
                                     dropout_rng=KEY), np.float64)
  ref = reference(case.replace(return_lse=False), inputs.__class__(**{**inputs.__dict__, "dout": 2 * out}),
                  keep_mask=_keep_mask(case, KEY, 0.4), dropout_rate=0.4)
  for name, g in zip(("dq", "dk", "dv"), grads):
    np.testing.assert_allclose(g, ref[name], rtol=1e-4, atol=1e-4, err_msg=name)
  other = jax.jit(_loss)(inputs.q, inputs.k, inputs.v, jax.random.key(1))
  assert other != jax.jit(_loss)(inputs.q, inputs.k, inputs.v, KEY)


def test_vmap_folds_the_mapped_axis_into_the_batch():
  """Example n's batch entry b uses mask entry b * N + n: vmap equals one call on the batch-major folded inputs."""
  n, case = 3, Case(batch=2, seqlen_q=20, seqlen_kv=33, mask="causal")
  stacked = [make_inputs(case.replace(seed=i)) for i in range(n)]
  q, k, v, dout = (np.stack([getattr(x, name) for x in stacked]) for name in ("q", "k", "v", "dout"))

  def attend(q, k, v):
    return te_jax.fused_attn(q, k, v, mask_type="causal", dropout_rate=0.3, dropout_rng=KEY)

  def with_grads(q, k, v, d):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(d))

  mapped = jax.jit(jax.vmap(with_grads))(q, k, v, dout)
  fold = lambda x: x.swapaxes(0, 1).reshape((-1,) + x.shape[2:])  # [N, B, ...] -> [B * N, ...], b * N + n
  folded = jax.jit(with_grads)(*(fold(x) for x in (q, k, v, dout)))
  for name, got, want in zip(("out", "dq", "dk", "dv"), mapped, folded):
    np.testing.assert_allclose(fold(np.asarray(got)), want, rtol=1e-6, atol=1e-6, err_msg=name)
  assert not np.allclose(mapped[0][0], mapped[0][1])  # the examples' masks differ


def test_vmap_over_keys_is_refused():
  q = jnp.ones((3, 1, 8, 1, 8))
  keys = jax.random.split(KEY, 3)
  with pytest.raises(ValueError, match="dropout_rng must be one key"):
    jax.vmap(lambda q, key: te_jax.fused_attn(q, q, q, dropout_rate=0.1, dropout_rng=key))(q, keys)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(dropout_rate=0.1), ValueError, "dropout_rng"),
    (dict(dropout_rate=-0.1, dropout_rng=KEY), ValueError, "dropout_rate"),
    (dict(dropout_rate=1.0, dropout_rng=KEY), ValueError, "dropout_rate"),
    (dict(dropout_rate=float("nan"), dropout_rng=KEY), ValueError, "dropout_rate"),
    (dict(dropout_rate="0.1", dropout_rng=KEY), TypeError, "dropout_rate"),
    (dict(dropout_rate=True, dropout_rng=KEY), TypeError, "dropout_rate"),
    (dict(dropout_rate=0.1, dropout_rng=7), TypeError, "dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=np.zeros(3, np.uint32)), ValueError, "dropout_rng"),
    (dict(dropout_rate=0.1, dropout_rng=np.zeros(2, np.int32)), ValueError, "dropout_rng"),
])
def test_bad_arguments_raise(kwargs, error, match):
  q = jnp.ones((1, 8, 1, 8))
  with pytest.raises(error, match=match):
    te_jax.fused_attn(q, q, q, **kwargs)
