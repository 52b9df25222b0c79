"""te_jax.flex_attention: PyTorch FlexAttention's entry point over te_jax.fused_attn, for attention written as a
score_mod and a mask_mod (docs/flex_attention.md)."""

from __future__ import annotations

from te_jax.attention import fused_attn


def flex_attention(q, k, v, score_mod=None, mask_mod=None, *, block_mask=None, scale: float | None = None,
                   return_lse: bool = False, engine: str | None = None):
  """Attention whose logits a score_mod rewrites and whose keys a mask_mod hides.

  Args:
    q: [B, Sq, H, D]; k: [B, Skv, Hkv, D]; v: [B, Skv, Hkv, Dv], as for te_jax.fused_attn (GQA/MQA, D != Dv).
    score_mod: None or score_mod(score, b, h, q_idx, kv_idx) -> score: scalars in (score float32, the global
      indices int32), a float scalar out, written with jax.numpy / lax; it may close over arrays. Applied to
      scale * q.k.
    mask_mod: None or mask_mod(b, h, q_idx, kv_idx) -> bool: False hides the key (-inf before the softmax).
    block_mask: None or a te_jax.BlockMask of the mask_mod (te_jax.create_block_mask), which brings it: the kernels skip
      the blocks it hides and test the mask_mod only on the blocks it cuts.
    scale: multiplies q.k; defaults to 1/sqrt(D).
    return_lse: also return the float32 log-sum-exp of the logits, [B, H, Sq].
    engine: as for te_jax.fused_attn.

  Returns:
    out [B, Sq, H, Dv] (and lse). A row whose keys are all hidden gives out = 0, lse = -inf. fused_attn takes the
    same score_mod= / mask_mod= with its other options (masks, windows, segment ids, bias, soft-cap, ALiBi, ...).
  """
  return fused_attn(q, k, v, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask, scale=scale,
                    return_lse=return_lse, engine=engine)
