"""GPU tests of the additive logit bias (the CUDA kernels built with a bias): out, lse, dq, dk, dv and dbias
against the float64 reference for each broadcast pattern (bhqk, 1hqk, b11k, 11qk, 111k, b1q1, bh11) with masks,
windows, soft-cap, ALiBi, GQA/MQA, D != Dv, bf16 and fp16 inputs, float32, bf16 and fp16 biases, lengths whose bias
rows start off 16-byte boundaries; both backwards (deterministic=True refuses a bias whose gradient sums over a dim);
FFI and legacy bitwise equal; a -inf bias that masks whole rows gives out 0, lse -inf and zero gradients; packed
sequences with a bias; cuDNN refuses a bias and engine="auto" runs te_jax's kernels. On an H200 the biases whose rows
are whole 16-byte chunks (the "tma" cases among them) run the sm90 kernels, the others the sm80 ones. Skipped without
a GPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

# The CUDA tests' GPU list (importing it skips this module without a GPU), inputs and tolerances.
from test_cuda_attention import _GPUS, TOL, _inputs, _rel  # noqa: E402
from test_cuda_packed import _tokens  # noqa: E402

import te_jax  # noqa: E402
from te_jax._cuda_test_configs import BIAS_CASES, BIAS_PACKED_CASES  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402

NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


def _bias(case, pattern: str, dtype: str, rng) -> jnp.ndarray:
  """A bias of the pattern's shape ("1hqk": [1, H, Sq, Skv], ...), of magnitude like the logits'."""
  b, sq, skv, h = case[2], case[3], case[4], case[5]
  shape = tuple(n if keep != "1" else 1 for n, keep in zip((b, h, sq, skv), pattern))
  return jnp.asarray(2.0 * rng.standard_normal(shape), jnp.dtype(dtype))


def _sums(case, pattern: str) -> bool:
  """Whether dbias sums over a dim (a broadcast dim of extent > 1), which deterministic=True refuses on the GPU."""
  return any(keep == "1" and n > 1 for n, keep in zip((case[2], case[5], case[3], case[4]), pattern))


def _run(q, k, v, bias, kwargs, dout, dlse):
  """jit(forward + VJP) on the GPU: out, lse, dq, dk, dv, dbias as numpy."""
  args = jax.device_put((q, k, v, bias, dout, dlse), _GPUS[0])
  kw = {key: (jax.device_put(val, _GPUS[0]) if hasattr(val, "shape") else val) for key, val in kwargs.items()}

  @jax.jit
  def f(q, k, v, bias, dout, dlse):
    (out, lse), vjp = jax.vjp(lambda q, k, v, b: te_jax.fused_attn(q, k, v, bias=b, return_lse=True, **kw), q, k, v,
                              bias)
    return (out, lse, *vjp((dout, dlse)))

  return dict(zip(NAMES, (np.asarray(x) for x in f(*args))))


def _check(dtype, got, q, k, v, bias, kwargs, dout, dlse) -> dict:
  """Every result against the float64 reference; returns the relative errors."""
  assert got["dbias"].shape == bias.shape and got["dbias"].dtype == bias.dtype
  for name in ("out", "dq", "dk", "dv", "dbias"):
    assert np.isfinite(np.asarray(got[name], np.float64)).all(), f"{name} has non-finite values"
  ref_kwargs = {key: (np.asarray(val) if hasattr(val, "shape") else val) for key, val in kwargs.items()
                if key not in ("deterministic", "engine")}
  as64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
  ref = attention_reference(as64(q), as64(k), as64(v), bias=as64(bias), dout=as64(dout), dlse=as64(dlse), **ref_kwargs)
  tol = TOL[dtype]
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(got["lse"]), finite), "lse is -inf exactly on the rows that see no key"
  if finite.any():
    err = np.max(np.abs(got["lse"][finite] - ref["lse"][finite]))
    assert err < tol["lse"] * max(1.0, np.abs(ref["lse"][finite]).max()), err
  errors = {name: _rel(got[name], ref[name]) for name in ("out", "dq", "dk", "dv", "dbias")}
  assert errors["out"] < tol["out"], errors
  for name in ("dq", "dk", "dv", "dbias"):
    assert errors[name] < tol["grad"], errors
  return errors


def _bias_inputs(case, pattern, bias_dtype):
  seed = zlib.crc32(case[0].encode())
  q, k, v, kwargs, dout, dlse = _inputs(case, seed)
  bias = _bias(case, pattern, bias_dtype, np.random.default_rng(seed + 2))
  return q, k, v, bias, dict(kwargs, engine="te"), dout, dlse


def _assert_paths_agree(ffi, legacy, deterministic: bool, dbias_fixed: bool):
  # The atomic dq's addition order varies between runs, as does a summed dbias's; the rest is the same computation.
  for name in NAMES:
    if (name == "dq" and not deterministic) or (name == "dbias" and not dbias_fixed):
      continue
    assert ffi[name].tobytes() == legacy[name].tobytes(), f"FFI and legacy {name} differ"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case,pattern,bias_dtype", BIAS_CASES, ids=[c[0] for c, _, _ in BIAS_CASES])
def test_bias_matches_reference_and_paths_agree(case, pattern, bias_dtype, deterministic):
  q, k, v, bias, kwargs, dout, dlse = _bias_inputs(case, pattern, bias_dtype)
  kwargs.update(deterministic=deterministic)
  sums = _sums(case, pattern)
  if deterministic and sums:
    with pytest.raises(ValueError, match="deterministic=True with a broadcast bias"):
      _run(q, k, v, bias, kwargs, dout, dlse)
    return
  with te_jax.custom_call_path("ffi"):
    ffi = _run(q, k, v, bias, kwargs, dout, dlse)
  errors = _check(case[1], ffi, q, k, v, bias, kwargs, dout, dlse)
  with te_jax.custom_call_path("legacy"):
    legacy = _run(q, k, v, bias, kwargs, dout, dlse)
  te_jax.raise_legacy_failures()
  _assert_paths_agree(ffi, legacy, deterministic, dbias_fixed=not sums)
  print(f"{case[0]} {pattern} {bias_dtype}: " + " ".join(f"{key}={val:.2e}" for key, val in errors.items()))


@pytest.mark.parametrize("packed,kind,pattern,bias_dtype", BIAS_PACKED_CASES, ids=[c[0] for c, *_ in BIAS_PACKED_CASES])
def test_bias_with_packed_sequences(packed, kind, pattern, bias_dtype):
  q, k, v, bias, kwargs, dout, dlse = _bias_inputs(packed, pattern, bias_dtype)
  kwargs.update(_tokens(packed, kind, np.random.default_rng(zlib.crc32(packed[0].encode()) + 1)))
  with te_jax.custom_call_path("ffi"):
    ffi = _run(q, k, v, bias, kwargs, dout, dlse)
  errors = _check(packed[1], ffi, q, k, v, bias, kwargs, dout, dlse)
  print(f"{packed[0]} {kind} {pattern} {bias_dtype}: " + " ".join(f"{key}={val:.2e}" for key, val in errors.items()))


@pytest.mark.parametrize("pattern", ["bhqk", "b11k", "11qk"])
def test_neg_inf_bias_masking_whole_rows_gives_zero(pattern):
  """A 0/-inf bias used as a mask: rows it masks completely give out 0, lse -inf and zero dq; dk, dv and dbias stay
  finite and match the reference."""
  case = ("neg_inf", "bfloat16", 2, 100, 100, 4, 2, 64, 64, "causal", (-1, -1), 0.0, False, False)
  q, k, v, _, kwargs, dout, dlse = _bias_inputs(case, pattern, "float32")
  rng = np.random.default_rng(3)
  shape = tuple(n if keep != "1" else 1 for n, keep in zip((2, 4, 100, 100), pattern))
  bias = np.where(rng.random(shape) < 0.5, -np.inf, 0.0).astype(np.float32)
  if pattern == "b11k":
    bias[1] = -np.inf  # batch entry 1 sees no key at all
  else:
    bias[..., 5, :] = -np.inf  # query row 5 sees no key
  bias = jnp.asarray(bias)
  got = _run(q, k, v, bias, kwargs, dout, dlse)
  _check(case[1], got, q, k, v, bias, kwargs, dout, dlse)
  dead = ~np.isfinite(got["lse"])  # [B, H, Sq]
  assert dead.any() and np.all(got["lse"][dead] == -np.inf)
  assert np.all(got["out"].transpose(0, 2, 1, 3)[dead] == 0)
  assert np.all(got["dq"].transpose(0, 2, 1, 3)[dead] == 0)


def test_full_shape_dbias_is_reproducible():
  """deterministic=True with a full-shape bias: each dbias element is written once, so every result is bitwise the
  same from run to run."""
  case, pattern, bias_dtype = next(c for c in BIAS_CASES if c[1] == "bhqk")
  q, k, v, bias, kwargs, dout, dlse = _bias_inputs(case, pattern, bias_dtype)
  kwargs.update(deterministic=True)
  first = _run(q, k, v, bias, kwargs, dout, dlse)
  for _ in range(2):
    again = _run(q, k, v, bias, kwargs, dout, dlse)
    for name in NAMES:
      assert first[name].tobytes() == again[name].tobytes(), name


def test_cudnn_refuses_a_bias_and_auto_runs_te():
  case, pattern, bias_dtype = BIAS_CASES[0]
  q, k, v, bias, kwargs, dout, dlse = _bias_inputs(case, pattern, bias_dtype)
  with pytest.raises(te_jax.EngineUnavailableError, match="bias"):
    _run(q, k, v, bias, dict(kwargs, engine="cudnn"), dout, dlse)
  auto = _run(q, k, v, bias, dict(kwargs, engine="auto"), dout, dlse)
  te = _run(q, k, v, bias, kwargs, dout, dlse)
  for name in ("out", "lse", "dk", "dv", "dbias"):
    assert auto[name].tobytes() == te[name].tobytes(), name


def test_zero_bias_matches_no_bias():
  """A zero bias changes nothing but the kernels' tiles (32 keys instead of 64): the same results to rounding."""
  case = BIAS_CASES[0][0]
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=11)
  kwargs.update(engine="te")
  zero = jnp.zeros((1, case[5], case[3], case[4]), jnp.bfloat16)
  with_bias = _run(q, k, v, zero, kwargs, dout, dlse)
  args = jax.device_put((q, k, v, dout, dlse), _GPUS[0])

  @jax.jit
  def plain(q, k, v, dout, dlse):
    (out, lse), vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **kwargs), q, k, v)
    return (out, lse, *vjp((dout, dlse)))

  for name, want in zip(NAMES, plain(*args)):
    assert _rel(with_bias[name], np.asarray(want, np.float64)) < TOL["bfloat16"]["grad"], name
