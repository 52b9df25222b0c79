"""Inputs: the same values in every backend and every process, from a seed. Benchmark-size tensors are tiled from one
block of normal noise (drawing 100M+ normals per case would take longer than timing it); the block's length is odd so
no two tokens repeat in step. Small (accuracy) inputs are drawn directly. Several rotation sets are made when one set
is smaller than the cache, so back-to-back calls do not find their inputs cached. A case's other operands (ALiBi
slopes, a bias, sink logits, the dropout key) are one per case, shared by the sets."""

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
  alibi: np.ndarray | None = None  # float32 [H]
  bias: np.ndarray | None = None  # bias_shape(case), the case's dtype
  sinks: np.ndarray | None = None  # float32 [H]
  dropout_key: np.ndarray | None = None  # a raw PRNG key, uint32 [2]

  @property
  def first(self) -> InputSet:
    return self.sets[0]

  def operands(self) -> dict:
    """The operands besides q, k, v that the case has, by fused_attn's argument names."""
    named = dict(alibi_slopes=self.alibi, bias=self.bias, sink_logits=self.sinks, dropout_rng=self.dropout_key)
    return {name: x for name, x in named.items() if x is not None}


def shapes(case: Case) -> dict[str, tuple[int, ...]]:
  return dict(q=(case.batch, case.seq_q, case.heads, case.head_dim),
              k=(case.batch, case.seq_kv, case.kv_heads, case.head_dim),
              v=(case.batch, case.seq_kv, case.kv_heads, case.head_dim),
              dout=(case.batch, case.seq_q, case.heads, case.head_dim))


def bias_shape(case: Case) -> tuple[int, ...] | None:
  """The shape of the case's additive bias (cases.BIAS_SHAPES), None without one."""
  shapes_by_kind = {"heads": (1, case.heads, case.seq_q, case.seq_kv), "keys": (case.batch, 1, 1, case.seq_kv)}
  return shapes_by_kind.get(case.bias)


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


def operands(case: Case, seed: int, draw) -> dict:
  """Inputs' fields besides the sets: the case's ALiBi slopes, bias (draw(shape) makes it), sink logits and dropout
  key, None for those it does not have."""
  shape = bias_shape(case)
  sinks = np.random.default_rng(seed + 2).standard_normal(case.heads, dtype=np.float32) if case.sinks else None
  return dict(alibi=alibi_slopes(case.heads) if case.alibi else None, bias=None if shape is None else draw(shape),
              sinks=sinks, dropout_key=np.asarray([0, seed], np.uint32) if case.dropout else None)


def benchmark_operands(case: Case, seed: int = 0) -> dict:
  """operands() at benchmark size: a bias tiled like the sets (past their offsets)."""
  return operands(case, seed, lambda shape: _tiled(_base(seed, case.dtype), shape, offset=104_729))


def make_sets(case: Case, num_sets: int, seed: int) -> list[InputSet]:
  """num_sets rotation sets of q, k, v, dout (dout scaled down so gradients stay O(1))."""
  base = _base(seed, case.dtype)
  sets = []
  for s in range(num_sets):
    arrays = {}
    for t, (name, shape) in enumerate(shapes(case).items()):
      arrays[name] = _tiled(base, shape, offset=1_000_003 * (4 * s + t) + 7919 * s)
    sets.append(InputSet(**arrays))
  return sets


def make_inputs(case: Case, num_sets: int = 1, seed: int = 0) -> Inputs:
  """Benchmark inputs: make_sets and benchmark_operands."""
  return Inputs(case, make_sets(case, num_sets, seed), **benchmark_operands(case, seed))


def make_small_inputs(case: Case, seed: int = 0) -> Inputs:
  """Accuracy inputs, drawn directly (exactly reproducible, no tiling), one set."""
  rng = np.random.default_rng(seed + 1)
  draw = lambda shape: rng.standard_normal(shape, dtype=np.float32).astype(numpy_dtype(case.dtype))
  arrays = {name: draw(shape) for name, shape in shapes(case).items()}
  return Inputs(case, [InputSet(**arrays)], **operands(case, seed, draw))
