"""jax.export of a function that calls te_jax: exported with te_jax.disabled_export_checks(), serialised with its
VJP, then run and differentiated in a fresh process that only imports te_jax (the import registers the targets). Its
out, lse and gradients must equal those of the function called directly, bit for bit, on either custom-call path; on
the CPU, and on the GPU where there is one."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flatbuffers", reason="jax.export's serialisation needs flatbuffers (the test extra brings it)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import te_jax  # noqa: E402

# Loads the serialised function and the inputs, calls it and its VJP (the loss weights every output element), and
# saves the results, as float32 (exact for bfloat16, which npz cannot hold) with their dtypes. Nothing of te_jax is
# lowered in this process.
RUN_EXPORTED = """
import sys
import numpy as np
import jax
import te_jax  # noqa: F401  registers te_jax's custom-call targets
exported = jax.export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
x = dict(np.load(sys.argv[2]))
q, k, v = (jax.numpy.asarray(x[name], str(x["dtype"])) for name in "qkv")
loss = lambda q, k, v: sum((o * w).sum() for o, w in zip(exported.call(q, k, v), (x["w_out"], x["w_lse"])))
(out, lse), (dq, dk, dv) = exported.call(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)
results = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
np.savez(sys.argv[3], **{name: np.asarray(r, np.float32) for name, r in results.items()},
         **{name + "_dtype": str(r.dtype) for name, r in results.items()})
"""


def _attention(q, k, v):
  return te_jax.fused_attn(q, k, v, mask_type="causal", return_lse=True, deterministic=True, engine="te")


def _device(platform: str):
  try:
    return jax.devices(platform)[0]
  except RuntimeError:
    pytest.skip(f"no {platform} device here")


@pytest.mark.parametrize("platform,dtype", [("cpu", "float32"), ("cpu", "bfloat16"), ("cuda", "bfloat16")])
def test_exported_function_runs_in_a_fresh_process(path, platform, dtype, tmp_path):
  device = _device(platform)
  keys = jax.random.split(jax.random.key(7), 5)
  q = jax.random.normal(keys[0], (2, 48, 4, 32), dtype)
  k, v = (jax.random.normal(key, (2, 80, 2, 32), dtype) for key in keys[1:3])  # GQA 4 / 2, Sq != Skv
  w_out = jax.random.normal(keys[3], (2, 48, 4, 32), jnp.float32)
  w_lse = jax.random.normal(keys[4], (2, 4, 48), jnp.float32)
  q, k, v, w_out, w_lse = jax.device_put((q, k, v, w_out, w_lse), device)

  with te_jax.custom_call_path(path):
    f = jax.jit(_attention)
    exported = jax.export.export(f, platforms=(platform,), disabled_checks=te_jax.disabled_export_checks())(
        *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)))

    def loss(q, k, v):
      out, lse = f(q, k, v)
      return (out * w_out).sum() + (lse * w_lse).sum()

    (out, lse), grads = f(q, k, v), jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  target = f"te_jax_attention_forward_{platform}_{path}"
  assert target in exported.mlir_module(), f"the exported module does not call {target}"

  blob, inputs, results = tmp_path / "attention.bin", tmp_path / "inputs.npz", tmp_path / "results.npz"
  blob.write_bytes(exported.serialize(vjp_order=1))
  np.savez(inputs, **{name: np.asarray(x, np.float32) for name, x in dict(q=q, k=k, v=v).items()}, dtype=dtype,
           w_out=w_out, w_lse=w_lse)
  env = {name: value for name, value in os.environ.items() if name != "TE_JAX_CUSTOM_CALL"}
  run = subprocess.run([sys.executable, "-c", RUN_EXPORTED, blob, inputs, results], capture_output=True, text=True,
                       timeout=300, env={**env, "JAX_PLATFORMS": platform})
  assert run.returncode == 0, run.stderr[-3000:]

  got = np.load(results)
  expected = dict(out=out, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2])
  for name, value in expected.items():
    assert str(got[name + "_dtype"]) == str(value.dtype), name
    value = np.asarray(value, np.float32)
    assert np.isfinite(value).all() and np.abs(value).max() > 0, name
    np.testing.assert_array_equal(got[name], value, err_msg=f"{name} of the exported function")


def test_disabled_export_checks_name_every_cpu_target():
  names = {str(check) for check in te_jax.disabled_export_checks()}
  for direction in ("forward", "backward"):
    for path in ("ffi", "legacy"):
      assert any(f"te_jax_attention_{direction}_cpu_{path}" in name for name in names), (direction, path, names)
