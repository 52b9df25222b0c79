"""Walks a jaxpr and writes one C++ statement per scalar result: `const T vN = expr;`. Call primitives (jit,
custom_jvp_call, ...) are inlined; every other primitive goes to its rule (te_jax/flex/primitives.py,
te_jax/flex/indexing.py). Statements no output needs are dropped at the end, so one jaxpr serves several methods."""

from __future__ import annotations

import re

import numpy as np
from jax.extend import core

from te_jax.flex import dtypes
from te_jax.flex.values import MAX_ELEMENTS, Dense, View

# Call primitives and the parameter holding the jaxpr they call: inlined.
CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
         "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
         "checkpoint": "jaxpr", "remat": "jaxpr"}
NAME = re.compile(r"\bv\d+\b")


def folded_constant(value) -> Dense | None:
  """A constant that is code, not a capture: a NumPy or Python scalar (JAX arrays and tracers are captures)."""
  if isinstance(value, (np.ndarray, np.generic, int, float, bool)) and np.ndim(value) == 0:
    dtype = np.asarray(value).dtype
    return Dense.scalar(dtype, dtypes.literal(value, dtype))
  return None


class Emitter:
  """The statements of one generated method. `mod` names the user's function in error messages."""

  def __init__(self, mod: str, rules: dict):
    self.mod = mod
    self.rules = rules
    self.statements: list[tuple[str, str, str]] = []  # (name, C++ type, expression)

  def bind(self, dtype, expr: str) -> str:
    """A named statement of the value: dtype a JAX dtype, or a C++ type (dtypes.INDEX)."""
    name = f"v{len(self.statements)}"
    self.statements.append((name, dtype if isinstance(dtype, str) else dtypes.VALUE_TYPES[np.dtype(dtype)], expr))
    return name

  def unsupported(self, primitive: str, detail: str = "") -> NotImplementedError:
    supported = ", ".join(sorted(set(self.rules) | set(CALLS)))
    return NotImplementedError(f"{self.mod} uses lax.{primitive}{detail}, which te_jax cannot compile into a "
                               f"kernel; supported primitives: {supported}")

  def dense(self, value, primitive: str) -> Dense:
    """The value with its elements as expressions: reads a one-element window of a capture."""
    if isinstance(value, Dense):
      return value
    if int(np.prod(value.shape)) != 1:
      raise self.unsupported(primitive, f" on a whole captured array (capture {value.capture}, window of shape "
                                        f"{value.shape}): mods may only read single elements of captures, indexed "
                                        f"by scalars")
    return Dense(value.dtype, np.full(value.shape, self.bind(value.dtype, _read(value)), dtype=object))

  def elementwise(self, dtype, template: str, values: list, primitive: str) -> Dense:
    """Applies `template` ("({0} + {1})") element by element; shape-() operands broadcast. Half-precision results
    are rounded to their dtype, as XLA computes them in float32 and rounds."""
    operands = [self.dense(v, primitive) for v in values]
    shape = np.broadcast_shapes(*(o.shape for o in operands))
    if np.dtype(dtype) in dtypes.ROUND:
      template = f"{dtypes.ROUND[np.dtype(dtype)]}({template})"
    exprs = np.empty(shape, dtype=object)
    for index in np.ndindex(*shape):
      exprs[index] = self.bind(dtype, template.format(*(o.exprs[index if o.shape else ()] for o in operands)))
    return Dense(np.dtype(dtype), exprs)

  def run(self, jaxpr: core.Jaxpr, consts: list, args: list) -> list:
    env = {}

    def read(atom):
      if isinstance(atom, core.Literal):
        return Dense.scalar(atom.aval.dtype, dtypes.literal(atom.val, atom.aval.dtype))
      return env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      for var in eqn.outvars:
        dtypes.value_type(var.aval.dtype, f"{self.mod}'s lax.{name}")
      outs = self._apply(eqn, [read(a) for a in eqn.invars])
      for var, out in zip(eqn.outvars, outs):
        if isinstance(out, Dense) and out.exprs.size > MAX_ELEMENTS:
          raise self.unsupported(name, f" making an array of shape {out.shape} (mods compute on scalars; at most "
                                       f"{MAX_ELEMENTS} elements are unrolled)")
        if not isinstance(var, core.DropVar):
          env[var] = out
    return [read(a) for a in jaxpr.outvars]

  def _apply(self, eqn, invals: list) -> list:
    name = eqn.primitive.name
    if name in CALLS:
      called = eqn.params[CALLS[name]]
      if isinstance(called, core.ClosedJaxpr):
        consts = [folded_constant(c) for c in called.consts]
        if any(c is None for c in consts):
          raise self.unsupported(name, " calling a function that closes over an array")
        return self.run(called.jaxpr, consts, invals)
      return self.run(called, [], invals)
    rule = self.rules.get(name)
    if rule is None:
      raise self.unsupported(name)
    outs = rule(self, eqn, *invals)
    return outs if eqn.primitive.multiple_results else [outs]

  def body(self, results: list[str]) -> list[str]:
    """The statements the result expressions need, in order, as C++ lines."""
    needed = set(NAME.findall(" ".join(results)))
    kept = []
    for name, ctype, expr in reversed(self.statements):
      if name in needed:
        needed.update(NAME.findall(expr))
        kept.append(f"const {ctype} {name} = {expr};")
    return kept[::-1]


def _read(view: View) -> str:
  """The C++ expression reading a view's first element."""
  terms = [f"{start} * capture{view.capture}_strides[{d}]" for d, start in enumerate(view.starts) if start != "0"]
  element = f"capture{view.capture}[{' + '.join(terms) or '0'}]"
  widen = dtypes.WIDEN.get(view.dtype)
  return f"{widen}({element})" if widen else element
