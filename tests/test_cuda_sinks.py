"""GPU: attention sinks (fused_attn(sink_logits=...)) on te_jax's CUDA kernels and on cuDNN, bf16, against the float64
definition of tests/test_sinks.py (out, lse, dq, dk, dv and dsink; through lse too on te_jax's kernels: cuDNN takes no
lse gradient): te_jax's kernels merge the sinks into their rows (the sm90 forward, the sm80 forward that a bias
selects, the decode kernels with one split and with several, whose combine merges them), and after cuDNN's kernel
the lowering does. Skipped without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_cuda_attention import _GPUS  # noqa: F401  (skips this module without a GPU)
from test_sinks import _sink_attention

import te_jax
from te_jax.reference import visible_mask

CASES = [  # name, mask, B, Sq, Skv, H, Hkv, D, Dv, engine, bias [1, H, Sq, Skv]
    ("causal_gqa_d128_te", "causal", 2, 300, 300, 8, 2, 128, 128, "te", False),
    ("no_mask_d64_te", "no_mask", 2, 200, 260, 4, 4, 64, 64, "te", False),
    ("decode_te", "causal_bottom_right", 2, 4, 500, 8, 2, 128, 128, "te", False),
    ("decode_split_kv_te", "causal_bottom_right", 1, 1, 6000, 8, 1, 128, 128, "te", False),
    ("padding_d_ne_dv_te", "padding_causal", 2, 150, 150, 4, 1, 192, 128, "te", False),
    ("causal_bias_sm80_te", "causal", 2, 200, 200, 4, 2, 128, 128, "te", True),
    ("causal_d128_cudnn", "causal", 2, 256, 256, 8, 8, 128, 128, "cudnn", False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sinks_on_the_gpu_match_the_definition(case):
  _, mask, b, sq, skv, h, hkv, d, dv, engine, with_bias = case
  rng = np.random.default_rng(11)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
  q, k, v, dout = bf16(b, sq, h, d), bf16(b, skv, hkv, d), bf16(b, skv, hkv, dv), bf16(b, sq, h, dv)
  sinks = jnp.asarray(rng.uniform(-2.0, 3.0, h), jnp.float32)
  dlse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((1, h, sq, skv)), jnp.float32) if with_bias else None
  padded = mask.startswith("padding")
  q_len = np.array([sq, sq // 2 + 1], np.int32) if padded else None
  kv_len = np.array([skv, 7], np.int32) if padded else None
  kwargs = dict(mask_type=mask, q_seqlens=q_len, kv_seqlens=kv_len, engine=engine, bias=bias)
  with_lse = engine != "cudnn"  # cuDNN's backward takes no gradient through lse (return_lse asks for one)

  def loss(q, k, v, sinks):
    if not with_lse:
      out = te_jax.fused_attn(q, k, v, sink_logits=sinks, **kwargs)
      return jnp.sum(out.astype(jnp.float32) * dout), (out, None)
    out, lse = te_jax.fused_attn(q, k, v, sink_logits=sinks, return_lse=True, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * dout) + jnp.sum(lse * dlse), (out, lse)

  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
  if not with_lse:
    dlse = jnp.zeros_like(dlse)
  visible = visible_mask(mask, sq, skv, q_len if padded else np.full(b, sq), kv_len if padded else np.full(b, skv))
  with jax.enable_x64(True):
    def ref_loss(q, k, v, sinks):
      out, lse = _sink_attention(q, k, v, sinks, jnp.asarray(visible), 1.0 / np.sqrt(d), 0.0,
                                 None if bias is None else jnp.asarray(bias, jnp.float64))
      return jnp.sum(out * jnp.asarray(dout, jnp.float64)) + jnp.sum(lse * jnp.asarray(dlse, jnp.float64)), (out, lse)

    f64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (q, k, v, sinks)]
    ref_grads, (ref_out, ref_lse) = jax.grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)(*f64)
  for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dsink"), (out, lse) + tuple(grads),
                             (ref_out, ref_lse) + tuple(ref_grads)):
    if got is None:
      continue
    got, want = np.asarray(got, np.float64), np.asarray(want)
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < 2e-2, (name, err)  # bf16 inputs and products: ~3e-3 typical
  if padded:  # rows past q_seqlens see no key: out 0, lse = the sink
    rows = np.arange(sq) >= q_len[1]
    assert not np.asarray(out, np.float32)[1, rows].any()
    np.testing.assert_array_equal(np.asarray(lse)[1][:, rows], np.broadcast_to(np.asarray(sinks)[:, None],
                                                                                (h, rows.sum())))
