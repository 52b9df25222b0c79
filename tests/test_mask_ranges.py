"""The core's index mask (cpp/core/visible_keys.h) read both ways against the reference's mask: each row's range of visible
keys (RowMask::Keys: the forward kernels and the CPU backend) and each key's range of seeing rows (RowMask::Rows: the
backward kernels' masked steps), element for element, over every mask type, lengths (empty ones included) and
windows on either side."""

import numpy as np
import pytest

from te_jax import MaskType
from te_jax.reference import visible_mask

ext = pytest.importorskip("te_jax._te_jax_cpu")


def _from_ranges(ranges, rows, cols):
  m = np.zeros((rows, cols), bool)
  for r, (begin, end) in enumerate(ranges):
    m[r, max(begin, 0):max(min(end, cols), 0)] = True
  return m


@pytest.mark.parametrize("mask", list(MaskType), ids=[m.name.lower() for m in MaskType])
def test_keys_and_rows_are_the_reference_mask(mask):
  rng = np.random.default_rng(int(mask))
  shapes = [(0, 5), (5, 0), (1, 1), (7, 3), (3, 7)] + [tuple(rng.integers(1, 90, 2)) for _ in range(40)]
  windows = [(-1, -1), (0, 0), (0, -1), (-1, 0), (3, 2)] + [tuple(rng.integers(-1, 40, 2)) for _ in range(8)]
  for q_len, kv_len in shapes:
    for left, right in windows:
      keys, rows = ext.mask_ranges(int(mask), int(q_len), int(kv_len), int(left), int(right))
      ref = visible_mask(mask, q_len, kv_len, [q_len], [kv_len], (left, right))[0]
      where = f"{mask.name} q_len={q_len} kv_len={kv_len} window=({left}, {right})"
      assert np.array_equal(_from_ranges(keys, q_len, kv_len), ref), f"Keys: {where}"
      assert np.array_equal(_from_ranges(rows, kv_len, q_len).T, ref), f"Rows: {where}"
