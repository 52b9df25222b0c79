"""Inputs: the same values in every backend and every process, from a seed. Benchmark-size tensors are tiled from one
block of normal noise (drawing 100M+ normals per case would take longer than timing it); the block's length is odd so
no two tokens repeat in step. Small (accuracy) inputs are drawn directly. Several rotation sets are made when one set
is smaller than the cache, so back-to-back calls do not find their inputs cached."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from te_jax.bench.cases import Case

_BASE_LEN = (1 << 22) - 3
_base_cache: dict[tuple[int, str], np.ndarray] = {}
# Bytes a rotation must exceed: about twice the last-level cache (H100/H200 L2 50-60 MB; a server CPU's L3 tens of MB).
FLUSH_BYTES = {"gpu": 256 << 20, "cpu": 64 << 20}
MAX_SETS = 4


def numpy_dtype(dtype: str):
  if dtype == "bfloat16":
    import ml_dtypes
    return ml_dtypes.bfloat16
  return np.dtype(dtype)


def alibi_slopes(heads: int) -> np.ndarray:
  """The ALiBi paper's geometric slopes, float32 [H]."""
  return np.asarray([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], np.float32)


@dataclasses.dataclass
class InputSet:
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  dout: np.ndarray


@dataclasses.dataclass
class Inputs:
  case: Case
  sets: list[InputSet]
  alibi: np.ndarray | None  # float32 [H] or None

  @property
  def first(self) -> InputSet:
    return self.sets[0]


def shapes(case: Case) -> dict[str, tuple[int, ...]]:
  return dict(q=(case.batch, case.seq_q, case.heads, case.head_dim),
              k=(case.batch, case.seq_kv, case.kv_heads, case.head_dim),
              v=(case.batch, case.seq_kv, case.kv_heads, case.head_dim),
              dout=(case.batch, case.seq_q, case.heads, case.head_dim))


def set_bytes(case: Case) -> int:
  itemsize = np.dtype(numpy_dtype(case.dtype)).itemsize
  return sum(math.prod(s) for s in shapes(case).values()) * itemsize


def rotation_sets(case: Case, platform: str) -> int:
  """How many input sets to rotate through: enough to exceed FLUSH_BYTES, at most MAX_SETS."""
  return max(1, min(MAX_SETS, math.ceil(FLUSH_BYTES.get(platform, FLUSH_BYTES["cpu"]) / set_bytes(case))))


def _base(seed: int, dtype: str) -> np.ndarray:
  key = (seed, dtype)
  if key not in _base_cache:
    _base_cache.clear()
    noise = np.random.default_rng(seed).standard_normal(_BASE_LEN, dtype=np.float32)
    _base_cache[key] = noise.astype(numpy_dtype(dtype))
  return _base_cache[key]


def _tiled(base: np.ndarray, shape, offset: int) -> np.ndarray:
  n = math.prod(shape)
  offset %= base.size
  rolled = np.concatenate([base[offset:], base[:offset]])
  return np.resize(rolled, n).reshape(shape)


def make_inputs(case: Case, num_sets: int = 1, seed: int = 0) -> Inputs:
  """Benchmark inputs: num_sets rotation sets of q, k, v, dout (dout scaled down so gradients stay O(1))."""
  base = _base(seed, case.dtype)
  sets = []
  for s in range(num_sets):
    arrays = {}
    for t, (name, shape) in enumerate(shapes(case).items()):
      arrays[name] = _tiled(base, shape, offset=1_000_003 * (4 * s + t) + 7919 * s)
    sets.append(InputSet(**arrays))
  return Inputs(case, sets, alibi_slopes(case.heads) if case.alibi else None)


def make_small_inputs(case: Case, seed: int = 0) -> Inputs:
  """Accuracy inputs, drawn directly (exactly reproducible, no tiling), one set."""
  rng = np.random.default_rng(seed + 1)
  arrays = {name: rng.standard_normal(shape, dtype=np.float32).astype(numpy_dtype(case.dtype))
            for name, shape in shapes(case).items()}
  return Inputs(case, [InputSet(**arrays)], alibi_slopes(case.heads) if case.alibi else None)
