"""`python -m te_jax`: a self-check of te_jax on whatever backend is here.

For a few configurations it runs both custom-call paths forward and backward, compares them with the float64
reference and with each other, and prints a table; then it times te_jax against jax.nn.dot_product_attention at one
larger size with the benchmark harness (te_jax.bench). Exits non-zero if any check fails.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax.reference import attention_reference

# (label, shape kwargs, fused_attn kwargs). Small enough to run in seconds on two CPU cores.
CONFIGS = [
    ("no_mask f32", dict(b=2, sq=64, skv=64, h=4, hkv=4, d=64, dv=64, dtype="float32"), dict()),
    ("causal GQA bf16", dict(b=2, sq=96, skv=96, h=8, hkv=2, d=64, dv=64, dtype="bfloat16"),
     dict(mask_type="causal")),
    ("padding_causal_br softcap+alibi f16", dict(b=3, sq=48, skv=80, h=4, hkv=1, d=32, dv=16, dtype="float16"),
     dict(mask_type="padding_causal_bottom_right", q_seqlens=[48, 17, 0], kv_seqlens=[80, 40, 5], softcap=5.0,
          alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
    ("window (16,0) f32", dict(b=1, sq=128, skv=128, h=2, hkv=2, d=128, dv=128, dtype="float32"),
     dict(window_size=(16, 0))),
]

# Relative error bounds per dtype: a few units of the dtype's rounding over the reference's scale.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _inputs(rng, b, sq, skv, h, hkv, d, dv, dtype):
  make = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return make(b, sq, h, d), make(b, skv, hkv, d), make(b, skv, hkv, dv), make(b, sq, h, dv)


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  finite = np.isfinite(want)
  if not np.array_equal(np.isfinite(got), finite) or np.isnan(got).any():
    return float("inf")
  scale = max(np.abs(want[finite]).max(initial=0.0), 1e-30)
  return float(np.abs(got[finite] - want[finite]).max(initial=0.0) / scale)


def _run_path(path, q, k, v, dout, kwargs):
  with te_jax.custom_call_path(path):
    def fwd(q, k, v):
      return te_jax.fused_attn(q, k, v, return_lse=True, **kwargs)
    step = jax.jit(lambda q, k, v, dout: jax.vjp(fwd, q, k, v)[1]((dout, jnp.zeros(q.shape[:1] + (q.shape[2], q.shape[1]),
                                                                                       jnp.float32))))
    out, lse = jax.jit(fwd)(q, k, v)
    grads = step(q, k, v, dout)
    jax.block_until_ready(grads)
    start = time.perf_counter()
    out, lse = jax.block_until_ready(jax.jit(fwd)(q, k, v))
    grads = jax.block_until_ready(step(q, k, v, dout))
    return (out, lse) + tuple(grads), time.perf_counter() - start


def check_configs(rng) -> bool:
  print(f"te_jax {te_jax.__version__} on {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
  print(f"{'config':40} {'path':7} {'fwd err':>9} {'grad err':>9} {'time ms':>8}  result")
  all_ok = True
  for label, shape, kwargs in CONFIGS:
    if jax.devices()[0].platform != "cpu" and shape["dtype"] == "float32":
      continue  # the CUDA backend computes in bf16/fp16
    q, k, v, dout = _inputs(rng, **shape)
    ref = attention_reference(q, k, v, dout=dout, **kwargs)
    results = {}
    for path in ("ffi", "legacy"):
      values, seconds = _run_path(path, q, k, v, dout, kwargs)
      results[path] = values
      fwd_err = max(_relative_error(values[0], ref["out"]), _relative_error(values[1], ref["lse"]))
      grad_err = max(_relative_error(g, ref[n]) for g, n in zip(values[2:], ("dq", "dk", "dv")))
      ok = max(fwd_err, grad_err) <= TOLERANCE[shape["dtype"]]
      all_ok &= ok
      print(f"{label:40} {path:7} {fwd_err:9.1e} {grad_err:9.1e} {seconds * 1e3:8.1f}  {'ok' if ok else 'FAIL'}")
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(results["ffi"], results["legacy"]))
    all_ok &= same
    print(f"{'':40} {'':7} ffi and legacy bitwise equal: {'yes' if same else 'NO'}")
  return all_ok


# The speed comparison's shape per platform: about a second per backend on two CPU cores, a few on a GPU.
SPEED_SHAPES = {"cpu": ["--batch", "1", "--seq", "2048", "--heads", "8", "--head-dim", "64"],
                "gpu": ["--batch", "4", "--seq", "4096", "--heads", "16", "--head-dim", "128"]}


def compare_speed() -> None:
  """One larger size through the benchmark harness: te_jax against the platform's baseline (XLA's attention on the
  CPU, cuDNN on a GPU), timed the same way in the same process. No error check there (check_configs did it), so the
  harness's table shows no error columns."""
  from te_jax.bench.__main__ import main as bench_main

  shape = SPEED_SHAPES["cpu" if jax.devices()[0].platform == "cpu" else "gpu"]
  print()
  bench_main(shape + ["--mode", "fwd", "--backends", "te_jax-ffi", "--no-check", "-q"])


def main() -> int:
  rng = np.random.default_rng(0)
  ok = check_configs(rng)
  compare_speed()
  print("\nself-check " + ("passed" if ok else "FAILED"))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
