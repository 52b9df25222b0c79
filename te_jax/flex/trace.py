"""Tracing a score_mod or mask_mod to a closed jaxpr on scalar arguments (score float32; b, h, q_idx, kv_idx int32).
The jaxpr's constants are what the mod closes over: JAX arrays (concrete, or tracers of an enclosing jit, which
make_jaxpr hoists the same way) become captures, kernel operands in order; NumPy and Python scalars fold into the
code as literals."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core

from te_jax.flex import dtypes
from te_jax.flex.emitter import folded_constant

SCORE_ARGUMENTS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGUMENTS = ("b", "h", "q_idx", "kv_idx")
_INDEX = jax.ShapeDtypeStruct((), jnp.int32)
_SCORE = jax.ShapeDtypeStruct((), jnp.float32)
# The element dtypes kernels read from a captured array.
CAPTURE_DTYPES = tuple(dtypes.ELEMENT_TYPES)


@dataclasses.dataclass(frozen=True)
class Traced:
  """A mod's jaxpr (outputs: the score and its derivative for a score_mod, the mask for a mask_mod), the literal or
  capture each of its constants is (a Dense literal, or the capture's index), and the captured arrays."""
  jaxpr: core.Jaxpr
  constants: tuple
  captures: tuple


def _check_arity(mod, what: str, arguments: tuple[str, ...]) -> None:
  try:
    signature = inspect.signature(mod)
  except (TypeError, ValueError):
    return  # no signature to check (a builtin): tracing says what is wrong
  try:
    signature.bind(*arguments)
  except TypeError:
    raise TypeError(f"{what} must take {len(arguments)} positional arguments ({', '.join(arguments)}); "
                    f"{getattr(mod, '__name__', mod)!r} takes {signature}") from None


def _check_result(value, what: str, kinds: str) -> None:
  """kinds: "float" (a float32, bfloat16 or float16 scalar) or "bool"."""
  aval = jax.typeof(value)
  shape = f"{aval.dtype}[{','.join(map(str, aval.shape))}]"
  if aval.shape != ():
    raise TypeError(f"{what} must return a scalar; it returned {shape}")
  if kinds == "float" and aval.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise TypeError(f"{what} must return a float32, bfloat16 or float16 scalar; it returned {shape}")
  if kinds == "bool" and aval.dtype != jnp.bool_:
    raise TypeError(f"{what} must return a bool scalar; it returned {shape}")


def _split_constants(closed: core.ClosedJaxpr, what: str) -> tuple[tuple, tuple]:
  constants, captures = [], []
  for value in closed.consts:
    folded = None if isinstance(value, jax.Array) else folded_constant(value)  # tracers are jax.Arrays
    if folded is not None:
      constants.append(folded)
      continue
    dtype, shape = np.dtype(value.dtype), tuple(np.shape(value))
    if dtype not in CAPTURE_DTYPES:
      raise TypeError(f"{what} captures an array of dtype {dtype} and shape {shape} (capture {len(captures)}), "
                      f"which te_jax kernels cannot read; capture dtypes: {', '.join(map(str, CAPTURE_DTYPES))}")
    constants.append(len(captures))
    captures.append(value)
  return tuple(constants), tuple(captures)


def trace_score_mod(score_mod) -> Traced:
  """The jaxpr of (score_mod(score, ...), d score_mod / d score)."""
  _check_arity(score_mod, "score_mod", SCORE_ARGUMENTS)

  def value_and_derivative(score, b, h, q_idx, kv_idx):
    value, pullback = jax.vjp(lambda s: score_mod(s, b, h, q_idx, kv_idx), score)
    _check_result(value, "score_mod", "float")
    (derivative,) = pullback(jnp.ones_like(value))
    return value, derivative

  closed = jax.make_jaxpr(value_and_derivative)(_SCORE, _INDEX, _INDEX, _INDEX, _INDEX)
  return Traced(closed.jaxpr, *_split_constants(closed, "score_mod"))


def trace_capture_gradient(score_mod, traced: Traced) -> Traced | None:
  """The jaxpr of (ct, score, b, h, q_idx, kv_idx) -> ct * d score_mod / d capture for each floating-point capture of
  `traced` (score_mod's trace), in the captures' dtypes and shapes (jax.vjp with respect to them); None without such
  captures. Its constants are `traced`'s captures (by identity) and folded literals."""
  differentiable = [i for i, c in enumerate(traced.captures) if dtypes.is_float(c.dtype)]
  if not differentiable:
    return None
  closed = jax.make_jaxpr(lambda *args: score_mod(*args))(_SCORE, _INDEX, _INDEX, _INDEX, _INDEX)
  capture_of = {id(c): i for i, c in enumerate(traced.captures)}
  positions = {capture_of[id(c)]: p for p, c in enumerate(closed.consts) if id(c) in capture_of}

  def cotangents(ct, score, b, h, q_idx, kv_idx):
    def value(*floats):
      consts = list(closed.consts)
      for i, x in zip(differentiable, floats):
        if i in positions:
          consts[positions[i]] = x
      return jax.core.eval_jaxpr(closed.jaxpr, consts, score, b, h, q_idx, kv_idx)[0].astype(jnp.float32)
    floats = [traced.captures[i] for i in differentiable]
    _, pullback = jax.vjp(value, *floats)
    return pullback(ct)

  gradient = jax.make_jaxpr(cotangents)(_SCORE, _SCORE, _INDEX, _INDEX, _INDEX, _INDEX)
  constants = []
  for value in gradient.consts:
    if id(value) in capture_of:
      constants.append(capture_of[id(value)])
    else:
      folded = folded_constant(value)
      if folded is None:
        raise NotImplementedError("score_mod's gradient closes over an array that is not one of its captures")
      constants.append(folded)
  return Traced(gradient.jaxpr, tuple(constants), traced.captures)


def trace_mask_mod(mask_mod) -> Traced:
  _check_arity(mask_mod, "mask_mod", MASK_ARGUMENTS)

  def mask(b, h, q_idx, kv_idx):
    value = jnp.asarray(mask_mod(b, h, q_idx, kv_idx))
    _check_result(value, "mask_mod", "bool")
    return value

  closed = jax.make_jaxpr(mask)(_INDEX, _INDEX, _INDEX, _INDEX)
  return Traced(closed.jaxpr, *_split_constants(closed, "mask_mod"))
