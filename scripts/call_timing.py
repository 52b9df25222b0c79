"""The scripts' one timing loop: back-to-back calls of a jitted function, the median over samples of the time per call.
For A/B comparisons inside one process (scripts/decode_ab.py, scripts/cp_overlap.py); the harness (te_jax.bench)
calibrates its own samples."""

from __future__ import annotations

import time

import jax
import numpy as np


def seconds_per_call(fn, args, calls: int, samples: int, warmup: int = 3) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(samples):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls)
  return float(np.median(times))
