"""GPU tests of attention dropout (the CUDA kernels built with dropout): out, lse and every gradient against
the float64 reference applying te_jax.dropout_keep_mask, with masks, windows, soft-cap, ALiBi, GQA, D != Dv, bf16 and
fp16, both backwards; FFI and legacy bitwise equal; the kernels' effective keep-mask equal to dropout_keep_mask and to
the CPU backend's bit for bit; the kept fraction over 10^7 draws. Skipped without a GPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

# The CUDA tests' GPU list (importing it skips this module without a GPU), inputs, runner and bounds.
from test_cuda_attention import _GPUS, TOL, _inputs, _rel, _run_on_both_paths  # noqa: E402
from test_dropout import _surviving  # noqa: E402

import te_jax  # noqa: E402
from te_jax._cuda_test_configs import DROPOUT_CASES  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402


def _check(case, rate, key, results, q, k, v, kwargs, dout, dlse):
  b, sq, skv, h = case[2], case[3], case[4], case[5]
  keep = np.asarray(te_jax.dropout_keep_mask(key, (b, h, sq, skv), rate))
  ref_kwargs = {name: (np.asarray(val) if hasattr(val, "shape") else val) for name, val in kwargs.items()
                if name not in ("deterministic", "engine", "dropout_rate", "dropout_rng")}
  ref = attention_reference(*(np.asarray(x, np.float64) for x in (q, k, v)), dout=np.asarray(dout, np.float64),
                            dlse=np.asarray(dlse, np.float64), keep_mask=keep, dropout_rate=rate, **ref_kwargs)
  tol = TOL[case[1]]
  out, lse, dq, dk, dv = results
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(lse), finite) and (lse[~finite] == -np.inf).all()
  assert np.max(np.abs(lse[finite] - ref["lse"][finite]), initial=0.0) < tol["lse"] * max(
      1.0, np.abs(ref["lse"][finite]).max(initial=0.0))
  errors = {name: _rel(x, ref[name]) for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
  assert errors["out"] < tol["out"], errors
  assert max(errors["dq"], errors["dk"], errors["dv"]) < tol["grad"], errors
  return errors


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case,rate", DROPOUT_CASES, ids=[c[0] for c, _ in DROPOUT_CASES])
def test_dropout_matches_reference_and_paths_agree(case, rate, deterministic):
  seed = zlib.crc32(case[0].encode())
  q, k, v, kwargs, dout, dlse = _inputs(case, seed)
  key = jax.random.key(seed)
  kwargs.update(dropout_rate=rate, dropout_rng=key, engine="te", deterministic=deterministic)
  ffi, _ = _run_on_both_paths(q, k, v, kwargs, dout, dlse)
  errors = _check(case, rate, key, ffi, q, k, v, kwargs, dout, dlse)
  print(f"{case[0]} rate {rate}: " + " ".join(f"{name}={val:.2e}" for name, val in errors.items()))


@pytest.mark.parametrize("rate", [0.05, 0.5, 0.9])
@pytest.mark.parametrize("key", [jax.random.key(7), jax.random.PRNGKey(99)], ids=["typed", "raw"])
def test_gpu_mask_is_dropout_keep_mask_and_the_cpus(rate, key):
  """The kernels' effective keep-mask (tests/test_dropout.py's one-hot probe, in bf16 on the GPU) equals
  dropout_keep_mask and the CPU backend's mask for the same key, bit for bit."""
  with jax.default_device(_GPUS[0]):
    gpu = _surviving(key, rate, dtype=jnp.bfloat16)
  with jax.default_device(jax.devices("cpu")[0]):
    cpu = _surviving(key, rate)
  np.testing.assert_array_equal(gpu, np.asarray(te_jax.dropout_keep_mask(key, gpu.shape, rate)))
  np.testing.assert_array_equal(gpu, cpu)


def test_cudnn_engine_refuses_dropout():
  q = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  with pytest.raises(te_jax.EngineUnavailableError, match="dropout"):
    jax.jit(lambda q: te_jax.fused_attn(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                                        engine="cudnn"))(jax.device_put(q, _GPUS[0]))


def test_kept_fraction_over_ten_million_draws():
  rate, draws = 0.3, 0
  kept = 0
  with jax.default_device(_GPUS[0]):
    for seed in range(10):
      mask = _surviving(jax.random.key(seed), rate, batch=4, heads=16, seqlen_q=1024, seqlen_kv=152,
                        dtype=jnp.bfloat16)
      kept += int(mask.sum())
      draws += mask.size
  assert draws >= 10**7
  assert abs(kept / draws - (1 - rate)) < 1e-3 * (1 - rate), kept / draws
