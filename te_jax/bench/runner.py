"""A sweep in this process: for each case, each mode, each backend (so every backend meets the same inputs while they
are fresh, and a time budget cuts all backends at the same place), one Result."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Callable

from te_jax.bench.accuracy import measure_errors
from te_jax.bench.availability import Availability, short_error
from te_jax.bench.cases import Case
from te_jax.bench.inputs import Inputs, benchmark_operands, make_sets, rotation_sets
from te_jax.bench.registry import Backend
from te_jax.bench.results import DECODE_QUERIES, Result
from te_jax.bench.timing import PLANS, TimingPlan, measure


@dataclasses.dataclass
class Options:
  platform: str
  keep_going: bool = False
  deadline: float | None = None  # time.time() after which the remaining measurements are skipped
  check_errors: bool = True
  seed: int = 0
  plan: TimingPlan | None = None

  def timing_plan(self) -> TimingPlan:
    return self.plan or PLANS.get(self.platform, PLANS["cpu"])


class SweepStopped(Exception):
  """A measurement failed without --keep-going."""

  def __init__(self, result: Result):
    super().__init__(f"{result.backend} failed on {result.case.shape_label} {result.case.mask_label} {result.mode}: "
                     f"{result.reason} (use --keep-going to record failures and continue)")
    self.result = result


class InputCache:
  """NumPy inputs of the current shape; masks do not change inputs, so causal and non-causal cases share them (and
  the backends of one case share its other operands: a bias can be as large as q)."""

  def __init__(self, seed: int):
    self.seed, self._key, self._sets = seed, None, None
    self._operands_of, self._operands = None, None

  def get(self, case: Case, num_sets: int) -> Inputs:
    key = (case.batch, case.seq_q, case.seq_kv, case.heads, case.kv_heads, case.head_dim, case.dtype)
    if self._key != key or len(self._sets) < num_sets:
      self._key, self._sets, self._operands_of, self._operands = None, None, None, None
      gc.collect()
      self._sets = make_sets(case, num_sets, self.seed)
      self._key = key
    if self._operands_of != case:
      self._operands_of, self._operands = case, benchmark_operands(case, self.seed)
    return Inputs(case, self._sets[:num_sets], **self._operands)


def _failure_reason(e: BaseException) -> str:
  text = short_error(e)
  lowered = text.lower()
  if "resource_exhausted" in lowered or "out of memory" in lowered or "outofmemory" in lowered:
    return "out of memory: " + text
  return text


def _add_note(result: Result, text: str) -> None:
  result.reason = f"{result.reason}; {text}" if result.reason else text


class Runner:

  def __init__(self, options: Options):
    self.options = options
    self.inputs = InputCache(options.seed)
    self._errors: dict[tuple, object] = {}

  def measure(self, backend: Backend, availability: Availability, case: Case, mode: str) -> Result:
    opts = self.options
    result = Result(case=case, mode=mode, backend=backend.name, status="unsupported",
                    **backend.workload(case, mode))
    try:
      reason = backend.why_not(case, mode, opts.platform)
    except Exception as e:  # a version-dependent check that broke: report it, keep going
      reason = f"capability check failed: {short_error(e)}"
    if reason is None and mode not in availability.modes:
      reason = availability.reason or f"{mode} not available"
    if reason:
      result.reason = reason
      return result
    if opts.deadline is not None and time.time() > opts.deadline:
      result.status, result.reason = "skipped", "time budget (--budget) spent"
      return result
    run_case, note = backend.computed_case(case)
    prepared = None
    try:
      t0 = time.perf_counter()
      num_sets = rotation_sets(case, opts.platform)
      prepared = backend.prepare(self.inputs.get(run_case, num_sets), mode, num_sets)
      result.setup_s = time.perf_counter() - t0
      timing = measure(prepared, num_sets, opts.timing_plan())
      if prepared.memory_bytes is not None:
        result.memory_mib = prepared.memory_bytes / 2**20
        result.memory_source = prepared.memory_source
    except Exception as e:
      result.status, result.reason = "failed", _failure_reason(e)
      return result
    finally:
      if prepared is not None:
        prepared.close()
      del prepared
    result.status, result.reason = "ok", note
    result.median_ms, result.p25_ms, result.p75_ms = (x * 1e3 for x in (timing.median_s, timing.p25_s, timing.p75_s))
    result.min_ms, result.max_ms = timing.min_s * 1e3, timing.max_s * 1e3
    result.samples, result.calls_per_sample = timing.samples, timing.calls_per_sample
    if result.flops is not None:
      result.tflops = result.flops / timing.median_s / 1e12
    if result.kv_bytes is not None:
      result.tbps = result.kv_bytes / timing.median_s / 1e12
      if run_case.seq_q <= DECODE_QUERIES:
        result.tokens_per_s = run_case.batch * run_case.seq_q / timing.median_s
    if opts.check_errors and backend.computes_attention:
      self._check_errors(result, backend, run_case)
    return result

  def _check_errors(self, result: Result, backend: Backend, run_case: Case) -> None:
    """The errors of the case the backend computed, against the reference, measured once per small case."""
    key = (backend.name, backend.error_case(run_case), result.mode)
    if key not in self._errors:
      try:
        self._errors[key] = measure_errors(backend, run_case, result.mode, self.options.seed)
      except Exception as e:
        self._errors[key] = e
    errors = self._errors[key]
    if isinstance(errors, Exception):
      _add_note(result, f"error check failed: {short_error(errors)}")
    else:
      result.max_err, result.rel_err, result.err_ok = errors.max_abs, errors.rel, errors.ok
      if not errors.ok:
        _add_note(result, f"inaccurate: {errors.describe()}")


def run_sweep(items: list[tuple[Case, str]], backends: list[Backend], availability: dict[str, Availability],
              options: Options, on_start: Callable | None = None, on_result: Callable | None = None) -> list[Result]:
  """Measures every (case, mode) item with every backend, in item order. Raises SweepStopped on a failure unless
  options.keep_going; on_result sees every result, including the failing one, first."""
  runner = Runner(options)
  results = []
  for case, mode in items:
    for backend in backends:
      if on_start:
        on_start(backend.name, case, mode)
      result = runner.measure(backend, availability[backend.name], case, mode)
      results.append(result)
      if on_result:
        on_result(result)
      if result.status == "failed" and not options.keep_going:
        raise SweepStopped(result)
  return results
