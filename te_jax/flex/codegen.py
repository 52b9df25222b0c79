"""The generated C++: a struct whose members are the captures (pointer, then shape and strides in elements, a
FlexIndex per dimension: cpp/core/flex_math.h), filled by its static Bind from an array of captures (anything with
data, shape[] and strides[]: the CPU's FlexCapture, the kernels' KernelCapture), and whose TE_JAX_HOST_DEVICE methods
evaluate the mod. The text depends on the mod's jaxpr and its captures' dtypes and ranks (and shapes only where JAX's
own index arithmetic bakes them in), never on captured values; its sha256 is the cache key."""

from __future__ import annotations

import hashlib

import numpy as np

from te_jax.flex import cotangents, dtypes
from te_jax.flex.emitter import Emitter
from te_jax.flex.primitives import RULES
from te_jax.flex.trace import Traced
from te_jax.flex.values import Dense, View

HEADER = "cpp/core/flex_math.h"


def _members(captures: tuple) -> list[str]:
  lines = []
  for i, capture in enumerate(captures):
    dtype, rank = np.dtype(capture.dtype), np.ndim(capture)
    lines.append(f"const {dtypes.ELEMENT_TYPES[dtype]}* capture{i};  // {dtype}, rank {rank}")
    if rank:
      lines += [f"FlexIndex capture{i}_shape[{rank}];", f"FlexIndex capture{i}_strides[{rank}];  // in elements"]
  return lines


def _bind(name: str, captures: tuple) -> list[str]:
  """kCaptures, and Bind: the struct with its members pointing at captures[0 .. kCaptures)."""
  lines = [f"static constexpr int kCaptures = {len(captures)};", "template <typename Capture>",
           f"TE_JAX_HOST_DEVICE static {name} Bind([[maybe_unused]] const Capture* captures) {{", f"  {name} mod{{}};"]
  for i, capture in enumerate(captures):
    lines.append(f"  mod.capture{i} = static_cast<const {dtypes.ELEMENT_TYPES[np.dtype(capture.dtype)]}*>"
                 f"(captures[{i}].data);")
    for axis in range(np.ndim(capture)):
      lines += [f"  mod.capture{i}_shape[{axis}] = captures[{i}].shape[{axis}];",
                f"  mod.capture{i}_strides[{axis}] = captures[{i}].strides[{axis}];"]
  return [*lines, "  return mod;", "}"]


def _constants(traced: Traced) -> list:
  return [c if isinstance(c, Dense) else View.whole(c, traced.captures[c].dtype, np.shape(traced.captures[c]))
          for c in traced.constants]


def _method(traced: Traced, what: str, output: int, signature: str, arguments: list) -> list[str]:
  """The method returning the jaxpr's output `output`, with the statements it needs."""
  emitter = Emitter(what, RULES)
  result = emitter.dense(emitter.run(traced.jaxpr, _constants(traced), arguments)[output], "return").expr()
  body = [*emitter.body([result]), f"return {result};"]
  return [f"TE_JAX_HOST_DEVICE {signature} const {{", *(f"  {line}" for line in body), "}"]


def _gradient_method(gradient: Traced, signature: str, arguments: list) -> list[str]:
  """The method adding each floating-point capture's cotangent to its float32 gradient (through AddGradient(grads,
  i, ...): grads the float* const* arrays, or the kernels' run of additions)."""
  emitter = Emitter("score_mod's gradient", cotangents.rules(RULES))
  outputs = emitter.run(gradient.jaxpr, _constants(gradient), arguments)
  differentiable = [i for i, c in enumerate(gradient.captures) if dtypes.is_float(c.dtype)]
  additions = [line for i, out in zip(differentiable, outputs) for line in cotangents.additions(emitter, out, i)]
  return [f"template <typename Grads> TE_JAX_HOST_DEVICE {signature} const {{",
          *(f"  {line}" for line in emitter.body(additions)), *(f"  {line}" for line in additions), "}"]


def _indices(names: tuple[str, ...]) -> list[Dense]:
  return [Dense.scalar(np.int32, name) for name in names]


def score_mod_source(traced: Traced, gradient: Traced | None = None) -> str:
  """gradient: trace.trace_capture_gradient's, for a score_mod with floating-point captures (the DCaptures method)."""
  arguments = [Dense.scalar(np.float32, "score"), *_indices(("b", "h", "q_idx", "kv_idx"))]
  parameters = "float score, int b, int h, int q_idx, int kv_idx"
  methods = [*_method(traced, "score_mod", 0, f"float Score({parameters})", arguments),
             "// d Score / d score, from jax.vjp of the score_mod.",
             *_method(traced, "score_mod", 1, f"float DScore({parameters})", arguments)]
  methods += ["// grads[i] += ct * d Score / d capture i for the floating-point captures, from jax.vjp of the",
              "// score_mod (ct: the loss's derivative in the modified score); nothing without such captures."]
  signature = f"void DCaptures(float ct, {parameters}, Grads&& grads)"
  if gradient is not None:
    methods += _gradient_method(gradient, signature, [Dense.scalar(np.float32, "ct"), *arguments])
  else:
    methods.append(f"template <typename Grads> TE_JAX_HOST_DEVICE {signature} const {{}}")
  return _struct("ScoreMod", "a score_mod", traced.captures, methods)


def mask_mod_source(traced: Traced) -> str:
  signature = "bool Mask(int b, int h, int q_idx, int kv_idx)"
  methods = _method(traced, "mask_mod", 0, signature, _indices(("b", "h", "q_idx", "kv_idx")))
  return _struct("MaskMod", "a mask_mod", traced.captures, methods)


def _struct(name: str, what: str, captures: tuple, methods: list[str]) -> str:
  lines = [f"// Generated by te_jax.flex from {what}'s jaxpr; te_jax.flex.source_key(text) is its cache key.",
           f'#include "{HEADER}"', "", "namespace te_jax::flex {", "", f"struct {name} {{",
           *(f"  {line}" for line in _members(captures)), *(f"  {line}" for line in _bind(name, captures)),
           *(f"  {line}" if line else "" for line in methods), "};", "",
           "}  // namespace te_jax::flex", ""]
  return "\n".join(lines)


def source_key(source: str) -> str:
  return hashlib.sha256(source.encode()).hexdigest()
