"""Timing, one method for every backend. Setup (compiling, placing inputs) is done before; here: warm-up calls
outside the timed region (every rotation set once), then `samples` timed samples, each many calls dispatched back to
back with a single synchronisation at the end (wall clock around block_until_ready for JAX, CUDA events after a
synchronize for torch), each call on the next rotation set. Calls per sample are calibrated so a sample lasts about
`sample_s`: runs of 1, 2, 4, ... calls until one lasts a tenth of that, then that many again, the faster of the two
giving the time per call (one run alone carries whatever one-off stall hits it: a stall in it can cut a 1 ms call's
samples to 2 calls, each sample then paying a synchronisation's latency). The median of the per-call times is reported
with the spread of the samples."""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass(frozen=True)
class TimingPlan:
  sample_s: float = 0.02  # target length of one sample
  samples: int = 5
  min_samples: int = 3  # for calls so long that `samples` would exceed max_s
  max_s: float = 2.0  # rough cap on the timed part of one measurement
  max_calls: int = 2000


PLANS = {"gpu": TimingPlan(), "cpu": TimingPlan(sample_s=0.15, samples=5, min_samples=3, max_s=3.0)}


@dataclasses.dataclass(frozen=True)
class Timing:
  median_s: float
  p25_s: float
  p75_s: float
  min_s: float
  max_s: float
  samples: int
  calls_per_sample: int

  @property
  def spread(self) -> float:
    """Half the interquartile range relative to the median."""
    return (self.p75_s - self.p25_s) / 2 / self.median_s if self.median_s > 0 else 0.0


def _quartiles(xs: list[float]) -> tuple[float, float]:
  if len(xs) < 2:
    return xs[0], xs[0]
  q = statistics.quantiles(xs, n=4, method="inclusive")
  return q[0], q[2]


def _calibrate(prepared, plan: TimingPlan, max_calls: int) -> tuple[int, list[float]]:
  """The calls of the last two calibration runs and their times per call."""
  n = 1
  while True:
    elapsed = prepared.run_calls(n)
    if elapsed >= plan.sample_s / 10 or n >= max_calls:
      return n, [elapsed / n, prepared.run_calls(n) / n]
    n = min(2 * n, max_calls)


def measure(prepared, num_sets: int, plan: TimingPlan) -> Timing:
  prepared.run_calls(max(1, num_sets))  # warm-up: every set once (first-touch, autotuning, lazy init)
  max_calls = min(plan.max_calls, getattr(prepared, "max_calls", lambda: plan.max_calls)())
  calibration_calls, calibration = _calibrate(prepared, plan, max_calls)
  once = min(calibration)
  calls = int(max(1, min(max_calls, plan.sample_s / max(once, 1e-9))))
  samples = plan.samples
  if once * samples > plan.max_s:
    samples = max(plan.min_samples, int(plan.max_s / max(once, 1e-9)))
  # One-call calibration runs are samples like the others (calls that long are not stalled by a one-off).
  per_call = calibration[:samples] if calls == calibration_calls == 1 else []
  while len(per_call) < samples:
    per_call.append(prepared.run_calls(calls) / calls)
  p25, p75 = _quartiles(per_call)
  return Timing(median_s=statistics.median(per_call), p25_s=p25, p75_s=p75, min_s=min(per_call), max_s=max(per_call),
                samples=len(per_call), calls_per_sample=calls)
