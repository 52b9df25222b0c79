"""Attention sinks (fused_attn(sink_logits=...)) against the definition: a float64 softmax whose denominator holds one
more term per head, written directly in jax.numpy and differentiated by JAX (so the gradients, dsink included, are
checked against autodiff of the definition, not against te_jax/sinks.py's algebra)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.reference import visible_mask


def _sink_attention(q, k, v, sinks, visible, scale, softcap, bias=None):
  """float64 out [B,Sq,H,Dv] and lse [B,H,Sq] of the sink softmax; visible [B, Sq, Skv]; bias [B, H, Sq, Skv] or
  broadcastable."""
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bihd,bjhd->bhij", q, k) * scale
  if softcap > 0:
    s = softcap * jnp.tanh(s / softcap)
  if bias is not None:
    s = s + bias
  s = jnp.where(visible[:, None], s, -jnp.inf)
  sink = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
  logits = jnp.concatenate([s, sink], axis=-1)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits[..., :-1] - lse[..., None])
  return jnp.einsum("bhij,bjhd->bihd", probs, v), lse


CASES = [  # name, mask, B, Sq, Skv, H, Hkv, D, Dv, softcap
    ("no_mask", "no_mask", 2, 37, 37, 4, 4, 32, 32, 0.0),
    ("causal_gqa", "causal", 2, 50, 50, 4, 2, 64, 48, 0.0),
    ("padding_softcap", "padding_causal", 2, 40, 45, 2, 1, 16, 16, 20.0),
    ("bottom_right_decode", "causal_bottom_right", 3, 4, 70, 8, 2, 64, 64, 0.0),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_sinks_match_the_definition_forward_and_gradients(case):
  _, mask, b, sq, skv, h, hkv, d, dv, softcap = case
  rng = np.random.default_rng(7)
  q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
  k = rng.standard_normal((b, skv, hkv, d)).astype(np.float32)
  v = rng.standard_normal((b, skv, hkv, dv)).astype(np.float32)
  sinks = rng.uniform(-2.0, 3.0, h).astype(np.float32)
  dout = rng.standard_normal((b, sq, h, dv)).astype(np.float32)
  dlse = rng.standard_normal((b, h, sq)).astype(np.float32)
  padded = mask.startswith("padding")
  q_len = np.array([sq, sq // 2 + 1, sq][:b], np.int32) if padded else None
  kv_len = np.array([skv, 3, skv][:b], np.int32) if padded else None
  kwargs = dict(mask_type=mask, softcap=softcap, q_seqlens=q_len, kv_seqlens=kv_len)
  scale = 1.0 / np.sqrt(d)

  def loss(q, k, v, sinks):
    out, lse = te_jax.fused_attn(q, k, v, sink_logits=sinks, return_lse=True, **kwargs)
    return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)

  grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
  visible = visible_mask(mask, sq, skv, q_len if padded else np.full(b, sq), kv_len if padded else np.full(b, skv))
  with jax.enable_x64(True):
    def ref_loss(q, k, v, sinks):
      out, lse = _sink_attention(q, k, v, sinks, jnp.asarray(visible), scale, softcap)
      return jnp.sum(out * dout) + jnp.sum(lse * dlse), (out, lse)

    f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, sinks)]
    ref_grads, (ref_out, ref_lse) = jax.grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)(*f64)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=2e-5, atol=2e-5)
  for name, got, want in zip(("dq", "dk", "dv", "dsink"), grads, ref_grads):
    want = np.asarray(want)
    err = np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30)
    assert err < 1e-4, (name, err)
  if padded:  # rows past q_seqlens see no key: out 0, lse = the sink
    rows = np.arange(sq) >= q_len[1]
    assert not np.asarray(out)[1, rows].any()
    np.testing.assert_array_equal(np.asarray(lse)[1][:, rows], np.broadcast_to(sinks[:, None], (h, rows.sum())))


def test_minus_infinite_sinks_are_no_sinks_and_large_sinks_take_the_mass():
  rng = np.random.default_rng(1)
  q, k, v = (rng.standard_normal((2, 20, 2, 16)).astype(np.float32) for _ in range(3))
  plain, plain_lse = te_jax.fused_attn(q, k, v, mask_type="causal", return_lse=True)
  none, none_lse = te_jax.fused_attn(q, k, v, mask_type="causal", return_lse=True,
                                     sink_logits=np.full(2, -np.inf, np.float32))
  np.testing.assert_array_equal(np.asarray(none), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(none_lse), np.asarray(plain_lse))
  big = te_jax.fused_attn(q, k, v, mask_type="causal", sink_logits=np.full(2, 60.0, np.float32))
  assert np.abs(np.asarray(big)).max() < 1e-20
  # A -inf sink with a row that sees no key (Sq > Skv, bottom-right) keeps that row at out 0, lse -inf, not NaN.
  out, lse = te_jax.fused_attn(q, k[:, :5], v[:, :5], mask_type="causal_bottom_right", return_lse=True,
                               sink_logits=np.array([-np.inf, 1.0], np.float32))
  assert np.isfinite(np.asarray(out)).all()
  assert np.asarray(lse)[:, 0, 0].tolist() == [-np.inf, -np.inf] and np.asarray(lse)[:, 1, 0].tolist() == [1.0, 1.0]


def test_sinks_under_vmap_and_both_custom_call_paths():
  rng = np.random.default_rng(3)
  q, k, v = (rng.standard_normal((3, 2, 24, 4, 16)).astype(np.float32) for _ in range(3))
  sinks = rng.standard_normal((3, 4)).astype(np.float32)
  f = lambda q, k, v, s: te_jax.fused_attn(q, k, v, mask_type="causal", sink_logits=s)
  batched = jax.jit(jax.vmap(f))(q, k, v, sinks)
  for i in range(3):
    np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(f(q[i], k[i], v[i], sinks[i])), rtol=1e-6, atol=1e-7)
  g = jax.jit(jax.grad(lambda q, s: jnp.sum(f(q, k[0], v[0], s) ** 2), argnums=(0, 1)))
  with te_jax.custom_call_path("ffi"):
    ffi = g(q[0], sinks[0])
  with te_jax.custom_call_path("legacy"):
    legacy = g(q[0], sinks[0])
  te_jax.raise_legacy_failures()
  for a, b in zip(ffi, legacy):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_the_lowering_merges_the_sinks_when_the_kernels_do_not(monkeypatch):
  """cuDNN's kernel takes no sinks: after it the lowering merges them itself (te_jax/sinks.py). On the CPU, with the
  kernels told to merge none, the lowering's merge gives the kernels' result (to float32 rounding: the kernels merge
  before rounding out, the lowering after), and only then does the lowered forward hold the merge's exponential."""
  from te_jax import _primitives, engine
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((2, 30, 4, 16)).astype(np.float32) for _ in range(3))
  sinks = rng.uniform(-2.0, 3.0, 4).astype(np.float32)
  call = lambda q, k, v, s: te_jax.fused_attn(q, k, v, mask_type="causal", sink_logits=s, return_lse=True)  # noqa: E731
  in_kernels, kernels_text = jax.jit(call)(q, k, v, sinks), jax.jit(call).lower(q, k, v, sinks).as_text()
  monkeypatch.setattr(_primitives, "params_for_engine",
                      lambda params, name: dict(engine.params_for_engine(params, name), has_sinks=False))
  call_again = lambda q, k, v, s: call(q, k, v, s)  # noqa: E731  (a new function: traced and lowered again)
  in_lowering, lowering_text = jax.jit(call_again)(q, k, v, sinks), jax.jit(call_again).lower(q, k, v, sinks).as_text()
  for got, want in zip(in_lowering, in_kernels):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
  assert "stablehlo.exponential" in lowering_text and "stablehlo.exponential" not in kernels_text


def test_off_by_one_softmax_adds_one_to_the_denominator():
  rng = np.random.default_rng(4)
  q, k, v = (rng.standard_normal((1, 9, 1, 8)).astype(np.float32) for _ in range(3))
  out = te_jax.fused_attn(q, k, v, sink_logits=jax.lax.stop_gradient(jnp.zeros(1, jnp.float32)))
  s = np.einsum("bihd,bjhd->bhij", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(8)
  e = np.exp(s)
  ref = np.einsum("bhij,bjhd->bihd", e / (1.0 + e.sum(-1, keepdims=True)), v.astype(np.float64))
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sinks, error, match", [
    (np.zeros(3, np.float32), ValueError, r"sink_logits must have shape \[H\] = \(2,\)"),
    (np.zeros((1, 2), np.float32), ValueError, "sink_logits must have shape"),
    (np.zeros(2, np.float16), TypeError, "sink_logits must be float32"),
    ([0.0, 0.0], TypeError, "sink_logits must be a JAX or NumPy array"),
])
def test_bad_sink_logits_raise_before_anything_runs(sinks, error, match):
  q = np.zeros((1, 4, 2, 8), np.float32)
  with pytest.raises(error, match=match):
    te_jax.fused_attn(q, q, q, sink_logits=sinks)


def test_the_float64_reference_with_sinks_matches_the_definition():
  """te_jax.reference's sink_logits (the benchmark harness's reference for calls with sinks): out, lse and the
  gradients of q, k, v with a cotangent on both out and lse, against autodiff of the definition; a row with no visible
  key gives out = 0 and lse = its sink."""
  from te_jax.reference import attention_reference
  jax.config.update("jax_enable_x64", True)
  try:
    rng = np.random.default_rng(11)
    b, sq, skv, h, hkv, d = 2, 9, 12, 4, 2, 8
    q, k, v, dout = (rng.standard_normal(shape) for shape in ((b, sq, h, d), (b, skv, hkv, d), (b, skv, hkv, d),
                                                              (b, sq, h, d)))
    dlse = rng.standard_normal((b, h, sq))
    sinks = rng.uniform(-2.0, 3.0, h)
    q_seqlens, kv_seqlens = np.array([9, 5]), np.array([12, 0])  # batch entry 1 sees no key
    got = attention_reference(q, k, v, mask_type="padding_causal", q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                              sink_logits=sinks, dout=dout, dlse=dlse)
    visible = jnp.asarray(visible_mask("padding_causal", sq, skv, q_seqlens, kv_seqlens, (-1, -1)))
    definition = lambda q, k, v: _sink_attention(q, k, v, jnp.asarray(sinks), visible, 1 / np.sqrt(d), 0.0)  # noqa: E731
    (out, lse), vjp = jax.vjp(definition, *(jnp.asarray(x) for x in (q, k, v)))
    np.testing.assert_allclose(got["out"], out, atol=1e-12)
    np.testing.assert_allclose(got["lse"], lse, atol=1e-12)
    for name, want in zip(("dq", "dk", "dv"), vjp((jnp.asarray(dout), jnp.asarray(dlse)))):
      np.testing.assert_allclose(got[name], want, atol=1e-10, err_msg=name)
    assert np.all(got["out"][1] == 0) and np.all(got["lse"][1] == sinks[:, None])
  finally:
    jax.config.update("jax_enable_x64", False)
