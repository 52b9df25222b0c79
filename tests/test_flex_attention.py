"""score_mod / mask_mod through te_jax.flex_attention and fused_attn on the CPU backend, against a dense float64
reference written here from the same Python mods (the scores materialised, the mods applied with jax.vmap over every
(b, h, q_idx, kv_idx), then the softmax): forward, lse and every gradient, on fresh random data; the built-ins written
as mods; composition with fused_attn's options; FFI == legacy bitwise; jit, vmap; the disk cache in a second process;
the GPU's refusal; bad input."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import _primitives
from te_jax._backends import backend_for
from te_jax.attention_config import AttentionConfig
from te_jax.mask_type import MaskType
from helpers import tolerance

B, SQ, SKV, H, HKV, D, DV = 2, 37, 45, 4, 2, 16, 24
RNG = np.random.default_rng(51)


def _array(shape, dtype=jnp.float32):
  return jnp.asarray(RNG.standard_normal(shape), dtype)


def _qkv(sq=SQ, skv=SKV, heads=H, kv_heads=HKV, dv=DV):
  return _array((B, sq, heads, D)), _array((B, skv, kv_heads, D)), _array((B, skv, kv_heads, dv))


def reference(q, k, v, score_mod=None, mask_mod=None, *, scale=None, causal=False, q_ids=None, kv_ids=None,
              softcap=0.0, alibi=None):
  """out, lse of attention in float64: logits scale * q.k (then soft-cap, ALiBi), score_mod, then the masks; a row
  with no visible key gives out = 0, lse = -inf."""
  with jax.enable_x64(True):
    q, k, v = (jnp.asarray(x, jnp.float64) for x in (q, k, v))
    batch, sq, heads, d = q.shape
    skv, group = k.shape[1], heads // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)
    if softcap:
      s = softcap * jnp.tanh(s / softcap)
    b, h, i, j = (x.astype(jnp.int32) for x in jnp.meshgrid(jnp.arange(batch), jnp.arange(heads), jnp.arange(sq),
                                                             jnp.arange(skv), indexing="ij"))
    if alibi is not None:
      s = s + jnp.asarray(alibi, jnp.float64)[h] * (j - i)
    if score_mod is not None:
      s = jax.vmap(score_mod)(s.ravel(), b.ravel(), h.ravel(), i.ravel(), j.ravel()).reshape(s.shape)
    visible = jnp.ones(s.shape, bool)
    if mask_mod is not None:
      visible &= jax.vmap(mask_mod)(b.ravel(), h.ravel(), i.ravel(), j.ravel()).reshape(s.shape)
    if causal:
      visible &= j <= i
    if q_ids is not None:
      qi, ki = jnp.asarray(q_ids)[b, i], jnp.asarray(kv_ids)[b, j]
      visible &= (qi == ki) & (qi != 0)
    s = jnp.where(visible, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.exp(s - top)
    total = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(total > 0, total, 1.0), v)
    lse = jnp.where(total[..., 0] > 0, jnp.log(total[..., 0]) + top[..., 0], -jnp.inf)
    return out, lse


def _loss_weights(out_shape, lse_shape):
  return _array(out_shape), _array(lse_shape)


def _with_gradients(attend, q, k, v, weights):
  """out, lse and d(sum(out * w) + sum(finite lse * w_lse)) / d(q, k, v)."""
  def loss(q, k, v):
    out, lse = attend(q, k, v)
    return jnp.sum(out * weights[0]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights[1]), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return (out, lse, *grads)


def _te(q, k, v, path="ffi", weights=None, **kwargs):
  """fused_attn's out, lse and gradients under jit, and the loss weights (fresh unless given)."""
  if weights is None:
    weights = _loss_weights((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), (q.shape[0], q.shape[2], q.shape[1]))
  with te_jax.custom_call_path(path):
    got = jax.jit(lambda q, k, v: _with_gradients(
        lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **kwargs), q, k, v, weights))(q, k, v)
  return got, weights


def _check(got, want, grad=False):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  finite = np.isfinite(want)
  tol = tolerance("float32", grad)
  scale = np.abs(want[finite]).max(initial=0.0)
  np.testing.assert_array_less(np.abs(got[finite] - want[finite]), tol * (np.abs(want[finite]) + scale) + 1e-30)


def _check_against_reference(q, k, v, score_mod=None, mask_mod=None, reference_kwargs=None, **kwargs):
  got, weights = _te(q, k, v, score_mod=score_mod, mask_mod=mask_mod, **kwargs)
  with jax.enable_x64(True):
    want = jax.device_get(_with_gradients(
        lambda q, k, v: reference(q, k, v, score_mod, mask_mod, **(reference_kwargs or {})),
        *(jnp.asarray(x, jnp.float64) for x in (q, k, v)), weights))
  for index, (g, w) in enumerate(zip(got, want)):
    _check(g, w, grad=index >= 2)
  return got


REL_TABLE = _array(SQ + SKV)
TEMPERATURE = jnp.asarray(RNG.uniform(0.5, 2.0, H), jnp.float32)
SLOPES = jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)
PREFIX = jnp.asarray([5, 20], jnp.int32)
DOC_IDS = jnp.asarray(np.sort(RNG.integers(0, 4, (B, max(SQ, SKV))), axis=1), jnp.int32)
RANDOM_MASK = jnp.asarray(RNG.random((SQ, SKV)) < 0.7)

SCORE_MODS = {
    "relative_position_bias": lambda s, b, h, q, kv: s + REL_TABLE[q - kv + SKV],
    "head_temperature": lambda s, b, h, q, kv: s / TEMPERATURE[h],
    "alibi": lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q),
    "softcap": lambda s, b, h, q, kv: 2.0 * jnp.tanh(s / 2.0),
    "minus_inf": lambda s, b, h, q, kv: jnp.where((q + kv) % 3 == 0, -jnp.inf, s * 1.5),
}
MASK_MODS = {
    "python_causal": lambda b, h, q, kv: q >= kv,
    "prefix_lm": lambda b, h, q, kv: (kv < PREFIX[b]) | (q >= kv),
    "chunked_local": lambda b, h, q, kv: (q // 8 == kv // 8) & (q >= kv),
    "document": lambda b, h, q, kv: DOC_IDS[b, q] == DOC_IDS[b, kv],
    "random_captured": lambda b, h, q, kv: RANDOM_MASK[q, kv],
    "by_batch_and_head": lambda b, h, q, kv: ((b + h) % 3 != 0) & (kv <= q + 4 * h + b),
}


@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mod_matches_reference(name):
  _check_against_reference(*_qkv(), score_mod=SCORE_MODS[name])


@pytest.mark.parametrize("name", MASK_MODS)
def test_mask_mod_matches_reference(name):
  got = _check_against_reference(*_qkv(), mask_mod=MASK_MODS[name])
  if name == "by_batch_and_head":  # (b + h) % 3 == 0 hides whole rows: zeros and lse -inf
    assert np.all(np.asarray(got[0])[0, :, 0] == 0) and np.all(np.asarray(got[1])[0, 0] == -np.inf)


def test_both_mods_through_flex_attention():
  q, k, v = _qkv()
  score_mod, mask_mod = SCORE_MODS["relative_position_bias"], MASK_MODS["prefix_lm"]
  out, lse = te_jax.flex_attention(q, k, v, score_mod, mask_mod, scale=0.3, return_lse=True)
  want_out, want_lse = reference(q, k, v, score_mod, mask_mod, scale=0.3)
  _check(out, want_out)
  _check(lse, want_lse)


def test_composes_with_causal_gqa_dv_and_segment_ids():
  q, k, v = _qkv(sq=SKV)
  ids = jnp.asarray(np.sort(RNG.integers(0, 3, (B, SKV)), axis=1), jnp.int32)
  _check_against_reference(q, k, v, SCORE_MODS["relative_position_bias"], MASK_MODS["chunked_local"],
                           reference_kwargs=dict(causal=True, q_ids=ids, kv_ids=ids), mask_type="causal",
                           q_segment_ids=ids)


def test_composes_with_builtin_softcap_and_alibi():
  q, k, v = _qkv()
  _check_against_reference(q, k, v, SCORE_MODS["head_temperature"], MASK_MODS["document"],
                           reference_kwargs=dict(softcap=3.0, alibi=SLOPES), softcap=3.0, alibi_slopes=SLOPES)


def test_decode_shapes_keep_one_head_per_tile():
  """Few queries with MQA: the forward would pack the group's heads into one tile; with mods it does not."""
  _check_against_reference(*_qkv(sq=3, kv_heads=1), SCORE_MODS["head_temperature"], MASK_MODS["by_batch_and_head"])


@pytest.mark.parametrize("builtin, mod", [(dict(alibi_slopes=SLOPES), "alibi"), (dict(softcap=2.0), "softcap")])
def test_builtins_written_as_mods_equal_them(builtin, mod):
  q, k, v = _qkv(sq=SKV)
  as_mod, weights = _te(q, k, v, score_mod=SCORE_MODS[mod])
  built_in, _ = _te(q, k, v, weights=weights, **builtin)
  for index, (got, want) in enumerate(zip(as_mod, built_in)):  # the same sums, rounded apart
    _check(got, want, grad=index >= 2)


def test_nan_propagates_like_a_nan_bias():
  q, k, v = _qkv()
  nan_at = lambda q_idx, kv_idx: (q_idx == 3) & (kv_idx == 7)
  out = te_jax.fused_attn(q, k, v, score_mod=lambda s, b, h, qi, kvi: jnp.where(nan_at(qi, kvi), jnp.nan, s))
  i, j = jnp.arange(SQ)[:, None], jnp.arange(SKV)[None, :]
  bias = jnp.where(nan_at(i, j), jnp.nan, 0.0)[None, None].astype(jnp.float32)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(te_jax.fused_attn(q, k, v, bias=bias)))
  assert np.isnan(out[:, 3]).all() and not np.isnan(np.delete(np.asarray(out), 3, axis=1)).any()


def test_ffi_and_legacy_are_bitwise_equal():
  q, k, v = _qkv()
  mods = dict(score_mod=SCORE_MODS["relative_position_bias"], mask_mod=MASK_MODS["document"], mask_type="causal")
  ffi, weights = _te(q, k, v, "ffi", **mods)
  legacy, _ = _te(q, k, v, "legacy", weights, **mods)
  for a, b in zip(ffi, legacy):
    np.testing.assert_array_equal(a, b)


def test_vmap_gives_each_example_its_own_batch_index():
  """A mask on b: vmapped over 3 examples (folded into the batch), each example still sees b in [0, B)."""
  examples = [_qkv() for _ in range(3)]
  q, k, v = (jnp.stack(x) for x in zip(*examples))
  mask_mod = MASK_MODS["by_batch_and_head"]
  attend = lambda q, k, v: te_jax.flex_attention(q, k, v, SCORE_MODS["head_temperature"], mask_mod)
  mapped = jax.jit(jax.vmap(attend))(q, k, v)
  for n, example in enumerate(examples):
    np.testing.assert_array_equal(mapped[n], attend(*example))
  grads = jax.grad(lambda q: jnp.sum(jax.vmap(attend)(q, k, v) ** 2))(q)
  with jax.enable_x64(True):
    example = [jnp.asarray(x, jnp.float64) for x in examples[1]]
    want = jax.grad(lambda q: jnp.sum(reference(q, *example[1:], SCORE_MODS["head_temperature"], mask_mod)[0] ** 2))
    want = jax.device_get(want(example[0]))
  _check(grads[1], want, grad=True)


def test_vmapped_capture_is_refused():
  tables = _array((3, SQ + SKV))
  q, k, v = _qkv()
  attend = lambda table: te_jax.flex_attention(q, k, v, lambda s, b, h, qi, kvi: s + table[qi - kvi + SKV])
  with pytest.raises(ValueError, match="capture 0 .* is mapped by vmap"):
    jax.vmap(attend)(tables)


# score_mods whose floating-point captures are differentiated: a T5-style relative-position table per head, a learned
# per-head temperature in bfloat16, and an integer capture (document ids) beside a float one, which gets no gradient.
def _table_mod(table):
  return lambda s, b, h, q, kv: s + table[h, jnp.clip(q - kv + 8, 0, 16)]


def _temperature_mod(temperature):
  return lambda s, b, h, q, kv: s * temperature[h].astype(jnp.float32)


def _shifted_documents_mod(table):
  return lambda s, b, h, q, kv: s + jnp.where(DOC_IDS[b, q] == DOC_IDS[b, kv], table[0], table[1])


CAPTURE_GRADIENT_MODS = {
    "relative_position_table": (_table_mod, _array((H, 17))),
    "bfloat16_temperature": (_temperature_mod, jnp.asarray(RNG.uniform(0.5, 2.0, H), jnp.bfloat16)),
    "with_integer_capture": (_shifted_documents_mod, _array(2)),
}


def _capture_loss(make_mod, q, k, v, weights, attend):
  return lambda capture: jnp.sum(attend(q, k, v, make_mod(capture)) * weights)


@pytest.mark.parametrize("name", sorted(CAPTURE_GRADIENT_MODS))
@pytest.mark.parametrize("mask_type", ["no_mask", "causal"])
def test_capture_gradients_match_the_reference(name, mask_type):
  """The gradient of a loss with respect to an array the score_mod captures, against jax.grad of the float64
  reference through the same mod (q, k and v's gradients too)."""
  make_mod, capture = CAPTURE_GRADIENT_MODS[name]
  q, k, v = _qkv()
  weights = _array((B, SQ, H, DV))
  causal = mask_type == "causal"
  te = lambda q, k, v, mod: te_jax.fused_attn(q, k, v, score_mod=mod, mask_type=mask_type)
  got = jax.jit(jax.grad(lambda c, q: _capture_loss(make_mod, q, k, v, weights, te)(c), argnums=(0, 1)))(capture, q)
  with jax.enable_x64(True):
    ref = lambda q, k, v, mod: reference(q, k, v, mod, causal=causal)[0]
    q64, k64, v64, c64, w64 = (jnp.asarray(x, jnp.float64) for x in (q, k, v, capture, weights))
    want = jax.device_get(jax.grad(lambda c, q: _capture_loss(make_mod, q, k64, v64, w64, ref)(c),
                                   argnums=(0, 1))(c64, q64))
  assert got[0].dtype == capture.dtype and got[0].shape == capture.shape
  assert np.abs(want[0]).max() > 0
  if capture.dtype == jnp.bfloat16:
    # Each element's contribution is rounded to bfloat16 (the cotangent of a bfloat16 value is one, as in JAX) before
    # the float32 sum, whose terms of both signs cancel: a bound on the whole vector.
    error = np.linalg.norm(np.asarray(got[0], np.float64) - want[0]) / np.linalg.norm(want[0])
    assert error < 2e-2, error
  else:
    _check(got[0], want[0], grad=True)
  _check(got[1], want[1], grad=True)


def test_capture_gradients_are_bitwise_reproducible_with_deterministic_on_both_paths():
  q, k, v = _qkv()
  weights = _array((B, SQ, H, DV))
  make_mod, capture = CAPTURE_GRADIENT_MODS["relative_position_table"]
  te = lambda q, k, v, mod: te_jax.fused_attn(q, k, v, score_mod=mod, mask_type="causal", deterministic=True)
  runs = []
  for path in ("ffi", "legacy", "ffi"):
    with te_jax.custom_call_path(path):
      runs.append(np.asarray(jax.jit(jax.grad(_capture_loss(make_mod, q, k, v, weights, te)))(capture)))
  assert np.abs(runs[0]).max() > 0
  for run in runs[1:]:
    np.testing.assert_array_equal(run, runs[0])


def test_capture_gradients_under_vmap_sum_over_the_examples():
  """A capture the examples share: its gradient under vmap is the sum of each example's."""
  examples = [_qkv() for _ in range(3)]
  q, k, v = (jnp.stack(x) for x in zip(*examples))
  make_mod, capture = CAPTURE_GRADIENT_MODS["relative_position_table"]
  attend = lambda table: lambda q, k, v: te_jax.fused_attn(q, k, v, score_mod=make_mod(table), deterministic=True)
  mapped = jax.jit(jax.grad(lambda t: jnp.sum(jax.vmap(attend(t))(q, k, v) ** 2)))(capture)
  each = sum(jax.grad(lambda t: jnp.sum(attend(t)(*example) ** 2))(capture) for example in examples)
  np.testing.assert_allclose(mapped, each, rtol=1e-4, atol=1e-5 * float(np.abs(each).max()))


def test_differentiating_a_mask_mods_capture_is_refused():
  q, k, v = _qkv()
  loss = lambda limit: jnp.sum(te_jax.flex_attention(q, k, v, mask_mod=lambda b, h, qi, kvi: kvi < limit[h] * 40.0))
  with pytest.raises(ValueError, match="mask_mod's capture 0 .* is being differentiated"):
    jax.grad(loss)(TEMPERATURE)
  jax.grad(lambda t: loss(jax.lax.stop_gradient(t)))(TEMPERATURE)  # a fixed capture is fine


def _dense_block_states(mask_mod, batch, heads, block_q, block_kv):
  """The block states from the dense mask, written the obvious way."""
  b, h, i, j = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(SQ), np.arange(SKV), indexing="ij")
  keep = np.asarray(jax.vmap(mask_mod)(*(jnp.asarray(x.ravel(), jnp.int32) for x in (b, h, i, j)))).reshape(b.shape)
  rows, cols = -(-SQ // block_q), -(-SKV // block_kv)
  states = np.zeros((batch, heads, rows, cols), np.int8)
  for r in range(rows):
    for c in range(cols):
      block = keep[:, :, r * block_q:(r + 1) * block_q, c * block_kv:(c + 1) * block_kv]
      states[:, :, r, c] = np.where(block.all(axis=(2, 3)), 2, np.where(block.any(axis=(2, 3)), 1, 0))
  return states


@pytest.mark.parametrize("name", ["python_causal", "prefix_lm", "document", "by_batch_and_head"])
@pytest.mark.parametrize("block", [16, (8, 32)])
@pytest.mark.parametrize("step", [None, 13000])
def test_create_block_mask_states(name, block, step, monkeypatch):
  """Each block hidden, cut or kept as the dense mask says, lengths not multiples of the blocks, whether all block rows
  are evaluated in one step or a few a step (13000 values: 2 of 3 rows, or 3 of 5, and the rest); B and H None give
  one block row for all where the mask depends on neither."""
  if step is not None:
    monkeypatch.setattr(te_jax.block_mask, "MAP_STEP_EVALUATIONS", step)
  mask_mod = MASK_MODS[name]
  mask = te_jax.create_block_mask(mask_mod, B, H, SQ, SKV, block=block)
  block_q, block_kv = (block, block) if isinstance(block, int) else block
  np.testing.assert_array_equal(mask.blocks, _dense_block_states(mask_mod, B, H, block_q, block_kv))
  assert (mask.block_q, mask.block_kv, mask.seqlen_q, mask.seqlen_kv) == (block_q, block_kv, SQ, SKV)
  if name == "python_causal":
    shared = te_jax.create_block_mask(mask_mod, None, None, SQ, SKV, block=block)
    assert shared.blocks.shape[:2] == (1, 1)
    np.testing.assert_array_equal(shared.blocks[0, 0], mask.blocks[1, 2])
    assert set(np.unique(mask.blocks)) == {0, 1, 2}


@pytest.mark.parametrize("name", ["python_causal", "document", "by_batch_and_head"])
def test_a_block_mask_gives_its_mask_mods_attention(name):
  """flex_attention with the block mask (blocks of 16: tiles cut several of them) equals it with the mask_mod alone,
  and the reference, forward and every gradient, on both paths; under jit with the block mask an argument."""
  q, k, v = _qkv()
  mask_mod = MASK_MODS[name]
  block_mask = te_jax.create_block_mask(mask_mod, B, H, SQ, SKV, block=16)
  _check_against_reference(q, k, v, SCORE_MODS["head_temperature"], mask_mod, block_mask=block_mask)
  weights = _loss_weights((B, SQ, H, DV), (B, H, SQ))
  got, _ = _te(q, k, v, "ffi", weights, mask_mod=mask_mod, block_mask=block_mask)
  without, _ = _te(q, k, v, "ffi", weights, mask_mod=mask_mod)
  for a, b in zip(got, without):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  ffi, _ = _te(q, k, v, "ffi", weights, block_mask=block_mask)
  legacy, _ = _te(q, k, v, "legacy", weights, block_mask=block_mask)
  for a, b in zip(ffi, legacy):
    np.testing.assert_array_equal(a, b)
  f = jax.jit(lambda q, k, v, bm: te_jax.flex_attention(q, k, v, block_mask=bm))
  np.testing.assert_array_equal(f(q, k, v, block_mask), te_jax.flex_attention(q, k, v, block_mask=block_mask))


def test_a_mask_mod_alone_gets_a_block_mask_built_in_the_call(monkeypatch):
  """One block row for every batch entry and head where the mask_mod reads neither b nor h, per batch entry and head
  where it does, CPU-tile blocks; none above the evaluation limit."""
  from te_jax import block_mask as block_masks
  causal = block_masks.call_block_mask(MASK_MODS["python_causal"], B, H, SQ, SKV)
  assert causal.blocks.shape == (1, 1, 1, 1) and (causal.block_q, causal.block_kv) == block_masks.CALL_BLOCK
  per_head = block_masks.call_block_mask(MASK_MODS["by_batch_and_head"], B, H, 200, 300)
  assert per_head.blocks.shape == (B, H, 4, 3)
  assert block_masks.call_block_mask(MASK_MODS["document"], B, H, 200, 300).blocks.shape == (B, 1, 4, 3)
  monkeypatch.setattr(block_masks, "MAX_CALL_BLOCK_MASK_EVALUATIONS", B * H * 200 * 300 - 1)
  assert block_masks.call_block_mask(MASK_MODS["by_batch_and_head"], B, H, 200, 300) is None
  q, k, v = _qkv()
  built = te_jax.flex_attention(q, k, v, mask_mod=MASK_MODS["by_batch_and_head"])  # the call's own, CPU-tile blocks
  np.testing.assert_allclose(built, te_jax.flex_attention(
      q, k, v, block_mask=te_jax.create_block_mask(MASK_MODS["by_batch_and_head"], B, H, SQ, SKV, block=16)),
      rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MASK_MODS)
@pytest.mark.parametrize("block", [16, (8, 32)])
def test_a_mask_mods_library_computes_its_block_states(name, block):
  """te_jax_flex_mask_blocks (the host's block mask of a call's own, te_jax/flex/mask_blocks.py) gives the dense
  mask's states, lengths not multiples of the blocks."""
  from te_jax.flex.mask_blocks import mask_blocks
  mod = te_jax.flex.translate_mask_mod(MASK_MODS[name])
  block_q, block_kv = (block, block) if isinstance(block, int) else block
  blocks = mask_blocks(backend_for("cpu").flex_library(mod.spec()), mod.captures, B, H, SQ, SKV, block_q, block_kv)
  np.testing.assert_array_equal(blocks, _dense_block_states(MASK_MODS[name], B, H, block_q, block_kv))


def test_a_calls_own_block_mask_is_built_on_the_host_where_its_captures_are_known():
  """With concrete captures the blocks are a constant of the program (no XLA loop); a capture traced by the enclosing
  jit leaves them to XLA (lax.map); both give the same blocks and attention."""
  q, k, v = _qkv(sq=200, skv=300)
  ids = (jnp.arange(300)[None] + 40 * jnp.arange(B)[:, None]) // 150  # documents of 150 tokens
  document = lambda ids: lambda b, h, i, j: ids[b, i] == ids[b, j]
  host = jax.make_jaxpr(lambda q, k, v: te_jax.flex_attention(q, k, v, mask_mod=document(ids)))(q, k, v)
  traced = jax.make_jaxpr(lambda q, k, v, ids: te_jax.flex_attention(q, k, v, mask_mod=document(ids)))(q, k, v, ids)
  assert "scan" not in str(host) and "scan" in str(traced)
  from te_jax import block_mask as block_masks
  on_host = block_masks.call_block_mask(document(ids), B, H, 200, 300)
  in_xla = jax.jit(lambda ids: block_masks.call_block_mask(document(ids), B, H, 200, 300).blocks)(ids)
  np.testing.assert_array_equal(on_host.blocks, in_xla)
  assert set(np.unique(in_xla)) == {0, 1, 2}
  f = jax.jit(lambda q, k, v, ids: te_jax.flex_attention(q, k, v, mask_mod=document(ids)))
  np.testing.assert_array_equal(f(q, k, v, ids), te_jax.flex_attention(q, k, v, mask_mod=document(ids)))


def test_a_block_mask_under_vmap():
  """Shared by the examples of a vmap (folded into the batch), a block mask of a mask on b and h gives each example
  its own blocks."""
  examples = [_qkv() for _ in range(3)]
  q, k, v = (jnp.stack(x) for x in zip(*examples))
  block_mask = te_jax.create_block_mask(MASK_MODS["by_batch_and_head"], B, H, SQ, SKV, block=16)
  attend = lambda q, k, v: te_jax.flex_attention(q, k, v, block_mask=block_mask)
  mapped = jax.jit(jax.vmap(attend))(q, k, v)
  for n, example in enumerate(examples):
    np.testing.assert_array_equal(mapped[n], attend(*example))


@pytest.mark.parametrize("operand", ["q", "v", "none"])
def test_a_block_mask_changes_no_result_where_an_operand_is_nan(operand):
  """A hidden key tile is skipped only where its operands are finite: a NaN in the V of a key no row sees still
  enters as 0 x NaN, and a NaN in a query row still reaches dK, as with the mask_mod alone; all finite, the skip
  leaves every result as it was. Forward and gradients, the block mask against the mask_mod alone."""
  q, k, v = _array((1, 64, 2, D)), _array((1, 256, 2, D)), _array((1, 256, 2, DV))
  if operand == "v":
    v = v.at[:, 200].set(jnp.nan)  # no row sees key 200: its whole key tile (the CPU's 128 keys) is hidden
  if operand == "q":
    q = q.at[:, 10].set(jnp.nan)
  mask_mod = MASK_MODS["python_causal"]
  block_mask = te_jax.create_block_mask(mask_mod, None, None, 64, 256, block=64)
  weights = _loss_weights((1, 64, 2, DV), (1, 2, 64))
  got, _ = _te(q, k, v, "ffi", weights, block_mask=block_mask)
  want, _ = _te(q, k, v, "ffi", weights, mask_mod=mask_mod)
  for a, b in zip(got, want):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    np.testing.assert_allclose(np.where(np.isnan(b), 0, a), np.where(np.isnan(b), 0, b), rtol=1e-5, atol=1e-6)
  if operand != "none":
    assert np.isnan(got[0]).any()


def test_bad_block_masks_raise_naming_the_argument():
  q, k, v = _qkv()
  block_mask = te_jax.create_block_mask(MASK_MODS["python_causal"], B, H, SQ, SKV, block=16)
  with pytest.raises(TypeError, match="block_mask must be a te_jax.BlockMask"):
    te_jax.flex_attention(q, k, v, block_mask=block_mask.blocks)
  with pytest.raises(ValueError, match="block_mask carries its own mask_mod"):
    te_jax.flex_attention(q, k, v, mask_mod=MASK_MODS["document"], block_mask=block_mask)
  with pytest.raises(ValueError, match="block_mask was made for Sq, Skv = 37, 45"):
    te_jax.flex_attention(q[:, :20], k, v, block_mask=block_mask)
  with pytest.raises(ValueError, match="block_q must be a positive int"):
    te_jax.create_block_mask(MASK_MODS["python_causal"], B, H, SQ, SKV, block=(0, 16))
  with pytest.raises(TypeError, match="mask_mod must be a function"):
    te_jax.create_block_mask(None, B, H, SQ, SKV)


def test_the_mods_key_the_configuration():
  """jit's cache key: the same mod written twice is one configuration, another mod another."""
  config = lambda mod: AttentionConfig(MaskType.NO_MASK, -1, -1, 0.25, 0.0, False, score_mod=mod)
  spec = lambda f: te_jax.flex.translate_score_mod(f).spec()
  assert config(spec(lambda s, b, h, q, kv: s * 2.0)) == config(spec(lambda s, b, h, q, kv: s * 2.0))
  assert config(spec(lambda s, b, h, q, kv: s * 2.0)) != config(spec(lambda s, b, h, q, kv: s * 3.0))
  q, k, v = _qkv()
  f = jax.jit(lambda q, k, v, t: te_jax.flex_attention(q, k, v, lambda s, b, h, qi, kvi: s * t[h]))
  twice, thrice = (f(q, k, v, jnp.full((H,), x, jnp.float32)) for x in (2.0, 3.0))
  assert f._cache_size() == 1  # the captured values are operands, not configuration
  assert not np.allclose(twice, thrice)


def test_a_second_process_loads_the_library_from_disk(tmp_path):
  script = textwrap.dedent("""
      import time, jax.numpy as jnp, numpy as np, te_jax
      x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 2, 8)), jnp.float32)
      table = jnp.arange(40, dtype=jnp.float32) / 40
      start = time.perf_counter()
      te_jax.flex_attention(x, x, x, lambda s, b, h, q, kv: s - table[q - kv + 20] * h,
                            lambda b, h, q, kv: (q - kv) % 5 != 4).block_until_ready()
      print("seconds", time.perf_counter() - start)
      """)
  env = dict(os.environ, TE_JAX_CACHE_DIR=str(tmp_path), TE_JAX_LOG_LEVEL="DEBUG")
  runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
          for _ in range(2)]
  assert runs[0].stderr.count("compiled the") == 2, runs[0].stderr
  assert "compiled the" not in runs[1].stderr and runs[1].stderr.count("from the disk cache") == 2, runs[1].stderr
  assert len(list(tmp_path.glob("flex-*.so"))) == 2 and not list(tmp_path.glob(".flex-*"))
  # The compiler's --version (the libraries' key) is run once and then read from its record.
  assert "--version" in runs[0].stderr and "--version" not in runs[1].stderr, runs[1].stderr
  assert len(list(tmp_path.glob("compiler-*.txt"))) == 1 and not list(tmp_path.glob(".compiler-*"))


def test_a_backend_without_mod_kernels_refuses_them_at_lowering():
  spec = te_jax.flex.translate_mask_mod(MASK_MODS["python_causal"]).spec()
  config = AttentionConfig(MaskType.NO_MASK, -1, -1, 0.25, 0.0, False, mask_mod=spec)
  other = dataclasses.replace(backend_for("cpu"), platform="rocm", code=1, flex_library=None)
  with pytest.raises(ValueError, match="score_mod/mask_mod have no rocm kernels"):
    _primitives._mod_libraries(config, other)


@pytest.mark.parametrize("captures, deterministic, match", [
    ([(4,)] * 9, False, "at most 8 arrays"),
    ([(2, 2, 2, 2, 2)], False, "at most 4 dims"),
    ([(1 << 16, 1 << 15)], False, "fewer than 2\\^31 elements"),
    ([(4,)], True, "deterministic=True with a score_mod"),
])
def test_the_cuda_kernels_limits_on_captures(captures, deterministic, match):
  """The core checks what the CUDA kernels take (cpp/core/validate.cc), so either path's handler refuses it too."""
  spec = te_jax.flex.translate_score_mod(SCORE_MODS["head_temperature"]).spec()
  config = AttentionConfig(MaskType.NO_MASK, -1, -1, 0.25, 0.0, False, score_mod=spec, deterministic=deterministic)
  params = config.core_params((B, SQ, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV), jnp.bfloat16)
  params.update(config.flex_params(("/cache/flex-score_mod.cuh", ""), captures, "backward"),
                score_mod_captures=len(captures), score_mod_gradients=1)
  extension = backend_for("cpu").extension
  with pytest.raises(ValueError, match=match):
    extension.validate(params, 1, "backward")
  extension.validate(params, 0, "backward")  # the CPU takes them


def test_legacy_opaque_bytes_carry_the_mods():
  spec = te_jax.flex.translate_score_mod(SCORE_MODS["relative_position_bias"]).spec()
  config = AttentionConfig(MaskType.NO_MASK, -1, -1, 0.25, 0.0, False, score_mod=spec)
  params = config.core_params((B, SQ, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV), np.float32)
  params.update(config.flex_params(("/cache/flex-score_mod.so", ""), [(SQ + SKV,)], "backward"))
  extension = backend_for("cpu").extension
  packed = extension.pack_descriptor(params)
  assert len(packed) > extension.descriptor_size
  unpacked = extension.unpack_descriptor(packed)
  assert {key: unpacked[key] for key in config.flex_params(("", ""), [], "backward")} == {
      "score_mod_library": "/cache/flex-score_mod.so", "mask_mod_library": "", "flex_batch_fold": 1,
      "score_mod_captures": 1, "score_mod_gradients": 1, "flex_block_q": 0, "flex_block_kv": 0,
      "flex_capture_shapes": [[SQ + SKV]]}
  for index in (extension.descriptor_size + 9, len(packed) - 1):
    corrupted = bytearray(packed)
    corrupted[index] ^= 1
    with pytest.raises(ValueError, match="checksum"):
      extension.unpack_descriptor(bytes(corrupted))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(score_mod="tanh"), TypeError, "score_mod must be a function score_mod.*got str"),
    (dict(mask_mod=3), TypeError, "mask_mod must be a function mask_mod.*got int"),
    (dict(mask_mod=lambda b, h, q, kv: 1.0 * q), TypeError, "mask_mod must return a bool scalar"),
    (dict(score_mod=lambda s, b, h: s), TypeError, "score_mod must take 5 positional arguments"),
    (dict(score_mod=lambda s, b, h, q, kv: s + jnp.cumsum(REL_TABLE)[q]), NotImplementedError, "cumsum"),
])
def test_bad_mods_raise_naming_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    te_jax.fused_attn(*_qkv(), **kwargs)
