"""The cotangent of a captured array, as the transposed jaxpr of a score_mod computes it: an array of the capture's
shape that is zero but for a few windows (a scalar mod reads single elements, and the transpose of each read adds its
cotangent at the element read). Scattered holds those windows symbolically, never the array; the gradient method
(codegen.score_mod_source's DCaptures) adds each window's values to the capture's float32 gradient. The rules here
are what JAX's transposes of the reads make of them: float zeros broadcast to an array (a Scattered of no windows),
dynamic_update_slice into them (dynamic_slice's transpose), scatter-add (gather's), pad (slice's), broadcast_in_dim
adding unit dims (squeeze's), add_any (two reads' sums)."""

from __future__ import annotations

import dataclasses

import numpy as np

from te_jax.flex import dtypes
from te_jax.flex.values import Dense



@dataclasses.dataclass(frozen=True)
class Window:
  """Values added at a window: `starts` its first element (one int64 C++ expression per dimension, within the
  array), `values` the window's elements, `keep` a bool C++ expression (an update scatter drops) or ""."""
  starts: tuple[str, ...]
  values: Dense
  keep: str = ""


@dataclasses.dataclass(frozen=True)
class Scattered:
  """A float array of `shape`: zero but for the sums of `windows`."""
  dtype: np.dtype
  shape: tuple[int, ...]
  windows: tuple[Window, ...] = ()


def _zero_literal(em, x) -> bool:
  return isinstance(x, Dense) and x.exprs.size == 1 and dtypes.is_float(x.dtype) and \
      x.expr() in (dtypes.literal(0, x.dtype), dtypes.literal(-0.0, x.dtype))


def rules(base: dict) -> dict:
  """`base` with the rules that make and combine Scattered values: a float zero broadcast to an array starts one
  (the gradient method's jaxpr makes no other float arrays); any rule of `base` that meets one refuses it."""

  def broadcast_in_dim(em, eqn, x, *dynamic_shape):
    shape, dims = tuple(eqn.params["shape"]), eqn.params["broadcast_dimensions"]
    if isinstance(x, Scattered):  # unit dims added (squeeze's transpose)
      if any(shape[d] != n for d, n in zip(dims, x.shape)) or np.prod(shape) != np.prod(x.shape):
        raise em.unsupported("broadcast_in_dim", f" of a capture's cotangent {x.shape} to {shape}")
      windows = []
      for w in x.windows:
        starts, kept = ["FlexIndex(0)"] * len(shape), iter(w.starts)
        for d in dims:
          starts[d] = next(kept)
        windows.append(Window(tuple(starts), Dense(w.values.dtype, w.values.exprs.reshape(
            [w.values.shape[list(dims).index(d)] if d in dims else 1 for d in range(len(shape))])), w.keep))
      return Scattered(x.dtype, shape, tuple(windows))
    if shape and _zero_literal(em, x):
      return Scattered(np.dtype(eqn.outvars[0].aval.dtype), shape)
    return base["broadcast_in_dim"](em, eqn, x, *dynamic_shape)

  def dynamic_update_slice(em, eqn, operand, update, *indices):
    if not isinstance(operand, Scattered) or operand.windows:
      raise em.unsupported("dynamic_update_slice", " other than into the zeros of a capture's cotangent")
    update = em.dense(update, "dynamic_update_slice")
    starts = []
    for index, extent, size in zip(indices, operand.shape, update.shape):
      _, index = dtypes.index_cast(em.dense(index, "dynamic_update_slice"))
      starts.append(em.bind(dtypes.INDEX, f"ClampIndex({index}, FlexIndex({extent - size}))"))
    return dataclasses.replace(operand, windows=(Window(tuple(starts), update),))

  def scatter_add(em, eqn, operand, indices, updates):
    if not isinstance(operand, Scattered):
      raise em.unsupported("scatter-add", " other than into a capture's cotangent")
    numbers, mode = eqn.params["dimension_numbers"], eqn.params["mode"]
    indices, updates = em.dense(indices, "scatter-add"), em.dense(updates, "scatter-add")
    if numbers.operand_batching_dims or indices.shape != (len(numbers.scatter_dims_to_operand_dims),):
      raise em.unsupported("scatter-add", f" with indices of shape {indices.shape} (supported: one index vector)")
    if mode.name not in ("CLIP", "PROMISE_IN_BOUNDS", "FILL_OR_DROP"):
      raise em.unsupported("scatter-add", f" in mode {mode.name}")
    # The window's shape: the update's dims where the operand keeps them, 1 where the scatter inserts a dim.
    window_shape, kept = [], iter(updates.shape)
    for axis in range(len(operand.shape)):
      window_shape.append(1 if axis in numbers.inserted_window_dims else next(kept))
    starts, in_bounds = ["FlexIndex(0)"] * len(operand.shape), []
    for index, axis in zip(indices.exprs, numbers.scatter_dims_to_operand_dims):
      last = operand.shape[axis] - window_shape[axis]
      wide = em.bind(*dtypes.index_cast(Dense.scalar(indices.dtype, index)))
      in_bounds.append(f"({wide} >= 0 && {wide} <= {last})")
      starts[axis] = em.bind(dtypes.INDEX, f"ClampIndex({wide}, FlexIndex({last}))")
    keep = em.bind(np.bool_, " && ".join(in_bounds)) if mode.name == "FILL_OR_DROP" and in_bounds else ""
    values = Dense(updates.dtype, updates.exprs.reshape(window_shape))
    return dataclasses.replace(operand, windows=operand.windows + (Window(tuple(starts), values, keep),))

  def pad(em, eqn, operand, padding_value):
    """slice's transpose: the operand's windows moved by the low padding."""
    shape = tuple(eqn.outvars[0].aval.shape)
    config = eqn.params["padding_config"]
    if not _zero_literal(em, padding_value) or any(interior or low < 0 or high < 0 for low, high, interior in config):
      raise em.unsupported("pad", " other than with zeros around a capture's cotangent")
    if not isinstance(operand, Scattered):
      operand = Scattered(np.dtype(operand.dtype), tuple(operand.shape),
                          (Window(("FlexIndex(0)",) * len(shape), em.dense(operand, "pad")),))
    moved = tuple(Window(tuple(f"({start} + {int(low)})" if low else start
                               for start, (low, _, _) in zip(w.starts, config)), w.values, w.keep)
                  for w in operand.windows)
    return Scattered(np.dtype(eqn.outvars[0].aval.dtype), shape, moved)

  def add(name):
    def rule(em, eqn, x, y):
      if isinstance(x, Scattered) and isinstance(y, Scattered):
        return dataclasses.replace(x, windows=x.windows + y.windows)
      return base[name](em, eqn, x, y)
    return rule

  def convert_element_type(em, eqn, x):
    if isinstance(x, Scattered):
      return dataclasses.replace(x, dtype=np.dtype(eqn.outvars[0].aval.dtype))
    return base["convert_element_type"](em, eqn, x)

  return {**base, "broadcast_in_dim": broadcast_in_dim, "dynamic_update_slice": dynamic_update_slice,
          "scatter-add": scatter_add, "pad": pad, "add_any": add("add_any"),
          "add": add("add"), "convert_element_type": convert_element_type}


def additions(em, cotangent, capture: int) -> list[str]:
  """The C++ statements adding a cotangent's elements to the float32 gradient of capture `capture` (row-major, of the
  capture's shape): `AddGradient(grads, capture, offset, value);`, under `if (keep)` where a scatter drops updates."""
  if isinstance(cotangent, Dense):  # a capture the output does not depend on: a literal zero array
    return []
  if not isinstance(cotangent, Scattered):
    raise em.unsupported("gradient", f" of capture {capture}: its cotangent is not a sum of windows")
  strides = [int(np.prod(cotangent.shape[axis + 1:])) for axis in range(len(cotangent.shape))]
  lines = []
  for window in cotangent.windows:
    for element in np.ndindex(*window.values.shape):
      value = window.values.exprs[element]
      terms = [f"({start} + {offset}) * {stride}" if offset else f"{start} * {stride}"
               for start, offset, stride in zip(window.starts, element, strides)]
      add = f"AddGradient(grads, {capture}, {' + '.join(terms) or '0'}, float({value}));"
      lines.append(f"if ({window.keep}) {add}" if window.keep else add)
  return lines
