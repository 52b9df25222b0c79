"""te_jax.fused_attn: its arguments checked and made the call's config and operands (te_jax/arguments.py), and the VJP
over the two partitioned primitives (te_jax/sharding.py)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from te_jax import _primitives
from te_jax import context_parallel as _context_parallel
from te_jax import sharding as _sharding
from te_jax.arguments import (alibi_operand, as_array, bias_operand, check_bool, check_qkv, check_scale, check_softcap,
                              check_window, dropout_operand, mod_operands, seqlens_operand, sink_operand,
                              token_operands)
from te_jax.attention_config import AttentionConfig
from te_jax.block_mask import block_mask_operand
from te_jax.engine import requested_engine
from te_jax.fp8 import (dequantize_kv_operand, fp8_native_operands, fp8_operands, kv_cache_compute_dtype,
                        refuse_kv_cache_gradients)
from te_jax.mask_type import MaskType
from te_jax.sinks import apply_sinks, sink_gradient
from te_jax.symbolic_zeros import instantiate_zeros, primal_values, refuse_capture_gradient, refuse_slope_gradient


def fused_attn(q, k, v, *, mask_type: MaskType | str = "no_mask", q_seqlens=None, kv_seqlens=None,
               window_size: tuple[int, int] = (-1, -1), scale: float | None = None, softcap: float = 0.0,
               alibi_slopes=None, return_lse: bool = False, deterministic: bool = False, engine: str | None = None,
               context_parallel_axis: str | None = None, context_parallel_strategy: str = "all_gather",
               context_parallel_load_balanced: bool = False, q_segment_ids=None, kv_segment_ids=None,
               q_positions=None, kv_positions=None, sink_logits=None, bias=None, dropout_rate: float = 0.0,
               dropout_rng=None, q_descale=None, k_descale=None, v_descale=None, fp8=False, fp8_amax=None,
               out_dtype=None, score_mod=None, mask_mod=None, block_mask=None):
  """Fused scaled-dot-product attention.

  Args:
    q: [B, Sq, H, D]; k: [B, Skv, Hkv, D]; v: [B, Skv, Hkv, Dv]. H must be a multiple of Hkv (GQA/MQA). float32,
      bfloat16 or float16, all three the same.
    mask_type: "no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
      "padding_causal_bottom_right" or a te_jax.MaskType.
    q_seqlens, kv_seqlens: int32 [B] valid lengths; required by the padding masks and refused by the others.
    window_size: (left, right) sliding window around each query's diagonal position; -1 is unbounded.
    scale: multiplies q.k; defaults to 1/sqrt(D).
    softcap: if > 0, logits become softcap * tanh(logits / softcap).
    alibi_slopes: float32 [H] or [B, H]; adds slope * (key position - query position) to the logits.
    return_lse: also return the float32 log-sum-exp of the logits, [B, H, Sq].
    deterministic: whether the backward must be bitwise reproducible. False (fast): the CUDA backward sums dq with
      float atomics (for D + Dv <= 256) and the CPU backward in an order that follows its thread scheduling, so dq's
      last bits may differ from run to run. True: the same bits every run, whatever the thread count; slower.
    engine: which implementation runs the call: "auto" (default; or $TE_JAX_ENGINE) picks per configuration the faster
      engine that serves it, measured once on the GPU (te_jax/engine.py); "te" runs te_jax's own kernels; "cudnn"
      runs cuDNN's fused attention and raises EngineUnavailableError (a ValueError) saying why when cuDNN cannot serve
      the call (soft-cap, arbitrary ALiBi slopes, a gradient through lse, no GPU, ...). Never a silent fallback.
    context_parallel_axis: name of a mesh axis the sequence dimension of q, k and v is sharded over (context
      parallelism; the mesh in context (`with jax.set_mesh(mesh)`, shard_map), else q, k or v's NamedSharding, must
      have the axis). None: no context parallelism
      (batch and head sharding work without it). See docs/SHARDING.md.
    context_parallel_strategy: "all_gather" (gather K/V, compute the local query rows) or "ring" (K/V blocks passed
      around the axis with collective permutes, results merged by log-sum-exp).
    context_parallel_load_balanced: q, k, v (and so out, lse; and the segment ids and positions, if any) are in
      te_jax.reorder_for_load_balancing order.
    q_segment_ids, kv_segment_ids: int32 [B, Sq] / [B, Skv] (packed sequences): a query sees only keys with its own
      id; id 0 is padding (such a query gives out = 0, lse = -inf and zero gradients; such a key is never seen).
      q_segment_ids alone with Sq == Skv: the keys use the same ids. te_jax.segment_ids_from_lengths builds them.
    q_positions, kv_positions: int32 [B, Sq] / [B, Skv]: the positions causal masks, windows and ALiBi use instead of
      the indices (each defaults to 0..S-1): causal means kv_pos <= q_pos, a window (l, r) means
      q_pos - l <= kv_pos <= q_pos + r, ALiBi adds slope * (kv_pos - q_pos). Need not be sorted or distinct.
      Segment ids and positions go with mask_type "no_mask" or "causal" only. On the GPU te_jax's engine serves them
      (cuDNN does not; engine="auto" picks te_jax's kernels).
    sink_logits: float32 [H] (attention sinks): one extra logit per head in every row's softmax denominator that
      contributes no value: out_i = sum_j exp(s_ij) v_j / (exp(sink_h) + sum_j exp(s_ij)); lse includes it; it gets a
      gradient. A row with no visible key gives out = 0 and lse = sink_h. The off-by-one softmax is
      `sink_logits=jax.lax.stop_gradient(jnp.zeros(H))`. Every engine and backend (te_jax/sinks.py).
    bias: an additive logit bias, float32, bfloat16 or float16 of rank 4, broadcastable to [B, H, Sq, Skv] with each
      dim full or 1 ([1, H, Sq, Skv] relative positions, [B, 1, 1, Skv] a 0/-inf key mask, ...): the logits become
      softcap(scale * q.k) + alibi + bias, before the mask. A row whose every visible logit is -inf gives out = 0,
      lse = -inf. It gets a gradient (summed over its broadcast dims, in its dtype). On a GPU te_jax's kernels serve it
      (cuDNN does not take it), and there deterministic=True needs a bias whose gradient sums over no dim (full shape,
      or dims of extent 1).
    dropout_rate: attention dropout, a Python float in [0, 1): each probability (after the softmax, so lse is
      unchanged) is kept with probability 1 - dropout_rate and scaled by 1 / (1 - dropout_rate) before P.V; the
      backward applies the same keep-mask. 0 (default): no dropout, dropout_rng is ignored. On the GPU te_jax's kernels
      apply it (the same mask as on the CPU; cuDNN does not take it, engine="auto" picks te_jax's kernels).
    dropout_rng: the JAX PRNG key that defines the keep-mask (jax.random.key, or a raw uint32[2] jax.random.PRNGKey);
      required when dropout_rate > 0. Element (b, h, i, j) of the [B, H, Sq, Skv] probabilities is kept as
      te_jax.dropout_keep_mask(dropout_rng, (B, H, Sq, Skv), dropout_rate) says, however the call is sharded over the
      batch, the heads and (context parallelism, either strategy, load balanced or not) the sequence; global (i, j)
      are natural sequence positions. Under vmap over N examples the mapped axis joins the batch: example n's batch
      entry b uses mask entry b * N + n, so each example gets its own mask from one key (which must not be mapped).

    q_descale, k_descale, v_descale: FP8 attention with pre-quantized operands: q, k and v of one FP8 dtype
      (jnp.float8_e4m3fn or float8_e5m2), each with its float32 descale, a scalar or one per head ([H] for q, [Hkv] for
      k and v), so that x.astype(float32) * descale is the value (te_jax.quantize_fp8 returns both). Differentiating an
      FP8 operand or a descale is an error.
    fp8: FP8 attention for training: False (default), True (one descale per tensor) or "per_head": bfloat16, float16
      or float32 q, k, v quantized to float8_e4m3fn inside exactly as te_jax.quantize_fp8 does (current scaling), and
      their gradients are those with respect to the dequantized values, in their own dtypes (straight-through).
    fp8_amax: with fp8, (q_amax, k_amax, v_amax), float32 scalars (or [H] / [Hkv] per head): the magnitudes mapped
      onto e4m3's max instead of the operands' own (delayed scaling from an amax history); values beyond saturate.
    out_dtype: an FP8 call's out dtype, bfloat16, float16 or float32; defaults to bfloat16 for FP8 operands and to the
      operands' dtype with fp8=. An FP8 call attends over the dequantized values in float32: te_jax's CPU backend is
      the reference for the FP8 GPU kernels, which do not exist yet; a GPU refuses FP8 calls (te_jax/fp8.py).

    score_mod: a function score_mod(score, b, h, q_idx, kv_idx) -> score of scalars (PyTorch FlexAttention's; score
      float32, the indices int32) written with jax.numpy / lax, possibly closing over arrays (a relative-position
      table, per-head temperatures): it rewrites each logit after the built-in ones (scale, softcap, ALiBi, + bias),
      before the masks. b, h (the query head), q_idx and kv_idx are global indices. Its derivatives in score and in
      the floating-point arrays it captures come with it (the captures' gradients summed in float32; in a fixed order
      with deterministic=True on the CPU; by atomic adds on the GPU, which refuses deterministic=True with them). The
      CPU backend and the sm90 kernels of Hopper GPUs serve it (docs/flex_attention.md).
    mask_mod: a function mask_mod(b, h, q_idx, kv_idx) -> bool: False hides the key, like the built-in masks, which
      it combines with (a key must pass them all). A row it leaves no key gives out = 0, lse = -inf. CPU and Hopper.
    block_mask: a te_jax.BlockMask (te_jax.create_block_mask) of a mask_mod, which it then brings (pass mask_mod=None):
      the kernels skip the blocks it hides and call the mask_mod only on the blocks it cuts: the same results as the
      mask_mod alone, faster. A mask_mod given without one gets one built in the call (te_jax/block_mask.py).

  Returns:
    out [B, Sq, H, Dv] in q's dtype (an FP8 call's: out_dtype), and lse if return_lse. Rows with no visible key give
    out = 0, lse = -inf. Gradients flow to q, k and v (and through lse when it is returned).
  """
  q, k, v = (as_array(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
  q, k, v, out_dtype, is_fp8, kv_descale, native = fp8_operands(q, k, v, q_descale, k_descale, v_descale, fp8,
                                                                fp8_amax, out_dtype,
                                                                native_kv_cache=context_parallel_axis is None)
  check_qkv(q, k, v)
  batch, seqlen_q, num_heads, head_dim = q.shape
  seqlen_kv = k.shape[1]
  mask = MaskType.parse(mask_type)
  q_seqlens = seqlens_operand(q_seqlens, "q_seqlens", mask, batch, seqlen_q)
  kv_seqlens = seqlens_operand(kv_seqlens, "kv_seqlens", mask, batch, seqlen_kv)
  window_left, window_right = check_window(window_size)
  check_bool(return_lse, "return_lse")
  check_bool(deterministic, "deterministic")
  threshold, dropout = dropout_operand(dropout_rate, dropout_rng,
                                       any(x is not None for x in (score_mod, mask_mod, block_mask)))
  tokens, has_ids, has_positions = token_operands(q_segment_ids, kv_segment_ids, q_positions, kv_positions, mask,
                                                  batch, seqlen_q, seqlen_kv)
  cp = _context_parallel.make(context_parallel_axis, context_parallel_strategy, context_parallel_load_balanced,
                              (q, k, v))
  # The mods see global indices: inside shard_map a context-parallel call's sequences are the shards'.
  whole = cp.size if cp is not None and cp.manual else 1
  mask_mod, blocks, block_shape = block_mask_operand(block_mask, mask_mod, batch, num_heads, seqlen_q * whole,
                                                     seqlen_kv * whole)
  score_spec, mask_spec, captures = mod_operands(score_mod, mask_mod)
  if blocks is not None:  # the last capture
    captures = (*captures, blocks)
  config = AttentionConfig(mask_type=mask, window_left=window_left, window_right=window_right,
                           scale=check_scale(scale, head_dim), softcap=check_softcap(softcap),
                           has_alibi=alibi_slopes is not None, deterministic=bool(deterministic),
                           engine=requested_engine(engine), lse_cotangent=bool(return_lse) or cp is not None,
                           has_segment_ids=has_ids, has_positions=has_positions, has_bias=bias is not None,
                           dropout_threshold=threshold,
                           # context parallelism merges the sinks after its blocks' merge (_attention)
                           has_sinks=sink_logits is not None and cp is None, fp8=is_fp8, score_mod=score_spec,
                           mask_mod=mask_spec, block_mask=block_shape)
  alibi = alibi_operand(alibi_slopes, batch, num_heads)
  sinks = sink_operand(sink_logits, num_heads)
  bias = bias_operand(bias, (batch, num_heads, seqlen_q, seqlen_kv))
  if cp is not None:
    _context_parallel.check_supported(config, cp, q.shape, k.shape)
    _context_parallel.check_lengths(config, cp, q_seqlens, kv_seqlens)
  operands = (q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks, captures)
  if native is None or cp is not None:
    out, lse = _attention(config, cp, q, k, v, *operands, kv_descale)
    if out_dtype is not None:
      out = out.astype(out_dtype)
  else:
    # FP8 q, k and v: on CUDA as they are, to the sm90 FP8 kernel (te_jax/fp8.py fp8_native_operands; the lowering
    # refuses the call where that kernel is not enabled), elsewhere dequantized (the reference). Chosen at lowering.
    def on_cuda():
      q8, k8, vt8, descales = fp8_native_operands(native)
      out, lse = _attention(dataclasses.replace(config, fp8=False), None, q8, k8, vt8, *operands, descales)
      return out.astype(out_dtype), lse

    def dequantized():
      out, lse = _attention(config, None, q, k, v, *operands, kv_descale)
      return out.astype(out_dtype), lse
    out, lse = jax.lax.platform_dependent(cuda=on_cuda, default=dequantized)
  return (out, lse) if return_lse else out


# `cp` (a ContextParallel or None) is static like config. Both directions bind the partitioned primitives of
# te_jax/sharding.py, which wrap the kernel primitives of te_jax/_primitives.py. `tokens` is the tuple of the four
# segment-id and position operands (placeholders when absent); like the lengths, they get no gradient. `sinks` is None
# or the float32 [H] sink logits: the forward kernels merge them into their rows (config.has_sinks), or, with context
# parallelism, apply_sinks merges them into the merged blocks (te_jax/sinks.py); the backward then runs the kernels on
# the sink softmax's out and lse, and the sinks' gradient comes from those (sink_gradient). k and v are contiguous: the
# page table operand is a placeholder (a paged call is te_jax/paged_attention.py's). `bias` is the bias operand (the
# placeholder of _primitives.no_bias when absent), whose gradient the backward kernel returns. `dropout` is the dropout
# operand (key and offsets; te_jax/_primitives.py), which gets no gradient. `captures` is the tuple of arrays the
# score_mod and mask_mod capture (empty without mods): the score_mod's floating-point ones get their gradients from the
# kernels; differentiating a mask_mod's is an error (refuse_capture_gradient). `kv_descale` is None, or the kernels'
# operand of an FP8 KV cache (te_jax/fp8.py): k and v FP8, q in its own dtype; the backward dequantizes the cache, whose
# gradient is refused (only q's flows).
@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks, captures,
               kv_descale=None):
  per_head = _primitives.no_sinks() if sinks is None else jnp.broadcast_to(sinks, (q.shape[0], q.shape[2]))
  out, lse = _sharding.forward(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, per_head, tokens,
                               _primitives.no_page_table(),
                               _primitives.no_kv_descale() if kv_descale is None else kv_descale, bias, dropout,
                               captures)
  return apply_sinks(out, lse, per_head) if sinks is not None and not config.has_sinks else (out, lse)


def _attention_fwd(config, cp, *primals):
  refuse_slope_gradient(primals[5])
  refuse_capture_gradient(config, primals[10])
  if primals[11] is not None:
    refuse_kv_cache_gradients(primals[1], primals[2], primals[11])
  q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks, captures, kv_descale = primal_values(primals)
  out, lse = _attention(config, cp, q, k, v, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks, captures,
                        kv_descale)
  return (out, lse), (q, k, v, out, lse, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks, captures,
                      kv_descale)


def _attention_bwd(config, cp, residuals, cotangents):
  q, k, v, out, lse, q_seqlens, kv_seqlens, alibi, tokens, bias, dropout, sinks, captures, kv_descale = residuals
  dout, dlse = instantiate_zeros(cotangents)
  dout, dlse = dout.astype(out.dtype), dlse.astype(jnp.float32)

  def backward(config, q, k, v, out, dout):
    return _sharding.backward(config, cp, q, k, v, out, lse, dout, dlse, q_seqlens, kv_seqlens, alibi,
                              _primitives.no_sinks(), tokens, _primitives.no_page_table(), _primitives.no_kv_descale(),
                              bias, dropout, captures)

  if kv_descale is None:
    dq, dk, dv, dbias, *grads = backward(config, q, k, v, out, dout)
  else:  # an FP8 KV cache: the backward over its dequantized values (kv_cache_compute_dtype), q's gradient only
    def over(platform):
      def run(q, k8, v8, out, dout):
        dtype = kv_cache_compute_dtype(q.dtype, platform)
        k, v = (dequantize_kv_operand(x, kv_descale, i, dtype) for i, x in enumerate((k8, v8)))
        dq, _, _, dbias, *grads = backward(dataclasses.replace(config, fp8=np.dtype(dtype) == np.float32),
                                           *(x.astype(dtype) for x in (q, k, v, out, dout)))
        return (dq.astype(q.dtype), dbias, *grads)
      return run
    dq, dbias, *grads = jax.lax.platform_dependent(q, k, v, out, dout, cuda=over("cuda"), default=over(None))
    dk = dv = None
  # The score_mod's floating-point captures get their gradients (float32 sums, in their dtype); the others none.
  capture_grads = [None] * len(captures)
  for i, grad in zip(config.capture_gradients, grads):
    capture_grads[i] = grad.astype(captures[i].dtype)
  dsinks = None if sinks is None else sink_gradient(out, lse, dout, dlse, sinks)
  # The placeholder's cotangent is None: its dbias (a zero) would be typed as varying over shard_map's manual axes.
  return (dq, dk, dv, None, None, None, (None,) * len(tokens), dbias if config.has_bias else None, None, dsinks,
          tuple(capture_grads), None)


# symbolic_zeros: the forward learns which operands are differentiated (refuse_slope_gradient).
_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)
