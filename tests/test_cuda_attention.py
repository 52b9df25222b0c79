"""GPU tests of the CUDA backend: forward, lse and every gradient against the float64 reference (te_jax/reference.py)
for every mask, window, softcap, ALiBi, GQA/MQA, D != Dv, ragged lengths, bf16 and fp16; FFI and legacy bitwise
equal; CPU and GPU backends agree; invalid run-time lengths give NaN, never out-of-bounds reads. Skipped without a GPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

try:
  _GPUS = jax.devices("gpu")
except RuntimeError:
  _GPUS = []
if not _GPUS:
  pytest.skip("no GPU: the CUDA backend tests need one", allow_module_level=True)
try:
  import te_jax._cuda  # noqa: F401,E402  (registers the cuda backend)
except ImportError as e:
  pytest.skip(f"te_jax was built without its CUDA backend: {e}", allow_module_level=True)

import te_jax  # noqa: E402
from te_jax._cuda_test_configs import CASES  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402

# Relative Frobenius error bounds: bf16 has 8 mantissa bits, fp16 11; P and dS are rounded to the input dtype before
# their matrix products (as in FlashAttention), so gradients get a looser bound than the output.
TOL = {"bfloat16": dict(out=2e-2, grad=4e-2, lse=2e-2), "float16": dict(out=4e-3, grad=1e-2, lse=5e-3)}


def _inputs(case, seed):
  name, dtype, b, sq, skv, h, hkv, d, dv, mask, window, softcap, alibi, ragged = case
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(dtype)
  q = jnp.asarray(rng.standard_normal((b, sq, h, d)), dt)
  k = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), dt)
  v = jnp.asarray(rng.standard_normal((b, skv, hkv, dv)), dt)
  kwargs = dict(mask_type=mask, window_size=window, softcap=softcap)
  if ragged:
    qs = rng.integers(0, sq + 1, size=b).astype(np.int32)
    qs[0] = sq
    ks = rng.integers(1, skv + 1, size=b).astype(np.int32)
    if b > 2:
      qs[2] = 0  # an empty batch
    kwargs.update(q_seqlens=jnp.asarray(qs), kv_seqlens=jnp.asarray(ks))
  if alibi:
    kwargs["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.3, size=(b, h)), jnp.float32)
  dout = jnp.asarray(rng.standard_normal((b, sq, h, dv)), dt)
  dlse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
  return q, k, v, kwargs, dout, dlse


def _run(q, k, v, kwargs, dout, dlse, device):
  args = jax.device_put((q, k, v, dout, dlse), device)
  kw = {key: (jax.device_put(val, device) if hasattr(val, "shape") else val) for key, val in kwargs.items()}

  @jax.jit
  def f(q, k, v, dout, dlse):
    (out, lse), vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **kw), q, k, v)
    dq, dk, dv = vjp((dout, dlse))
    return out, lse, dq, dk, dv

  return [np.asarray(x) for x in f(*args)]


def _rel(x, ref):
  x = np.asarray(x, np.float64)
  num = np.linalg.norm(x - ref)
  den = max(np.linalg.norm(ref), 1e-6)
  return num / den


def _check_against_reference(case, results, q, k, v, kwargs, dout, dlse):
  dtype = case[1]
  out, lse, dq, dk, dv = results
  for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name} has non-finite values"
  ref_kwargs = {key: (np.asarray(val) if hasattr(val, "shape") else val) for key, val in kwargs.items()
                if key != "deterministic"}
  ref = attention_reference(np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(v, np.float64),
                            dout=np.asarray(dout, np.float64), dlse=np.asarray(dlse, np.float64), **ref_kwargs)
  tol = TOL[dtype]
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(lse), finite), "lse is -inf exactly on the rows that see no key"
  assert (lse[~finite] == -np.inf).all(), "empty rows have lse = -inf"
  if finite.any():
    assert np.max(np.abs(lse[finite] - ref["lse"][finite])) < tol["lse"] * max(1.0, np.abs(ref["lse"][finite]).max())
  errors = {"out": _rel(out, ref["out"]), "dq": _rel(dq, ref["dq"]), "dk": _rel(dk, ref["dk"]), "dv": _rel(dv, ref["dv"])}
  assert errors["out"] < tol["out"], errors
  for g in ("dq", "dk", "dv"):
    assert errors[g] < tol["grad"], errors
  return errors


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_paths_agree(case, deterministic):
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=zlib.crc32(case[0].encode()))
  kwargs["deterministic"] = deterministic
  gpu = _GPUS[0]
  with te_jax.custom_call_path("ffi"):
    ffi = _run(q, k, v, kwargs, dout, dlse, gpu)
  errors = _check_against_reference(case, ffi, q, k, v, kwargs, dout, dlse)
  with te_jax.custom_call_path("legacy"):
    legacy = _run(q, k, v, kwargs, dout, dlse, gpu)
  te_jax.raise_legacy_failures()
  _check_against_reference(case, legacy, q, k, v, kwargs, dout, dlse)
  # Only dq of the atomic backward may differ between runs (its float additions land in any order).
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ffi, legacy):
    if deterministic or name != "dq":
      assert a.tobytes() == b.tobytes(), f"FFI and legacy {name} differ"
  print(f"{case[0]} deterministic={deterministic}: " + " ".join(f"{key}={val:.2e}" for key, val in errors.items()))


@pytest.mark.parametrize("case", [CASES[5], CASES[15]], ids=[CASES[i][0] for i in (5, 15)])
def test_deterministic_backward_is_reproducible_and_agrees_with_atomic(case):
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=11)
  first = _run(q, k, v, dict(kwargs, deterministic=True), dout, dlse, _GPUS[0])
  second = _run(q, k, v, dict(kwargs, deterministic=True), dout, dlse, _GPUS[0])
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
    assert a.tobytes() == b.tobytes(), f"deterministic {name} differs between two runs"
  atomic = _run(q, k, v, dict(kwargs, deterministic=False), dout, dlse, _GPUS[0])
  for name, a, b in zip(("out", "lse"), first[:2], atomic[:2]):
    assert a.tobytes() == b.tobytes(), f"{name} depends on the backward's scheme"
  # The same rounded products summed in another order (dq) or over other tile shapes (dk, dv): within a few ulps of
  # the element type, far below the error against the float64 reference.
  for name, a, b in zip(("dq", "dk", "dv"), first[2:], atomic[2:]):
    assert _rel(np.asarray(b, np.float64), np.asarray(a, np.float64)) < 1e-2, name


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[11]], ids=[CASES[i][0] for i in (1, 5, 11)])
def test_gpu_and_cpu_backends_agree(case):
  try:
    import te_jax._te_jax_cpu  # noqa: F401
  except ImportError as e:
    pytest.skip(f"the CPU backend extension does not import in this build: {e}")
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=7)
  gpu_res = _run(q, k, v, kwargs, dout, dlse, _GPUS[0])
  cpu_res = _run(q, k, v, kwargs, dout, dlse, jax.devices("cpu")[0])
  _check_against_reference(case, cpu_res, q, k, v, kwargs, dout, dlse)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), gpu_res, cpu_res):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin), name
    assert _rel(a[fin], b[fin]) < 5e-2, name


def test_invalid_runtime_seqlens_give_nan():
  """Lengths outside [0, S] that reach the kernel (traced values) are clamped for memory safety and flagged: every
  output of that batch is NaN; the other batches are unaffected."""
  case = CASES[4]
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=3)
  qs = jnp.asarray([q.shape[1], q.shape[1] + 50, 5], jnp.int32)
  ks = jnp.asarray([k.shape[1], 7, -3], jnp.int32)

  @jax.jit
  def f(q, k, v, qs, ks):
    return te_jax.fused_attn(q, k, v, mask_type="padding", q_seqlens=qs, kv_seqlens=ks, return_lse=True)

  out, lse = (np.asarray(x, np.float32) for x in f(q, k, v, qs, ks))
  assert np.isfinite(out[0]).all() and np.isnan(out[1]).all() and np.isnan(out[2]).all()
  assert np.isnan(lse[1]).all() and np.isnan(lse[2]).all()


def test_compile_is_cached_in_process():
  from te_jax import _te_jax_cuda as ext
  from te_jax.attention_config import AttentionConfig
  from te_jax.mask_type import MaskType
  params = AttentionConfig(MaskType.CAUSAL, -1, -1, 0.125, 0.0, False).core_params(
      (1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64), jnp.bfloat16)
  ext.prepare(params, "forward")
  assert ext.prepare(params, "forward")["origin"] == "memory"
