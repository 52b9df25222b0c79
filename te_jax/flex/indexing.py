"""Reading captured arrays: lax.dynamic_slice, slice, gather and squeeze / reshape narrow a View (a window of a
capture) without reading it; the element is read when arithmetic needs it (Emitter.dense). Out-of-bounds indices
follow JAX exactly: dynamic_slice clamps the start so the window fits (jnp's `table[i]` first adds the size to a
negative i, once), gather clamps in modes clip and promise_in_bounds and gives its fill value in mode fill."""

from __future__ import annotations

import numpy as np

from te_jax.flex import dtypes
from te_jax.flex.values import Dense, View

INDEX = dtypes.INDEX


def _view(em, operand, primitive: str) -> View:
  if not isinstance(operand, View):
    raise em.unsupported(primitive, " on a value computed inside the mod (only captured arrays are indexed)")
  return operand


def _start(em, view: View, position: int, index: str) -> str:
  """The capture-level start of `view`'s dimension at `position` moved by `index` (a FlexIndex expression)."""
  base = view.starts[view.dims[position]]
  return index if base == "0" else em.bind(INDEX, f"{base} + {index}")


def _narrowed(view: View, starts: dict[int, str], sizes) -> View:
  """`view` with the window of `sizes` starting at `starts` (position -> capture-level start)."""
  new_starts = list(view.starts)
  for position, start in starts.items():
    new_starts[view.dims[position]] = start
  return View(view.capture, view.dtype, tuple(new_starts), view.dims, tuple(sizes), tuple(str(s) for s in sizes))


def dynamic_slice(em, eqn, operand, *indices):
  view = _view(em, operand, "dynamic_slice")
  sizes = eqn.params["slice_sizes"]
  starts = {}
  for position, (index, size) in enumerate(zip(indices, sizes)):
    _, index = dtypes.index_cast(em.dense(index, "dynamic_slice"))
    clamped = em.bind(INDEX, f"ClampIndex({index}, {view.extents[position]} - {size})")
    starts[position] = _start(em, view, position, clamped)
  return _narrowed(view, starts, sizes)


def static_slice(em, eqn, operand):
  view = _view(em, operand, "slice")
  if any(s != 1 for s in eqn.params["strides"] or ()):
    raise em.unsupported("slice", f" with strides {eqn.params['strides']}")
  begin, end = eqn.params["start_indices"], eqn.params["limit_indices"]
  starts = {p: _start(em, view, p, str(b)) for p, b in enumerate(begin) if b}
  return _narrowed(view, starts, [e - b for b, e in zip(begin, end)])


def reshape_view(em, view: View, shape: tuple[int, ...], primitive: str) -> View:
  """Drops unit dimensions (squeeze, or a reshape that only removes them)."""
  kept, position = [], 0
  for size in shape:
    while position < len(view.shape) and view.shape[position] != size and view.shape[position] == 1:
      position += 1
    if position == len(view.shape) or view.shape[position] != size:
      raise em.unsupported(primitive, f" reshaping a window {view.shape} of a captured array to {shape}")
    kept.append(position)
    position += 1
  if any(view.shape[p] != 1 for p in range(len(view.shape)) if p not in kept):
    raise em.unsupported(primitive, f" reshaping a window {view.shape} of a captured array to {shape}")
  return View(view.capture, view.dtype, view.starts, tuple(view.dims[p] for p in kept), shape,
              tuple(view.extents[p] for p in kept))


def _fill_value(value, dtype) -> str:
  """gather's fill value; None is JAX's default: NaN for floats, the lowest signed / highest unsigned integer,
  True for bool."""
  if value is None:
    value = (np.nan if dtypes.is_float(dtype) else True if dtype == np.bool_ else
             np.iinfo(dtype).min if np.iinfo(dtype).min < 0 else np.iinfo(dtype).max)
  return dtypes.literal(value, dtype)


def gather(em, eqn, operand, indices):
  """A gather of one window at an index vector of scalars (jnp.take, .at[...].get(mode=...)): indices of shape
  (len(start_index_map),), no batching dimensions."""
  view = _view(em, operand, "gather")
  numbers, sizes, mode = eqn.params["dimension_numbers"], eqn.params["slice_sizes"], eqn.params["mode"]
  indices = em.dense(indices, "gather")
  if numbers.operand_batching_dims or indices.shape != (len(numbers.start_index_map),):
    raise em.unsupported("gather", f" with indices of shape {indices.shape} (supported: one index vector of scalars)")
  if mode.name not in ("CLIP", "PROMISE_IN_BOUNDS", "FILL_OR_DROP"):
    raise em.unsupported("gather", f" in mode {mode.name} (supported: clip, promise_in_bounds, fill)")
  starts, in_bounds = {}, []
  for index, position in zip(indices.exprs, numbers.start_index_map):
    last = f"{view.extents[position]} - {sizes[position]}"
    wide = em.bind(*dtypes.index_cast(Dense.scalar(indices.dtype, index)))
    in_bounds.append(f"({wide} >= 0 && {wide} <= {last})")
    starts[position] = _start(em, view, position, em.bind(INDEX, f"ClampIndex({wide}, {last})"))
  kept = [p for p in range(len(view.shape)) if p not in numbers.collapsed_slice_dims]
  window = _narrowed(view, starts, sizes)
  window = View(window.capture, window.dtype, window.starts, tuple(window.dims[p] for p in kept),
                tuple(sizes[p] for p in kept), tuple(window.extents[p] for p in kept))
  if mode.name != "FILL_OR_DROP":
    return window
  value = em.dense(window, "gather")
  fill = _fill_value(eqn.params["fill_value"], view.dtype)
  inside = em.bind(np.bool_, " && ".join(in_bounds) or "true")
  return Dense(view.dtype, np.full(value.shape, em.bind(view.dtype, f"({inside} ? {value.expr()} : {fill})"),
                                   dtype=object))
