"""The CPU kernels' instruction set (te_jax/cpu_isa.py, cpp/cpu/isa_dispatch.h): capped by TE_JAX_CPU_ISA in
subprocesses, the kernels run in the ISA asked for (or the best below it the CPU has); AVX-512's 16-lane products give
AVX2's bits (forward, lse and gradients; prefill, packed decode and paged tiles); baseline x86-64 (no FMA) gives
other bits, within the float64 reference's tolerance; an unknown value is a clear error at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np

import te_jax
from helpers import tolerance
from te_jax.reference import attention_reference

_RUN = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import te_jax
    rng = np.random.default_rng(0)
    results = {"isa": np.asarray(te_jax.cpu_isa())}
    for name, (sq, skv, h, hkv, d, mask) in {
        "prefill": (150, 150, 4, 2, 64, "causal"),
        "packed_decode": (16, 300, 16, 4, 128, "causal_bottom_right"),
        "rows_apart": (70, 130, 8, 8, 128, "no_mask"),
    }.items():
      q = rng.standard_normal((2, sq, h, d)).astype(np.float32)
      k, v = (rng.standard_normal((2, skv, hkv, d)).astype(np.float32) for _ in range(2))
      # deterministic: dq's sums in an order fixed by the problem, not by the threads' scheduling
      f = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=mask, return_lse=True, deterministic=True)
      out, lse = jax.jit(f)(q, k, v)
      grads = jax.jit(jax.grad(lambda q, k, v: f(q, k, v)[0].sum() + f(q, k, v)[1].sum(), argnums=(0, 1, 2)))(q, k, v)
      for key, x in {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dq": grads[0], "dk": grads[1],
                     "dv": grads[2]}.items():
        results[f"{name}_{key}"] = np.asarray(x)
    pages = rng.permutation(40).reshape(2, 20).astype(np.int32)
    q = rng.standard_normal((2, 1, 8, 128)).astype(np.float32)
    k_pages, v_pages = (rng.standard_normal((40, 16, 2, 128)).astype(np.float32) for _ in range(2))
    out = te_jax.paged_attention(q, k_pages, v_pages, pages, np.asarray([320, 97], np.int32))
    results["paged_out"] = np.asarray(out)
    np.savez(sys.argv[1], **results)
""")


def _run(tmp_path, isa):
  path = tmp_path / f"{isa}.npz"
  env = dict(os.environ, JAX_PLATFORMS="cpu", TE_JAX_CPU_ISA=isa)
  proc = subprocess.run([sys.executable, "-c", _RUN, str(path)], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return dict(np.load(path))


def test_avx512_gives_the_avx2_bits_and_baseline_the_reference(tmp_path):
  best = te_jax.cpu_isa()
  runs = {isa: _run(tmp_path, isa) for isa in ("avx512", "avx2", "baseline")}
  order = ("baseline", "avx2", "avx512")
  for isa, results in runs.items():
    # The cap, or the best below it this CPU has.
    assert str(results["isa"]) == order[min(order.index(isa), order.index(best))]
  for key in runs["avx2"]:
    if key != "isa":
      assert runs["avx512"][key].tobytes() == runs["avx2"][key].tobytes(), key
  base = runs["baseline"]
  for name, mask in (("prefill", "causal"), ("packed_decode", "causal_bottom_right"), ("rows_apart", "no_mask")):
    ref = attention_reference(*(base[f"{name}_{x}"].astype(np.float64) for x in "qkv"), mask_type=mask)
    np.testing.assert_allclose(base[f"{name}_out"], ref["out"], rtol=tolerance("float32"), atol=tolerance("float32"))
    np.testing.assert_allclose(base[f"{name}_lse"], ref["lse"], rtol=tolerance("float32"), atol=tolerance("float32"))
  if best != "baseline":
    # Without FMA the products round twice: the bits are not the vector ISAs' (or the comparison would prove nothing).
    assert base["prefill_out"].tobytes() != runs["avx2"]["prefill_out"].tobytes()


def test_unknown_isa_is_a_clear_error_at_import():
  env = dict(os.environ, JAX_PLATFORMS="cpu", TE_JAX_CPU_ISA="sse9")
  proc = subprocess.run([sys.executable, "-c", "import te_jax"], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "TE_JAX_CPU_ISA must be one of 'avx512', 'avx2', 'baseline', got 'sse9'" in proc.stderr

