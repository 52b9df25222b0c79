"""The lax primitives generated code computes, each a rule `rule(emitter, eqn, *operands) -> value`: elementwise
math by C++ templates per operand kind (cpp/core/flex_math.h holds the functions they call), shape plumbing for the
small index vectors gathers take, and the capture indexing of te_jax/flex/indexing.py."""

from __future__ import annotations

import numpy as np

from te_jax.flex import dtypes, indexing
from te_jax.flex.values import Dense

# Elementwise templates by the kind of the (first) operand: "f" float (float32, bfloat16, float16), "i" integer,
# "b" bool. {t} is the result's C++ type.
UNARY = {
    "exp": {"f": "Exp({0})"}, "exp2": {"f": "Exp2({0})"}, "expm1": {"f": "Expm1({0})"}, "log": {"f": "Log({0})"},
    "log1p": {"f": "Log1p({0})"}, "tanh": {"f": "Tanh({0})"}, "logistic": {"f": "Logistic({0})"},
    "erf": {"f": "Erf({0})"}, "sin": {"f": "Sin({0})"}, "cos": {"f": "Cos({0})"}, "tan": {"f": "Tan({0})"},
    "sqrt": {"f": "Sqrt({0})"}, "rsqrt": {"f": "Rsqrt({0})"}, "floor": {"f": "Floor({0})"},
    "ceil": {"f": "Ceil({0})"}, "is_finite": {"f": "IsFinite({0})"},
    "abs": {"f": "Abs({0})", "i": "IntAbs({0})"},
    "neg": {"f": "(-{0})", "i": "WrapNeg({0})"},
    "sign": {"f": "Sign({0})", "i": "IntSign({0})"},
    "square": {"f": "({0} * {0})", "i": "WrapMul({0}, {0})"},
    "one_minus_square": {"f": "(1.0f - {0} * {0})"},  # newer JAX's tanh derivative
    "not": {"b": "(!{0})", "i": "{t}(~{0})"},
    "copy": {"f": "{0}", "i": "{0}", "b": "{0}"},
    "copy_p": {"f": "{0}", "i": "{0}", "b": "{0}"},
    # A mod traced under a mesh (jax.set_mesh) places its values on it; a kernel's scalars have no placement.
    "reshard": {"f": "{0}", "i": "{0}", "b": "{0}"},
    "sharding_constraint": {"f": "{0}", "i": "{0}", "b": "{0}"},
}
_COMPARE = {"f": "({0} {op} {1})", "i": "({0} {op} {1})", "b": "({0} {op} {1})"}
BINARY = {
    "add": {"f": "({0} + {1})", "i": "WrapAdd({0}, {1})"},
    "add_any": {"f": "({0} + {1})", "i": "WrapAdd({0}, {1})"},
    "sub": {"f": "({0} - {1})", "i": "WrapSub({0}, {1})"},
    "mul": {"f": "({0} * {1})", "i": "WrapMul({0}, {1})"},
    "div": {"f": "({0} / {1})", "i": "IntDiv({0}, {1})"},
    "rem": {"f": "FloatRem({0}, {1})", "i": "IntRem({0}, {1})"},
    "max": {"f": "Max({0}, {1})", "i": "Max({0}, {1})", "b": "({0} || {1})"},
    "min": {"f": "Min({0}, {1})", "i": "Min({0}, {1})", "b": "({0} && {1})"},
    "pow": {"f": "Pow({0}, {1})"},
    "atan2": {"f": "Atan2({0}, {1})"},
    "and": {"b": "({0} && {1})", "i": "{t}({0} & {1})"},
    "or": {"b": "({0} || {1})", "i": "{t}({0} | {1})"},
    "xor": {"b": "({0} != {1})", "i": "{t}({0} ^ {1})"},
    "shift_left": {"i": "ShiftLeft({0}, {1})"},
    "shift_right_arithmetic": {"i": "ShiftRightArithmetic({0}, {1})"},
    "shift_right_logical": {"i": "ShiftRightLogical({0}, {1})"},
    **{name: {kind: t.replace("{op}", op) for kind, t in _COMPARE.items()}
       for name, op in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="))},
}


def _kind(dtype) -> str:
  return "f" if dtypes.is_float(dtype) else ("b" if np.dtype(dtype) == np.bool_ else "i")


def _out(eqn) -> np.dtype:
  return np.dtype(eqn.outvars[0].aval.dtype)


def _table_rule(name: str, templates: dict):
  def rule(em, eqn, *operands):
    first = em.dense(operands[0], name)
    template = templates.get(_kind(first.dtype))
    if template is None:
      raise em.unsupported(name, f" on {first.dtype}")
    return em.elementwise(_out(eqn), template.replace("{t}", dtypes.VALUE_TYPES[_out(eqn)]), operands, name)
  return rule


def _integer_pow(em, eqn, x):
  """x ** y by the multiplications lax's own lowering makes (square and multiply, 1 / x^-y for y < 0), so the float
  result is the same bits."""
  y, dtype = eqn.params["y"], _out(eqn)
  mul = BINARY["mul"][_kind(dtype)]
  if y == 0:
    return em.elementwise(dtype, dtypes.literal(1, dtype), [x], "integer_pow")
  acc, power, remaining = None, x, abs(y)
  while remaining:
    if remaining & 1:
      acc = power if acc is None else em.elementwise(dtype, mul, [acc, power], "integer_pow")
    remaining >>= 1
    if remaining:
      power = em.elementwise(dtype, mul, [power, power], "integer_pow")
  if y < 0:
    return em.elementwise(dtype, BINARY["div"][_kind(dtype)].format(dtypes.literal(1, dtype), "{0}"), [acc],
                          "integer_pow")
  return em.dense(acc, "integer_pow")


def _round(em, eqn, x):
  method = int(eqn.params["rounding_method"])  # lax.RoundingMethod: 0 away from zero, 1 to nearest even
  return em.elementwise(_out(eqn), ("RoundHalfAway({0})", "RoundHalfEven({0})")[method], [x], "round")


def _select_n(em, eqn, which, *cases):
  """cases[which]: a bool picks between two, an integer among n."""
  count = len(cases)
  if count == 1:
    return em.dense(cases[0], "select_n")
  if _kind(em.dense(which, "select_n").dtype) == "b":
    template = "({0} ? {2} : {1})"
  else:
    template = "{%d}" % count
    for k in reversed(range(count - 1)):
      template = f"({{0}} == {k} ? {{{k + 1}}} : {template})"
  return em.elementwise(_out(eqn), template, [which, *cases], "select_n")


def _clamp(em, eqn, low, x, high):
  return em.elementwise(_out(eqn), "Min(Max({1}, {0}), {2})", [low, x, high], "clamp")


def _convert_element_type(em, eqn, x):
  """As XLA converts: float -> integer truncates and saturates (NaN -> 0), anything -> bool is `!= 0`, to
  bfloat16 / float16 rounds to nearest even (Emitter.elementwise rounds half-precision results)."""
  x = em.dense(x, "convert_element_type")
  source, target = _kind(x.dtype), _kind(_out(eqn))
  ctype = dtypes.VALUE_TYPES[_out(eqn)]
  template = {("f", "f"): "{0}", ("f", "i"): f"FloatToInt<{ctype}>({{0}})", ("f", "b"): "({0} != 0.0f)",
              ("i", "f"): "float({0})", ("b", "f"): "float({0})", ("i", "i"): f"{ctype}({{0}})",
              ("b", "i"): f"{ctype}({{0}})", ("i", "b"): "({0} != 0)", ("b", "b"): "{0}"}[source, target]
  return em.elementwise(_out(eqn), template, [x], "convert_element_type")


def _broadcast_in_dim(em, eqn, x, *dynamic_shape):
  x = em.dense(x, "broadcast_in_dim")
  shape = eqn.params["shape"]
  expanded = [1] * len(shape)
  for source, target in enumerate(eqn.params["broadcast_dimensions"]):
    expanded[target] = x.shape[source]
  return Dense(x.dtype, np.broadcast_to(x.exprs.reshape(expanded), shape).copy())


def _reshape(em, eqn, x, *dynamic_shape):
  shape = tuple(eqn.outvars[0].aval.shape)
  if isinstance(x, Dense):
    return Dense(x.dtype, x.exprs.reshape(shape))
  return indexing.reshape_view(em, x, shape, "reshape")


def _squeeze(em, eqn, x):
  shape = tuple(eqn.outvars[0].aval.shape)
  if isinstance(x, Dense):
    return Dense(x.dtype, x.exprs.reshape(shape))
  return indexing.reshape_view(em, x, shape, "squeeze")


def _concatenate(em, eqn, *xs):
  parts = [em.dense(x, "concatenate") for x in xs]
  return Dense(_out(eqn), np.concatenate([p.exprs for p in parts], axis=eqn.params["dimension"]))


RULES = {
    **{name: _table_rule(name, templates) for name, templates in {**UNARY, **BINARY}.items()},
    "integer_pow": _integer_pow,
    "round": _round,
    "select_n": _select_n,
    "clamp": _clamp,
    "convert_element_type": _convert_element_type,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "concatenate": _concatenate,
    "dynamic_slice": indexing.dynamic_slice,
    "slice": indexing.static_slice,
    "gather": indexing.gather,
}
