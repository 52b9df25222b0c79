"""float16 inputs are converted to float32 exactly (cpp/cpu/row_as_float.h: F16C where the CPU has it, else
element_types.h's ToFloat), subnormals included, which XLA's denormals-are-zero threads must not flush: a float16
call gives the float32 call on the same values, its out rounded to float16, bit for bit, in every ISA."""

from __future__ import annotations

import textwrap

import pytest

from helpers import run_program_in_isa

_RUN = textwrap.dedent("""
    import sys
    import numpy as np, jax, te_jax
    rng = np.random.default_rng(0)

    def halves(shape):
      x = rng.standard_normal(shape).astype(np.float16)
      flat = x.reshape(-1)
      at = rng.choice(flat.size, 60, replace=False)
      flat[at[:30]] = (rng.standard_normal(30) * 3e-6).astype(np.float16)  # subnormal halves
      flat[at[30:]] = (rng.standard_normal(30) * 50).astype(np.float16)
      return x

    assert te_jax.cpu_isa() == sys.argv[1], te_jax.cpu_isa()
    # Sq 70: prefill tiles (q packed transposed, K/V tiles copied); Sq 3: packed decode tiles.
    for sq in (70, 3):
      q, k, v = halves((2, sq, 8, 64)), halves((2, 90, 2, 64)), halves((2, 90, 2, 64))
      assert (np.abs(k[k != 0]) < 2**-14).sum() > 0
      f = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal_bottom_right", return_lse=True))
      out16, lse16 = f(q, k, v)
      out32, lse32 = f(*(x.astype(np.float32) for x in (q, k, v)))
      assert np.asarray(out16).tobytes() == np.asarray(out32).astype(np.float16).tobytes(), sq
      assert np.asarray(lse16).tobytes() == np.asarray(lse32).tobytes(), sq
""")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_float16_call_is_the_float32_call_rounded(isa):
  run_program_in_isa(isa, _RUN)
