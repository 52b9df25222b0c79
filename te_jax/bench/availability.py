"""Availability is proven, not assumed: a backend is available when it runs a tiny case and agrees with the float64
reference (a row that computes no attention: when it runs). Importable-but-failing and importable-but-wrong backends
are unavailable, with the reason."""

from __future__ import annotations

import dataclasses

from te_jax.bench.cases import Case
from te_jax.bench.registry import Backend


@dataclasses.dataclass
class Availability:
  name: str
  available: bool
  reason: str = ""  # why not, or a note (e.g. the backward failed) when available
  modes: tuple[str, ...] = ()  # the modes proven to work

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def probe_case(backend: Backend, platform: str) -> Case:
  """A small square case at d 64, else at d 128 (a backend of one head dim: FP8 q, k, v on a GPU), else a decode-shaped
  one (one query) for a backend that serves decode alone (an FP8 KV cache on a GPU)."""
  dtype = backend.caps.platforms[platform][0]
  square = Case(batch=1, seq_q=128, seq_kv=128, heads=2, kv_heads=2, head_dim=64, dtype=dtype)
  candidates = (square, dataclasses.replace(square, head_dim=128))
  return next((c for c in candidates if backend.why_not(c, "fwd", platform) is None),
              dataclasses.replace(square, seq_q=1))


def short_error(e: BaseException, limit: int = 300) -> str:
  text = " ".join(str(e).split()) or repr(e)
  text = f"{type(e).__name__}: {text}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def probe(backend: Backend, platform: str, need_backward: bool = True) -> Availability:
  """need_backward=False (a forward-only run) skips proving the backward."""
  from te_jax.bench.accuracy import measure_errors
  reason = backend.not_installed()
  if reason:
    return Availability(backend.name, False, reason)
  try:
    reason = backend.platform_reason(platform)
  except Exception as e:
    reason = f"check failed: {short_error(e)}"
  if reason:
    return Availability(backend.name, False, reason)
  case = probe_case(backend, platform)
  if not backend.computes_attention:
    return _probe_by_running(backend, case)
  try:
    errors = measure_errors(backend, case, "fwd")
  except Exception as e:
    return Availability(backend.name, False, f"forward fails: {short_error(e)}")
  if not errors.ok:
    return Availability(backend.name, False, f"wrong forward result: {errors.describe()}")
  modes = ("fwd",)
  note = ""
  if not need_backward:
    return Availability(backend.name, True, "backward not checked (forward-only run)", modes)
  if "fwd+bwd" in backend.caps.modes or "bwd" in backend.caps.modes:
    try:
      errors = measure_errors(backend, case, "fwd+bwd")
      if errors.ok:
        modes = tuple(m for m in ("fwd", "bwd", "fwd+bwd") if m in backend.caps.modes)
      else:
        note = f"backward unavailable: wrong result: {errors.describe()}"
    except Exception as e:
      note = f"backward unavailable: {short_error(e)}"
  return Availability(backend.name, True, note, modes)


def _probe_by_running(backend: Backend, case: Case) -> Availability:
  """A row that times data movement has no reference to agree with: it is available when one call runs."""
  from te_jax.bench.inputs import make_small_inputs
  try:
    prepared = backend.prepare(make_small_inputs(case), "fwd", 1)
    try:
      prepared.run_calls(1)
    finally:
      prepared.close()
  except Exception as e:
    return Availability(backend.name, False, f"fails: {short_error(e)}")
  return Availability(backend.name, True, "times data movement, not attention: no error check", ("fwd",))
