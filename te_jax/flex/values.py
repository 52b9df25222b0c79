"""What a jaxpr variable is in generated code: a small dense value (C++ expressions, one per element) or a window of a
captured array not read yet (indexing narrows the window; an element is read when something computes with it)."""

from __future__ import annotations

import dataclasses

import numpy as np

# Dense values are unrolled element by element: the index vectors of gathers and the like, never whole tensors.
MAX_ELEMENTS = 64


@dataclasses.dataclass(frozen=True)
class Dense:
  """A value of `dtype` whose elements are C++ expressions, an object array of `shape`."""
  dtype: np.dtype
  exprs: np.ndarray

  @property
  def shape(self) -> tuple[int, ...]:
    return self.exprs.shape

  @staticmethod
  def scalar(dtype, expr: str) -> "Dense":
    return Dense(np.dtype(dtype), np.array(expr, dtype=object))

  def expr(self) -> str:
    """The expression of a one-element value."""
    assert self.exprs.size == 1, self.shape
    return self.exprs.reshape(())[()]


@dataclasses.dataclass(frozen=True)
class View:
  """The window of capture `capture` a value is: `starts` (one FlexIndex C++ expression per capture dimension) is its
  first element; `dims` are the capture dimensions it keeps, in order, of static sizes `shape` and run-time sizes
  `extents` (C++ expressions: the capture's shape member for a dimension not sliced yet, else the slice's size)."""
  capture: int
  dtype: np.dtype
  starts: tuple[str, ...]
  dims: tuple[int, ...]
  shape: tuple[int, ...]
  extents: tuple[str, ...]

  @staticmethod
  def whole(capture: int, dtype, shape: tuple[int, ...]) -> "View":
    rank = len(shape)
    return View(capture, np.dtype(dtype), ("0",) * rank, tuple(range(rank)), tuple(shape),
                tuple(f"capture{capture}_shape[{d}]" for d in range(rank)))
