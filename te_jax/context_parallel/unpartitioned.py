"""The unpartitioned meaning of a context-parallel call (one device holds everything): undo the load-balancing order,
attend, redo it; batch entries whose lengths the layout cannot compute get NaN, as in the partitioned call."""

from __future__ import annotations

from te_jax import _primitives
from te_jax.context_parallel.layout import poison, unsupported_lengths
from te_jax.load_balancing import inverse_reorder_for_load_balancing as inv, reorder_for_load_balancing as fwd


def _tokens_in_natural_order(config, cp, operands):
  """The segment ids and positions (the first four of `operands`) come in the load-balanced order like q, k, v; the
  placeholders of absent ones have no order."""
  present = (config.has_segment_ids,) * 2 + (config.has_positions,) * 2
  return tuple(inv(x, cp.size, 1) if p else x for x, p in zip(operands[:4], present)) + tuple(operands[4:])


def unpartitioned_forward(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config, cp):
  if cp is not None and cp.load_balanced:
    q, k, v = (inv(x, cp.size, 1) for x in (q, k, v))
    tokens = _tokens_in_natural_order(config, cp, tokens)
  out, lse = _primitives.attention_forward_p.bind(q, k, v, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config=config)
  if cp is not None:
    bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
    if cp.load_balanced:
      out, lse = fwd(out, cp.size, 1), fwd(lse, cp.size, 2)
    out, lse = poison(bad, out, lse)
  return out, lse


def unpartitioned_backward(q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi, sinks, *tokens, config, cp):
  if cp is not None and cp.load_balanced:
    q, k, v, out, dout = (inv(x, cp.size, 1) for x in (q, k, v, out, dout))
    lse, dlse = inv(lse, cp.size, 2), inv(dlse, cp.size, 2)
    tokens = _tokens_in_natural_order(config, cp, tokens)
  # After dbias, the score_mod's capture gradients (`tokens` ends with the captures; context parallelism has none).
  dq, dk, dv, dbias, *grads = _primitives.attention_backward_p.bind(q, k, v, out, lse, dout, dlse, q_seqlens,
                                                                    kv_seqlens, alibi, sinks, *tokens, config=config)
  if cp is not None:
    bad = unsupported_lengths(config, cp, q_seqlens, kv_seqlens)
    if cp.load_balanced:
      dq, dk, dv = (fwd(x, cp.size, 1) for x in (dq, dk, dv))
    dq, dk, dv = poison(bad, dq, dk, dv)
  return (dq, dk, dv, dbias, *grads)
