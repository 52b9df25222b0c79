"""The FLOP model: 4 * B * H * Sq * Skv * D for the forward (two matmuls, 2 FLOPs per multiply-add), halved for a causal
square mask (the FlashAttention convention), counted by visible (query, key) pairs for windows and for causal masks
with Sq != Skv (top-left or bottom-right aligned); the backward is 2.5x the forward (five matmuls instead of two) and
fwd+bwd 3.5x. The byte model, for the memory-bound forward of decoding: the K/V read once, B * Skv * Hkv * (D + Dv)
elements (a paged cache holds the same bytes)."""

from __future__ import annotations

import numpy as np

from te_jax.bench.cases import Case
from te_jax.bench.inputs import numpy_dtype

MODE_FACTORS = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}


def visible_pairs(seq_q: int, seq_kv: int, causal: bool, window: tuple[int, int] | None,
                  bottom_right: bool = False) -> int:
  """The exact number of (query, key) pairs the mask lets through; its diagonal is at key i (top-left) or at key
  Skv - Sq + i (bottom_right) for query i."""
  left, right = window if window is not None else (-1, -1)
  i = np.arange(seq_q, dtype=np.int64) + (seq_kv - seq_q if bottom_right else 0)
  lo = np.zeros_like(i) if left < 0 else np.maximum(i - left, 0)
  hi = np.full_like(i, seq_kv - 1)
  if causal:
    hi = np.minimum(hi, i)
  if right >= 0:
    hi = np.minimum(hi, i + right)
  return int(np.maximum(hi - lo + 1, 0).sum())


def effective_pairs(case: Case) -> float:
  """Pairs the FLOP count charges for: Sq*Skv, half of it for a causal square mask without a window, else exact."""
  if case.window is None and not case.causal:
    return float(case.seq_q * case.seq_kv)
  if case.window is None and case.causal and case.seq_q == case.seq_kv:
    return case.seq_q * case.seq_kv / 2.0
  return float(visible_pairs(case.seq_q, case.seq_kv, case.causal, case.window, case.bottom_right))


def attention_flops(case: Case, mode: str = "fwd") -> float:
  return 4.0 * case.batch * case.heads * case.head_dim * effective_pairs(case) * MODE_FACTORS[mode]


def kv_bytes(case: Case) -> float:
  """The K and V bytes a forward reads (v's head dim is the case's head dim)."""
  itemsize = np.dtype(numpy_dtype(case.dtype)).itemsize
  return float(case.batch * case.seq_kv * case.kv_heads * 2 * case.head_dim * itemsize)


def workload(case: Case, mode: str) -> dict:
  """A result's FLOPs and, for the forward, the K/V bytes its bandwidth counts."""
  return dict(flops=attention_flops(case, mode), kv_bytes=kv_bytes(case) if mode == "fwd" else None)
