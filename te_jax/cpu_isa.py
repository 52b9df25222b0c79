"""Which instruction set te_jax's CPU kernels run in: the best the CPU has of AVX-512, AVX2 + FMA and baseline x86-64
(cpp/cpu/isa_dispatch.h), at most the one the environment variable TE_JAX_CPU_ISA names ('avx512', 'avx2' or
'baseline'; read once per process). AVX-512 and AVX2 give the same bits (every product element one fused multiply-add
per key in key order, in vectors of 16 or 8 lanes); baseline x86-64 has no FMA, so its bits differ in the last places.
A cap serves comparisons and machines whose AVX-512 lowers the clock more than its lanes gain."""

from __future__ import annotations

import os

ISAS = ("avx512", "avx2", "baseline")
ENV_VAR = "TE_JAX_CPU_ISA"


def _checked(value: str | None) -> str | None:
  if value is not None and value not in ISAS:
    raise ValueError(f"environment variable {ENV_VAR} must be one of {', '.join(map(repr, ISAS))}, got {value!r}")
  return value


# Checked at import, before the extension (which reads it on its own) could run a kernel.
_checked(os.environ.get(ENV_VAR))


def cpu_isa() -> str:
  """The instruction set this process's CPU kernels run in: 'avx512', 'avx2' or 'baseline'."""
  from te_jax import _backends
  return _backends.backend_for("cpu").extension.cpu_isa()
