"""Errors against te_jax.reference (float64 NumPy) at a small size with the case's mask, variant, head dim and dtype."""

from __future__ import annotations

import dataclasses

import numpy as np

from te_jax.bench.cases import Case
from te_jax.bench.inputs import make_small_inputs

# Relative (Frobenius) error above which a result counts as wrong; a broken kernel lands near 1.
TOLERANCE = {"float32": 5e-3, "bfloat16": 5e-2, "float16": 1e-2}
# The same for rows on e4m3-quantized operands (3 mantissa bits: each value within 2^-4 of itself), whatever the dtype.
FP8_TOLERANCE = 0.15


@dataclasses.dataclass(frozen=True)
class Errors:
  max_abs: float  # the largest |result - reference| over the compared tensors
  rel: float  # the largest ||result - reference|| / ||reference|| over them
  worst: str  # the tensor with the largest relative error
  tolerance: float

  @property
  def ok(self) -> bool:
    return bool(np.isfinite(self.rel) and self.rel <= self.tolerance)

  def describe(self) -> str:
    return f"{self.worst} relative error {self.rel:.2e} (max abs {self.max_abs:.2e}), tolerance {self.tolerance:.0e}"


_reference_cache: dict[tuple, dict] = {}


def reference(inputs, mode: str, extra_bias=None) -> dict:
  """extra_bias: Backend.reference_bias's, added to the case's bias (a case with its own bias takes none)."""
  from te_jax.reference import attention_reference
  case = inputs.case
  key = (case, mode != "fwd", None if extra_bias is None else extra_bias.tobytes())
  if key not in _reference_cache:
    s = inputs.first
    kwargs = case.te_jax_kwargs()
    options = dict(mask_type=kwargs["mask_type"], window_size=kwargs["window_size"], softcap=kwargs["softcap"],
                   alibi_slopes=inputs.alibi, bias=None if inputs.bias is None else np.asarray(inputs.bias, np.float64))
    if extra_bias is not None:
      options["bias"] = np.asarray(extra_bias, np.float64)
    if case.dropout:
      import te_jax
      mask_shape = (case.batch, case.heads, case.seq_q, case.seq_kv)
      options.update(dropout_rate=case.dropout,
                     keep_mask=np.asarray(te_jax.dropout_keep_mask(inputs.dropout_key, mask_shape, case.dropout)))
    q, k, v = (np.asarray(x, np.float64) for x in (s.q, s.k, s.v))
    dout = None if mode == "fwd" else np.asarray(s.dout, np.float64)
    res = attention_reference(q, k, v, dout=dout, sink_logits=inputs.sinks, **options)
    if len(_reference_cache) > 64:
      _reference_cache.clear()
    _reference_cache[key] = res
  return _reference_cache[key]


def compare(results: dict, expected: dict, tolerance: float) -> Errors:
  max_abs, rel, worst = 0.0, 0.0, ""
  for name, got in results.items():
    want = expected[name]
    if got.shape != want.shape:
      return Errors(float("inf"), float("inf"), f"{name} shape {got.shape} != {want.shape}", tolerance)
    diff = got - want
    m = float(np.max(np.abs(diff))) if diff.size else 0.0
    r = float(np.linalg.norm(diff) / max(np.linalg.norm(want), 1e-30))
    if not np.all(np.isfinite(got)):
      m, r = float("inf"), float("inf")
    max_abs = max(max_abs, m)
    if r >= rel or not worst:
      rel, worst = r, name
  return Errors(max_abs, rel, worst, tolerance)


def measure_errors(backend, case: Case, mode: str, seed: int = 0) -> Errors:
  """Runs the backend once on the case's small version and compares every output with the reference."""
  small = backend.error_case(case)
  inputs = make_small_inputs(small, seed)
  prepared = backend.prepare(inputs, mode, 1)
  try:
    results = prepared.outputs()
  finally:
    prepared.close()
  return compare(results, reference(inputs, mode, backend.reference_bias(small)),
                 FP8_TOLERANCE if backend.fp8 else TOLERANCE[case.dtype])
