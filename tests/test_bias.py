"""fused_attn(bias=...): the additive logit bias against the float64 reference, forward, lse and every
gradient (dq, dk, dv, dbias), for each broadcast pattern combined with the masks and variants; a -inf bias that
masks whole rows; jit, grad and vmap; FFI == legacy bitwise; dbias independent of the thread timing."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from helpers import DTYPES, Case, assert_bitwise_equal, assert_close, attn_kwargs, make_inputs, tolerance

# Which dims of [B, H, Sq, Skv] each pattern keeps full (the others are 1).
PATTERNS = {"bhqk": (1, 1, 1, 1), "1hqk": (0, 1, 1, 1), "b11k": (1, 0, 0, 1), "11qk": (0, 0, 1, 1),
            "b1q1": (1, 0, 1, 0)}

# Each pattern with masks and variants; together they cover causal, padding, a window, soft-cap, ALiBi, GQA, D != Dv,
# Sq != Skv and the 16-bit dtypes (the bias in its own dtype).
CASES = [
    ("bhqk", Case(mask="causal", seqlen_q=70, seqlen_kv=150)),
    ("bhqk", Case(mask="padding", q_seqlens=(37, 20), kv_seqlens=(30, 37), softcap=5.0, deterministic=True)),
    ("1hqk", Case(heads=4, kv_heads=2, window=(9, 3), alibi="h")),
    ("1hqk", Case(mask="causal_bottom_right", seqlen_q=20, seqlen_kv=140, head_dim_v=16, dtype="bfloat16")),
    ("b11k", Case(mask="padding_causal", q_seqlens=(37, 11), kv_seqlens=(25, 37), heads=4, kv_heads=1)),
    ("b11k", Case(softcap=3.0, alibi="bh", with_dlse=True, dtype="float16")),
    ("11qk", Case(mask="causal", window=(20, 0), head_dim=16, head_dim_v=48, seqlen_kv=130, seqlen_q=130)),
    ("11qk", Case(deterministic=True, seqlen_q=9, seqlen_kv=260)),
    ("b1q1", Case(mask="padding", q_seqlens=(30, 37), kv_seqlens=(37, 5), alibi="h", with_dlse=True)),
    ("b1q1", Case(mask="causal", heads=4, kv_heads=2, seqlen_q=140, seqlen_kv=140, softcap=2.0)),
]


def _bias_shape(case: Case, pattern: str) -> tuple[int, ...]:
  full = (case.batch, case.heads, case.seqlen_q, case.seqlen_kv)
  return tuple(n if keep else 1 for n, keep in zip(full, PATTERNS[pattern]))


def _random_bias(case: Case, pattern: str, seed: int = 1) -> np.ndarray:
  rng = np.random.default_rng([seed, case.seed])
  return np.asarray(jnp.asarray(rng.standard_normal(_bias_shape(case, pattern)), DTYPES[case.dtype]))


def _run(case: Case, inputs, bias, path: str = "ffi") -> dict:
  """jit(forward + VJP) under `path`; returns out, lse, dq, dk, dv, dbias as numpy."""
  kw = attn_kwargs(case, inputs)

  def fn(q, k, v, bias, dout, dlse):
    (out, lse), vjp = jax.vjp(lambda q, k, v, b: te_jax.fused_attn(q, k, v, bias=b, **kw), q, k, v, bias)
    return (out, lse, *vjp((dout, dlse)))

  with te_jax.custom_call_path(path):
    outs = jax.jit(fn)(inputs.q, inputs.k, inputs.v, bias, inputs.dout, inputs.dlse)
  if path == "legacy":
    te_jax.raise_legacy_failures()
  return dict(zip(("out", "lse", "dq", "dk", "dv", "dbias"), (np.asarray(x) for x in outs)))


def _check(case: Case, got: dict, ref: dict, bias: np.ndarray) -> None:
  for name, x in got.items():
    assert not np.isnan(x.astype(np.float32)).any(), f"{name} has NaN"
  assert got["dbias"].dtype == bias.dtype and got["dbias"].shape == bias.shape
  assert_close("out", got["out"], ref["out"], tolerance(case.dtype))
  assert_close("lse", got["lse"], ref["lse"], tolerance(case.dtype))
  for name in ("dq", "dk", "dv", "dbias"):
    assert_close(name, got[name], ref[name], tolerance(case.dtype, grad=True))


@pytest.mark.parametrize("pattern,case", CASES, ids=[f"{p}-{c.id()}" for p, c in CASES])
def test_matches_reference_and_paths_agree(pattern, case):
  case = case.replace(return_lse=True)
  inputs = make_inputs(case)
  bias = _random_bias(case, pattern)
  got = _run(case, inputs, bias)
  _check(case, got, _reference_with_bias(case, inputs, bias), bias)
  # Bitwise equality needs the deterministic backward: the default one sums dq in an order that follows the threads.
  fixed = case.replace(deterministic=True)
  assert_bitwise_equal(_run(fixed, inputs, bias), _run(fixed, inputs, bias, "legacy"))


def _reference_with_bias(case: Case, inputs, bias) -> dict:
  from te_jax.reference import attention_reference
  return attention_reference(inputs.q, inputs.k, inputs.v, mask_type=case.mask, q_seqlens=inputs.q_seqlens,
                             kv_seqlens=inputs.kv_seqlens, window_size=case.window, scale=case.scale,
                             softcap=case.softcap, alibi_slopes=inputs.alibi, dout=inputs.dout,
                             dlse=inputs.dlse if case.with_dlse else None, bias=bias)


@pytest.mark.parametrize("pattern", ["b11k", "11qk", "bhqk"])
def test_neg_inf_bias_masking_whole_rows_gives_zero(pattern):
  """A 0/-inf bias used as a mask: rows it masks completely give out 0, lse -inf and finite (zero) gradients."""
  case = Case(mask="causal", seqlen_q=70, seqlen_kv=70, return_lse=True)
  inputs = make_inputs(case)
  bias = np.zeros(_bias_shape(case, pattern), np.float32)
  rng = np.random.default_rng(3)
  bias[rng.random(bias.shape) < 0.5] = -np.inf
  if pattern == "b11k":
    bias[1] = -np.inf  # batch entry 1 sees no key at all
  else:
    bias[..., 5, :] = -np.inf  # query row 5 sees no key
  got = _run(case, inputs, bias)
  ref = _reference_with_bias(case, inputs, bias)
  _check(case, got, ref, bias)
  dead = ref["lse"] == -np.inf  # [B, H, Sq]
  assert dead.any()
  assert np.all(got["lse"][dead] == -np.inf)
  assert np.all(got["out"].transpose(0, 2, 1, 3)[dead] == 0.0)
  assert np.all(got["dq"].transpose(0, 2, 1, 3)[dead] == 0.0)
  assert_bitwise_equal(got, _run(case, inputs, bias, "legacy"))


def _loss(q, k, v, bias, **kw):
  return jnp.sum(te_jax.fused_attn(q, k, v, bias=bias, **kw).astype(jnp.float32) ** 2)


def test_grad_under_jit_matches_reference():
  case = Case(mask="causal", heads=4, kv_heads=2)
  inputs = make_inputs(case)
  bias = _random_bias(case, "1hqk")
  grads = jax.jit(jax.grad(partial(_loss, mask_type="causal"), argnums=(0, 1, 2, 3)))(inputs.q, inputs.k, inputs.v,
                                                                                      bias)
  out = np.asarray(te_jax.fused_attn(inputs.q, inputs.k, inputs.v, bias=bias, mask_type="causal"), np.float64)
  ref = _reference_with_bias(case, dataclasses.replace(inputs, dout=2 * out), bias)  # d sum(out^2) / d out = 2 out
  for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
    assert_close(name, g, ref[name], tolerance("float32", grad=True))


@pytest.mark.parametrize("bias_axis", [0, None], ids=["mapped", "unmapped"])
@pytest.mark.parametrize("pattern", ["1hqk", "b11k"])
def test_vmap_matches_a_loop(pattern, bias_axis):
  """vmap folds the mapped axis into the batch: a bias whose batch dim is 1 (mapped or not) must still broadcast."""
  case = Case(batch=2, seqlen_q=20, seqlen_kv=33)
  n = 3
  inputs = [make_inputs(case.replace(seed=i)) for i in range(n)]
  q, k, v = (np.stack([getattr(x, name) for x in inputs]) for name in ("q", "k", "v"))
  biases = np.stack([_random_bias(case, pattern, seed=i) for i in range(n)])
  bias = biases if bias_axis == 0 else biases[0]
  grad_fn = jax.grad(_loss, argnums=(0, 1, 2, 3))
  batched = jax.jit(jax.vmap(grad_fn, in_axes=(0, 0, 0, bias_axis)))(q, k, v, bias)
  for i in range(n):
    single = grad_fn(q[i], k[i], v[i], bias[i] if bias_axis == 0 else bias)
    for name, b, s in zip(("dq", "dk", "dv", "dbias"), batched, single):
      assert_close(name, np.asarray(b)[i], np.asarray(s, np.float64), tolerance("float32", grad=True))


@pytest.mark.parametrize("deterministic", [False, True])
def test_dbias_is_reproducible(deterministic):
  """dbias sums over its broadcast dims in an order fixed by the problem, whatever the threads do."""
  case = Case(batch=3, heads=4, kv_heads=2, seqlen_q=130, seqlen_kv=260, deterministic=deterministic)
  inputs = make_inputs(case)
  bias = _random_bias(case, "11qk")
  first = _run(case.replace(return_lse=True), inputs, bias)["dbias"]
  for _ in range(3):
    assert np.array_equal(first.view(np.uint8), _run(case.replace(return_lse=True), inputs, bias)["dbias"].view(
        np.uint8))


def test_without_bias_hlo_passes_the_placeholder():
  q = jnp.ones((1, 8, 2, 8), jnp.float32)
  hlo = jax.jit(lambda q: te_jax.fused_attn(q, q, q)).lower(q).as_text()
  assert "has_bias = false" in hlo
  hlo = jax.jit(lambda q, b: te_jax.fused_attn(q, q, q, bias=b)).lower(q, jnp.zeros((1, 2, 8, 8))).as_text()
  assert "has_bias = true" in hlo


@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="needs a GPU (the CPU serves it)")
def test_cuda_refuses_deterministic_with_a_summed_dbias_at_lowering():
  q = jnp.ones((2, 8, 2, 64), jnp.bfloat16)
  loss = lambda q, b: jnp.sum(te_jax.fused_attn(q, q, q, bias=b, deterministic=True).astype(jnp.float32))  # noqa: E731
  with pytest.raises(ValueError, match="deterministic=True with a broadcast bias"):
    jax.jit(jax.grad(loss, argnums=1)).lower(q, jnp.zeros((1, 2, 8, 8), jnp.bfloat16))
  jax.jit(jax.grad(loss, argnums=1)).lower(q, jnp.zeros((2, 2, 8, 8), jnp.bfloat16))  # full shape: deterministic
