"""GPU: score_mod / mask_mod compiled into te_jax's sm90 kernels, bf16, against the float64 reference of
tests/test_flex_attention.py written from the same Python mods: out, lse, dq, dk, dv and the score_mod's capture
gradients (a relative-position table, a per-head temperature), over masks, GQA, head dims, segment ids, a bias,
deterministic, rows every key of which the mods hide, vmap, block masks, FFI == legacy; the built-ins written as mods
against the built-ins; -inf and NaN scores. Skipped without a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_cuda_attention import _GPUS  # noqa: F401  (skips this module without a GPU)
from test_flex_attention import reference
from helpers import tolerance

import te_jax

SPAN = 128  # the relative-position table's distances: q - kv in [-SPAN / 2, SPAN / 2)


def _table(rng, h):
  return jnp.asarray(rng.standard_normal((h, SPAN)), jnp.float32)


def _temperature(rng, h):
  return jnp.asarray(rng.uniform(0.5, 2.0, h), jnp.float32)


# Score mods (of the captures they are given) and mask mods, by name.
SCORE_MODS = {
    None: None,
    "relative_table": lambda table: lambda s, b, h, q, kv: s + table[h, jnp.clip(q - kv + SPAN // 2, 0, SPAN - 1)],
    "temperature": lambda temp: lambda s, b, h, q, kv: s / temp[h],
    "tanh_cap": lambda _: lambda s, b, h, q, kv: 20.0 * jnp.tanh(s / 20.0),
}
MASK_MODS = {
    None: None,
    "causal": lambda b, h, q, kv: q >= kv,
    "prefix_lm": lambda b, h, q, kv: (kv < 40 + 30 * b) | (q >= kv),
    "chunked_local": lambda b, h, q, kv: (q // 64 == kv // 64) & (q >= kv),
    # Rows q % 7 == 3 of odd heads see no key: out 0, lse -inf, no gradient.
    "hides_rows": lambda b, h, q, kv: ((q % 7 != 3) | (h % 2 == 0)) & (kv <= q + 17),
}

CASES = [  # name, score_mod, mask_mod, B, Sq, Skv, H, Hkv, D, fused_attn options, reference options
    ("table_causal_gqa_d128", "relative_table", None, 2, 300, 300, 8, 2, 128, dict(mask_type="causal"),
     dict(causal=True)),
    ("temperature_prefix_d64", "temperature", "prefix_lm", 2, 257, 301, 4, 4, 64, {}, {}),
    ("mask_only_chunked_d128", None, "chunked_local", 1, 390, 390, 4, 1, 128, {}, {}),
    ("tanh_cap_hidden_rows_d128", "tanh_cap", "hides_rows", 2, 200, 200, 4, 2, 128, {}, {}),
    ("table_causal_deterministic_mask_only", None, "causal", 2, 190, 190, 4, 2, 128, dict(deterministic=True), {}),
    ("decode_shape_temperature", "temperature", "prefix_lm", 2, 3, 700, 8, 2, 128, {}, {}),
]


def _bf16(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _loss(attend, weights):
  def loss(q, k, v, capture):
    out, lse = attend(q, k, v, capture)
    return jnp.sum(out * weights[0]) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * weights[1]), (out, lse)
  return loss


def _check(name, got, want, grad):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want), err_msg=name)
  finite = np.isfinite(want)
  scale = np.abs(want[finite]).max(initial=0.0)
  err = np.abs(got[finite] - want[finite])
  bound = tolerance("bfloat16", grad) * (np.abs(want[finite]) + scale) + 1e-30
  assert (err <= bound).all(), f"{name}: max error {err.max()} (bound at it {bound[err.argmax()]})"


def _run_case(name, score_name, mask_name, b, sq, skv, h, hkv, d, options, reference_options, path="ffi", seed=52):
  rng = np.random.default_rng(seed)
  q, k, v = _bf16(rng, b, sq, h, d), _bf16(rng, b, skv, hkv, d), _bf16(rng, b, skv, hkv, d)
  capture = _temperature(rng, h) if score_name == "temperature" else _table(rng, h)
  weights = (jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.float32),
             jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32))
  score_of = SCORE_MODS[score_name]
  mask_mod = MASK_MODS[mask_name]

  def te(q, k, v, capture):
    return te_jax.fused_attn(q, k, v, score_mod=score_of(capture) if score_of else None, mask_mod=mask_mod,
                             return_lse=True, engine="te", **options)

  with te_jax.custom_call_path(path):
    grads, (out, lse) = jax.jit(jax.grad(_loss(te, weights), argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, capture)
  te_jax.raise_legacy_failures()
  with jax.enable_x64(True):
    def ref(q, k, v, capture):
      return reference(q, k, v, score_of(capture) if score_of else None, mask_mod, **reference_options)

    wide = [jnp.asarray(x, jnp.float64) for x in (q, k, v, capture)]
    want_grads, (want_out, want_lse) = jax.grad(_loss(ref, weights), argnums=(0, 1, 2, 3), has_aux=True)(*wide)
    want_grads, want_out, want_lse = jax.device_get((want_grads, want_out, want_lse))
  _check(f"{name} out", out, want_out, False)
  _check(f"{name} lse", lse, want_lse, False)
  for what, got, want in zip(("dq", "dk", "dv", "dcapture"), grads, want_grads):
    if what == "dcapture" and (score_of is None or score_name == "tanh_cap"):
      assert not np.asarray(got).any(), f"{name}: a capture the mods do not read has no gradient"
      continue
    _check(f"{name} {what}", got, want, True)
  return out, lse, grads


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mods_on_the_gpu_match_the_reference(case):
  out, lse, _ = _run_case(*case)
  if case[2] == "hides_rows":
    hidden = np.asarray(lse)[:, 1::2, 3::7]
    assert np.all(hidden == -np.inf) and not np.asarray(out)[:, 3::7, 1::2].any()


def test_ffi_and_legacy_agree_bitwise():
  """The forward and the mask-only backward bitwise; the capture gradients' atomic sums in no fixed order."""
  results = [_run_case(*CASES[2], path=path, seed=7) for path in ("ffi", "legacy")]
  for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_segment_ids_and_bias_compose_with_mods():
  rng = np.random.default_rng(53)
  b, s, h, d = 2, 260, 4, 128
  q, k, v = _bf16(rng, b, s, h, d), _bf16(rng, b, s, h, d), _bf16(rng, b, s, h, d)
  ids = jnp.asarray(np.sort(rng.integers(1, 4, (b, s)), axis=1), jnp.int32)
  bias = jnp.asarray(rng.standard_normal((1, h, s, s)), jnp.float32)
  temp = _temperature(rng, h)
  out = te_jax.fused_attn(q, k, v, score_mod=SCORE_MODS["temperature"](temp), mask_mod=MASK_MODS["prefix_lm"],
                          q_segment_ids=ids, mask_type="causal", engine="te")
  with jax.enable_x64(True):
    # The bias enters before the score_mod: fold it into the reference's score_mod.
    want, _ = reference(q, k, v, lambda x, bb, hh, i, j: (x + bias[0, hh, i, j]) / temp[hh], MASK_MODS["prefix_lm"],
                        causal=True, q_ids=ids, kv_ids=ids)
  out_with_bias = te_jax.fused_attn(q, k, v, score_mod=SCORE_MODS["temperature"](temp),
                                    mask_mod=MASK_MODS["prefix_lm"], q_segment_ids=ids, mask_type="causal",
                                    bias=bias, engine="te")
  _check("segment ids + bias", out_with_bias, want, False)
  assert not np.array_equal(np.asarray(out), np.asarray(out_with_bias))


def test_vmap_gives_each_example_its_batch_index():
  rng = np.random.default_rng(54)
  q, k, v = (_bf16(rng, 3, 2, 150, 4, 64) for _ in range(3))
  mask_mod = MASK_MODS["prefix_lm"]  # depends on b
  got = jax.vmap(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_mod=mask_mod, engine="te"))(q, k, v)
  for n in range(3):
    with jax.enable_x64(True):
      want, _ = reference(q[n], k[n], v[n], None, mask_mod)
    _check(f"example {n}", got[n], want, False)


def test_the_cudnn_engine_refuses_mods():
  q = _bf16(np.random.default_rng(55), 1, 128, 4, 128)
  with pytest.raises(te_jax.EngineUnavailableError, match="score_mod or mask_mod"):
    jax.jit(lambda q: te_jax.fused_attn(q, q, q, mask_mod=MASK_MODS["causal"], engine="cudnn")).lower(q)


@pytest.mark.parametrize("block", [128, (64, 128), (256, 64)])
@pytest.mark.parametrize("mask_name", ["causal", "chunked_local", "prefix_lm"])
def test_a_block_mask_changes_no_result(mask_name, block):
  """The kernels load only the tiles between each block's first and last shown one, and skip the mask_mod on tiles
  whose blocks all keep every pair: the results stay the mask_mod's, forward and backward."""
  rng = np.random.default_rng(56)
  b, s, h, d = 2, 700, 4, 128
  q, k, v, dout = (_bf16(rng, b, s, h, d) for _ in range(4))
  mask_mod = MASK_MODS[mask_name]
  block_mask = te_jax.create_block_mask(mask_mod, b if mask_name == "prefix_lm" else None, None, s, s, block=block)

  def loss(q, k, v, **kwargs):
    out = te_jax.fused_attn(q, k, v, engine="te", **kwargs)
    return jnp.sum(out * dout), out

  with_blocks = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, block_mask=block_mask)
  with jax.enable_x64(True):
    def ref_loss(q, k, v):
      out, _ = reference(q, k, v, None, mask_mod)
      return jnp.sum(out * jnp.asarray(dout, jnp.float64)), out
    want = jax.device_get(jax.grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(
        *(jnp.asarray(x, jnp.float64) for x in (q, k, v))))
  (grads, out), (want_grads, want_out) = with_blocks, want
  _check(f"{mask_name} {block} out", out, want_out, False)
  for what, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
    _check(f"{mask_name} {block} {what}", got, expected, True)


def test_a_block_mask_that_keeps_every_pair_skips_the_mask_mod():
  """As on the CPU: the block mask must be the mask_mod's; where it says every pair of a block is kept, the kernels
  skip the mask_mod there (here, everywhere: the plain attention's result)."""
  rng = np.random.default_rng(57)
  q, k, v = (_bf16(rng, 1, 256, 2, 64) for _ in range(3))
  keeps_all = te_jax.create_block_mask(lambda b, h, i, j: j >= 0, None, None, 256, 256)
  lying = te_jax.BlockMask(keeps_all.blocks, MASK_MODS["causal"], 256, 256, keeps_all.block_q, keeps_all.block_kv)
  got = te_jax.fused_attn(q, k, v, block_mask=lying, engine="te")
  with jax.enable_x64(True):
    want, _ = reference(q, k, v)
  _check("every pair kept", got, want, False)


@pytest.mark.parametrize("builtin, score_mod, mask_mod", [
    (dict(softcap=20.0), SCORE_MODS["tanh_cap"](None), None),
    (None, "alibi", None),
    (dict(mask_type="causal"), None, MASK_MODS["causal"]),
], ids=["softcap", "alibi", "causal"])
def test_builtins_written_as_mods_equal_them(builtin, score_mod, mask_mod):
  rng = np.random.default_rng(58)
  b, s, h, d = 2, 300, 4, 128
  q, k, v, dout = (_bf16(rng, b, s, h, d) for _ in range(4))
  if score_mod == "alibi":
    slopes = jnp.asarray(2.0 ** -np.arange(1, h + 1), jnp.float32)
    builtin = dict(alibi_slopes=slopes)
    score_mod = lambda x, bb, hh, i, j: x + slopes[hh] * (j - i)  # noqa: E731

  def run(**kwargs):
    def loss(q, k, v):
      out = te_jax.fused_attn(q, k, v, engine="te", **kwargs)
      return jnp.sum(out * dout), out
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

  (mod_grads, mod_out), (ref_grads, ref_out) = run(score_mod=score_mod, mask_mod=mask_mod), run(**builtin)
  _check("out", mod_out, ref_out, False)  # the same sums, rounded apart
  for what, got, want in zip(("dq", "dk", "dv"), mod_grads, ref_grads):
    _check(what, got, want, True)


def test_minus_inf_and_nan_scores_propagate_as_on_the_cpu():
  rng = np.random.default_rng(59)
  q, k, v = (_bf16(rng, 1, 200, 2, 64) for _ in range(3))
  minus_inf = lambda s, b, h, i, j: jnp.where((i + j) % 3 == 0, -jnp.inf, s)  # noqa: E731
  nan_at = lambda s, b, h, i, j: jnp.where((i == 5) & (j == 9), jnp.nan, s)  # noqa: E731
  with jax.enable_x64(True):
    want, _ = reference(q, k, v, minus_inf)
  _check("-inf scores", te_jax.fused_attn(q, k, v, score_mod=minus_inf, engine="te"), want, False)
  out = np.asarray(te_jax.fused_attn(q, k, v, score_mod=nan_at, engine="te"), np.float32)
  assert np.isnan(out[:, 5]).all() and not np.isnan(np.delete(out, 5, axis=1)).any()
