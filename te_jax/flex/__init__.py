"""Attention variants written in Python (FlexAttention's contract), translated to C++ the kernels can call.

    score_mod(score, b, h, q_idx, kv_idx) -> score     mask_mod(b, h, q_idx, kv_idx) -> bool

are plain functions of scalars (score float32; b, h, q_idx, kv_idx int32) written with jax.numpy / lax, which may
close over JAX arrays. translate_score_mod / translate_mask_mod trace them once and return a FlexMod: the C++ source
of a struct (te_jax::flex::ScoreMod with Score and DScore, or te_jax::flex::MaskMod with Mask), its cache key, and
the captured arrays the struct's members point at. docs/flex_attention.md states the contract."""

from __future__ import annotations

import dataclasses

import numpy as np

from te_jax.flex import codegen, emitter, primitives, trace


@dataclasses.dataclass(frozen=True)
class CaptureType:
  """A capture as the generated struct sees it: members capture{i} (const T*), and for rank > 0
  capture{i}_shape[rank] and capture{i}_strides[rank] (FlexIndex, strides in elements)."""
  dtype: np.dtype
  shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ModSpec:
  """A mod as a call's static configuration holds it (te_jax.AttentionConfig): equal, and hashed, by its key, which
  covers the source and so the captures' dtypes and ranks; the captured values are the call's operands."""
  kind: str
  key: str
  source: str = dataclasses.field(compare=False, repr=False)
  capture_types: tuple[CaptureType, ...] = dataclasses.field(compare=False, repr=False)


@dataclasses.dataclass(frozen=True, eq=False)
class FlexMod:
  """kind: "score_mod" or "mask_mod"; struct: the C++ struct's name in namespace te_jax::flex; source: its C++
  (includes cpp/core/flex_math.h); key: the source's sha256; captures: the arrays (concrete, or tracers of the
  enclosing jit) the kernel takes as operands, in member order."""
  kind: str
  struct: str
  source: str
  key: str
  captures: tuple
  capture_types: tuple[CaptureType, ...]

  def spec(self) -> ModSpec:
    return ModSpec(self.kind, self.key, self.source, self.capture_types)


def _flex_mod(kind: str, struct: str, traced: trace.Traced, source: str) -> FlexMod:
  types = tuple(CaptureType(np.dtype(c.dtype), tuple(np.shape(c))) for c in traced.captures)
  return FlexMod(kind, struct, source, codegen.source_key(source), traced.captures, types)


def translate_score_mod(score_mod) -> FlexMod:
  """score_mod(score, b, h, q_idx, kv_idx) -> a float scalar, as te_jax::flex::ScoreMod (Score, its derivative in
  score DScore, and with floating-point captures DCaptures, their gradients)."""
  traced = trace.trace_score_mod(score_mod)
  gradient = trace.trace_capture_gradient(score_mod, traced)
  return _flex_mod("score_mod", "ScoreMod", traced, codegen.score_mod_source(traced, gradient))


def translate_mask_mod(mask_mod) -> FlexMod:
  """mask_mod(b, h, q_idx, kv_idx) -> a bool scalar (True keeps the key), as te_jax::flex::MaskMod (Mask)."""
  traced = trace.trace_mask_mod(mask_mod)
  return _flex_mod("mask_mod", "MaskMod", traced, codegen.mask_mod_source(traced))


# The lax primitives a mod may use; anything else is a NotImplementedError naming it.
SUPPORTED_PRIMITIVES = tuple(sorted(set(primitives.RULES) | set(emitter.CALLS)))

__all__ = ["CaptureType", "FlexMod", "ModSpec", "SUPPORTED_PRIMITIVES", "translate_mask_mod", "translate_score_mod"]
