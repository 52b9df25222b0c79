"""A mask_mod's block states computed on the host by its CPU library (te_jax_flex_mask_blocks, tile_source.py), the
same Mask the CPU kernels call: no XLA program to build and compile for the block mask of a call whose mask_mod
captures only concrete arrays."""

from __future__ import annotations

import ctypes
import functools

import numpy as np

_MAX_RANK = 8  # cpp/core/flex_mods.h: kMaxFlexCaptureRank


class _FlexCapture(ctypes.Structure):
  """cpp/core/flex_mods.h: FlexCapture."""
  _fields_ = [("data", ctypes.c_void_p), ("rank", ctypes.c_int64), ("shape", ctypes.c_int64 * _MAX_RANK),
              ("strides", ctypes.c_int64 * _MAX_RANK)]


@functools.lru_cache(maxsize=None)
def _function(library: str):
  function = ctypes.CDLL(library).te_jax_flex_mask_blocks  # the handle the kernels' dlopen gets too
  function.restype = None
  function.argtypes = [ctypes.POINTER(_FlexCapture), ctypes.c_void_p, *(ctypes.c_int64,) * 6]
  return function


def mask_blocks(library: str, captures: tuple, batch: int, heads: int, seqlen_q: int, seqlen_kv: int,
                block_q: int, block_kv: int) -> np.ndarray:
  """int8 [batch, heads, ceil(Sq / block_q), ceil(Skv / block_kv)] block states (te_jax/block_mask.py) of the mask_mod
  whose library is `library`, over its concrete `captures` (te_jax.flex.FlexMod.captures)."""
  arrays = [np.ascontiguousarray(np.asarray(c)) for c in captures]  # kept alive for the call
  table = (_FlexCapture * max(1, len(arrays)))()
  for entry, array in zip(table, arrays):
    entry.data, entry.rank = array.ctypes.data, array.ndim
    for axis, (extent, stride) in enumerate(zip(array.shape, array.strides)):
      entry.shape[axis], entry.strides[axis] = extent, stride // array.itemsize
  blocks = np.empty((batch, heads, -(-seqlen_q // block_q), -(-seqlen_kv // block_kv)), np.int8)
  _function(library)(table, blocks.ctypes.data, batch, heads, seqlen_q, seqlen_kv, block_q, block_kv)
  return blocks
