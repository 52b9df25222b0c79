"""What a custom_vjp's rules do with what symbolic_zeros=True hands them: the forward gets each operand wrapped
(CustomVJPPrimal: its value, and whether it is differentiated), the backward gets a SymbolicZero for each output that
nothing depends on. te_jax.fused_attn's and te_jax.paged_attention's VJPs share these."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero


def primal_values(primals):
  """The values of a custom_vjp forward's operands, which symbolic_zeros=True wraps leaf by leaf."""
  return jax.tree.map(lambda p: p.value, primals, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))


def refuse_slope_gradient(alibi: CustomVJPPrimal) -> None:
  """A clear error rather than a silent zero: the kernels compute no gradient for the ALiBi slopes."""
  if alibi.perturbed:
    raise ValueError("alibi_slopes are being differentiated, but te_jax computes no gradient for them (it would be a "
                     "silent zero): pass jax.lax.stop_gradient(alibi_slopes) to train with fixed slopes")


def refuse_capture_gradient(config, captures) -> None:
  """A clear error rather than a silent zero: a mask_mod has no derivative, so the kernels compute no gradient for the
  arrays it captures (captures: the call's CustomVJPPrimals, the score_mod's first, whose floating-point ones get
  theirs)."""
  first = len(config.score_mod.capture_types) if config.score_mod else 0
  for i, capture in enumerate(captures[first:]):
    if capture.perturbed:
      value = capture.value
      raise ValueError(f"mask_mod's capture {i} ({value.dtype}{list(value.shape)}) is being differentiated, but a "
                       "mask_mod has no gradient (it would be a silent zero): wrap it in jax.lax.stop_gradient inside "
                       "the mod, or move the differentiable part into a score_mod")


def instantiate_zeros(cotangents):
  """The cotangents with each symbolic zero (symbolic_zeros=True: an output nothing depends on) made an array."""
  return jax.tree.map(lambda c: jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c, cotangents,
                      is_leaf=lambda x: isinstance(x, SymbolicZero))
