"""engine="auto" on the GPU: the faster of the engines that serve a configuration, measured once on this GPU.

A measurement runs each candidate on scratch buffers of the call's shapes (cpp/cuda/engine_timing.h) at lowering and
is kept on disk beside the cubins (<cache>/../autotune), keyed by the GPU, its driver, the cuDNN and te_jax versions,
the digest of te_jax's kernel sources and the configuration, so later processes pay nothing. TE_JAX_AUTOTUNE=0 (or a
measurement that fails, e.g. for lack of GPU memory, which is logged) uses the built-in table instead."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import time

from te_jax import _logging
from te_jax.engine import Choice, params_for_engine

logger = _logging.logger.getChild("engine")


def table_choice(params: dict, direction: str) -> Choice:
  """The built-in table, for when nothing is measured: cuDNN wherever it serves. On the H200 (docs/BENCHMARKS.md, run
  14) te_jax's sm90 forward runs at 0.65-1.10x cuDNN's, ahead only on long causal sequences, and its backward (the
  sm80 family) at about half of cuDNN's; a table cannot tell those shapes apart as well as a measurement does."""
  del params, direction
  return Choice("cudnn", "built-in table: cuDNN is faster than te_jax's kernels on most shapes of this GPU family")


def _key(params: dict, direction: str, identity: dict) -> str:
  text = json.dumps(dict(identity, direction=direction, params={k: v for k, v in params.items() if k != "engine"}),
                    sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:32]


class EngineTuner:
  """Measures and remembers, per configuration, which engine is faster. `time_call(params, direction)` returns
  milliseconds per call for params["engine"]; `identity` names what the result depends on besides the call."""

  def __init__(self, time_call, identity: dict, cache_dir: pathlib.Path):
    self._time_call = time_call
    self._identity = identity
    self._cache_dir = cache_dir

  @functools.lru_cache(maxsize=None)
  def _choose(self, frozen_params: tuple, direction: str) -> Choice:
    params = dict(frozen_params)
    path = self._cache_dir / f"{_key(params, direction, self._identity)}.json"
    try:
      record = json.loads(path.read_text())
      return Choice(record["engine"], f"measured earlier ({record['why']}, {path})")
    except (OSError, ValueError, KeyError):
      pass
    start = time.perf_counter()
    times = {}
    for engine in ("te", "cudnn"):
      try:
        times[engine] = self._time_call(params_for_engine(params, engine), direction)
      except Exception as e:  # noqa: BLE001 - any failure to measure: say so, use the table
        choice = table_choice(params, direction)
        logger.warning("te_jax: could not measure engine %s for this %s (%s); using the %s", engine, direction, e,
                       choice.why)
        return choice
    engine = min(times, key=times.get)
    why = f"te {times['te']:.3f} ms, cudnn {times['cudnn']:.3f} ms per call"
    logger.info("te_jax: measured the engines for a %s in %.2f s: %s", direction, time.perf_counter() - start, why)
    try:
      self._cache_dir.mkdir(parents=True, exist_ok=True)
      tmp = path.with_suffix(f".{os.getpid()}.tmp")
      tmp.write_text(json.dumps(dict(engine=engine, why=why, identity=self._identity, date=time.strftime("%Y-%m-%d"))))
      tmp.replace(path)
    except OSError as e:
      logger.warning("te_jax: could not save the engine measurement to %s: %s", path, e)
    return Choice(engine, f"measured: {why}")

  def choose(self, params: dict, direction: str) -> Choice:
    return self._choose(tuple(sorted(params.items())), direction)
