"""FP8 attention on the CPU (te_jax/fp8.py): te_jax.quantize_fp8's current scaling, fused_attn on pre-quantized q, k, v
against the float64 reference over the dequantized values, the training entry fp8= (straight-through gradients in the
operands' dtype), and the refusals: missing or misshaped descales, gradients of FP8 operands or descales, and a GPU
lowering (no FP8 kernels there yet)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import dequantize_fp8, quantize_fp8
from te_jax.reference import attention_reference

from helpers import PATHS, assert_close

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Relative spacing of the formats' normal values (3 and 2 mantissa bits): round to nearest is within half of it.
HALF_SPACING = {E4M3: 2.0**-4, E5M2: 2.0**-3}
# Their smallest subnormal step, in units of the descale.
SUBNORMAL_STEP = {E4M3: 2.0**-9, E5M2: 2.0**-16}


def values(x8, descale):
  """What an FP8 operand stands for, computed here in float64 (independently of te_jax's dequantize_fp8)."""
  d = np.asarray(descale, np.float64)
  return np.asarray(x8.astype(jnp.float32), np.float64) * (d.reshape(1, 1, -1, 1) if d.ndim else d)


def normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("per_head", [False, True])
def test_quantize_round_trip_and_descales(fmt, per_head):
  x = normal(1, (2, 33, 3, 16)) * jnp.asarray([1.0, 50.0, 1e-3])[None, None, :, None]  # heads of different scale
  x8, descale = quantize_fp8(x, dtype=fmt, per_head=per_head)
  assert x8.dtype == fmt and x8.shape == x.shape and descale.dtype == jnp.float32
  amax = np.abs(np.asarray(x)).max(axis=(0, 1, 3) if per_head else None)
  np.testing.assert_allclose(np.asarray(descale), amax / float(jnp.finfo(fmt).max), rtol=1e-6)
  assert float(jnp.abs(x8.astype(jnp.float32)).max()) == float(jnp.finfo(fmt).max)  # amax lands on the format's max
  back = np.asarray(dequantize_fp8(x8, descale), np.float64)
  np.testing.assert_array_equal(back, values(x8, descale).astype(np.float32))
  d = np.asarray(descale, np.float64).reshape((1, 1, -1, 1) if per_head else ())
  err = np.abs(back - np.asarray(x, np.float64))
  assert np.all(err <= HALF_SPACING[fmt] * np.abs(np.asarray(x)) + SUBNORMAL_STEP[fmt] * d * 0.5 * 1.0001)


def test_quantize_amax_saturates_and_zero_tensor():
  x = jnp.asarray([[[[0.5, -3.0, 1000.0, -1000.0]]]], jnp.float32)
  x8, descale = quantize_fp8(x, amax=jnp.float32(4.0))
  np.testing.assert_allclose(float(descale), 4.0 / 448.0)
  np.testing.assert_array_equal(np.asarray(x8.astype(jnp.float32))[0, 0, 0, 2:], [448.0, -448.0])  # saturated
  z8, zd = quantize_fp8(jnp.zeros((1, 4, 2, 8), jnp.bfloat16), per_head=True)
  np.testing.assert_array_equal(np.asarray(zd), [1.0, 1.0])
  assert not np.any(np.asarray(z8.astype(jnp.float32)))


def test_quantize_nan_poisons_the_tensor_as_its_formula_says():
  x = normal(2, (1, 4, 2, 8)).at[0, 1, 0, 3].set(jnp.nan)
  _, descale = quantize_fp8(x)
  assert np.isnan(float(descale))
  _, per_head = quantize_fp8(x, per_head=True)
  assert np.isnan(float(per_head[0])) and np.isfinite(float(per_head[1]))  # only the NaN's head


@pytest.mark.parametrize("bad, message", [
    (dict(dtype=jnp.bfloat16), "float8_e4m3fn or jnp.float8_e5m2"),
    (dict(per_head=True, x_shape=(4, 8)), r"\[B, S, H, D\]"),
    (dict(amax=jnp.ones((3,), jnp.float32)), "must be float32, a scalar"),
    (dict(per_head=True, amax=jnp.float32(1.0)), r"must be float32, \[2\]"),
])
def test_quantize_refuses(bad, message):
  bad = dict(bad)
  x = jnp.ones(bad.pop("x_shape", (1, 4, 2, 8)), jnp.float32)
  with pytest.raises((TypeError, ValueError), match=message):
    quantize_fp8(x, **bad)
  with pytest.raises(TypeError, match="x must be"):
    quantize_fp8(jnp.ones((2,), jnp.int32))


def _prequantized(seed, b, sq, skv, h, hkv, d, dv, fmt, per_head, outliers=False):
  q, k, v = normal(seed, (b, sq, h, d)), normal(seed + 1, (b, skv, hkv, d)), normal(seed + 2, (b, skv, hkv, dv))
  if outliers:  # 0.1% of the entries x 20: the case FP8 recipes fear
    q, k, v = (jnp.where(jax.random.uniform(jax.random.key(seed + 10 + i), x.shape) < 1e-3, 20 * x, x)
               for i, x in enumerate((q, k, v)))
  return [quantize_fp8(x, dtype=fmt, per_head=per_head) for x in (q, k, v)]


CASES = [  # b, sq, skv, h, hkv, d, dv, mask, window, fmt, per_head, outliers
    (2, 37, 37, 4, 2, 32, 32, "causal", (-1, -1), E4M3, False, False),
    (2, 29, 41, 2, 2, 16, 24, "padding_causal_bottom_right", (-1, -1), E4M3, True, True),
    (1, 64, 64, 4, 1, 64, 64, "no_mask", (8, 0), E5M2, True, False),
    (2, 1, 77, 4, 2, 32, 32, "causal_bottom_right", (-1, -1), E4M3, True, False),  # decode
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[7]}-{jnp.dtype(c[9]).name}-{'head' if c[10] else 'tensor'}")
def test_prequantized_against_the_reference_over_dequantized_values(case, path):
  b, sq, skv, h, hkv, d, dv, mask, window, fmt, per_head, outliers = case
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(3, b, sq, skv, h, hkv, d, dv, fmt, per_head, outliers)
  lengths = {}
  if mask.startswith("padding"):
    lengths = dict(q_seqlens=jnp.asarray([sq, sq - 9], jnp.int32), kv_seqlens=jnp.asarray([skv - 5, skv], jnp.int32))
  with te_jax.custom_call_path(path):
    out, lse = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=mask, window_size=window, q_descale=qd,
                                                         k_descale=kd, v_descale=vd, return_lse=True, **lengths))(
                                                             q8, k8, v8)
  assert out.dtype == jnp.bfloat16 and out.shape == (b, sq, h, dv)
  ref = attention_reference(*(values(x, s) for x, s in ((q8, qd), (k8, kd), (v8, vd))),
                            mask_type=mask, window_size=window,
                            **{n: np.asarray(x) for n, x in lengths.items()})
  # The same math on exactly representable values: float32 attention, out rounded once to bfloat16.
  assert_close("out", out, ref["out"], 2.0**-8)
  assert_close("lse", lse, ref["lse"], 1e-5)


def test_prequantized_ffi_and_legacy_agree_bitwise_and_out_dtype():
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(7, 2, 40, 40, 4, 2, 32, 32, E4M3, True)
  outs = []
  for path in PATHS:
    with te_jax.custom_call_path(path):
      outs.append(te_jax.fused_attn(q8, k8, v8, mask_type="causal", q_descale=qd, k_descale=kd, v_descale=vd,
                                    out_dtype=jnp.float32))
  assert outs[0].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
  half = te_jax.fused_attn(q8, k8, v8, mask_type="causal", q_descale=qd, k_descale=kd, v_descale=vd,
                           out_dtype=jnp.float16)
  np.testing.assert_array_equal(np.asarray(half), np.asarray(outs[0].astype(jnp.float16)))


def test_prequantized_under_vmap():
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(9, 2, 24, 24, 2, 2, 16, 16, E4M3, False)
  call = lambda q: te_jax.fused_attn(q, k8, v8, mask_type="causal", q_descale=qd, k_descale=kd, v_descale=vd)
  stacked = jnp.stack([q8, q8[::-1]])
  mapped = jax.vmap(call)(stacked)
  np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(call(q8[::-1])))


@pytest.mark.parametrize("mode", [True, "per_head"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_training_entry_is_attention_of_the_dequantized_values_with_straight_through_gradients(mode, dtype):
  b, s, h, hkv, d = 2, 33, 4, 2, 32
  q, k, v = normal(11, (b, s, h, d), dtype), normal(12, (b, s, hkv, d), dtype), normal(13, (b, s, hkv, d), dtype)
  dout = normal(14, (b, s, h, d), jnp.float32)
  per_head = mode == "per_head"

  def loss(q, k, v):
    return (te_jax.fused_attn(q, k, v, mask_type="causal", fp8=mode).astype(jnp.float32) * dout).sum()

  out = te_jax.fused_attn(q, k, v, mask_type="causal", fp8=mode)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  deq = [values(*quantize_fp8(x, per_head=per_head)) for x in (q, k, v)]
  ref = attention_reference(*deq, mask_type="causal", dout=np.asarray(dout, np.float64))
  tol = 2.0**-8 if dtype == jnp.bfloat16 else 1e-5
  assert_close("out", out, ref["out"], tol)
  for name, got in zip(("dq", "dk", "dv"), grads):  # the gradient at the dequantized values, in the operand's dtype
    assert_close(name, got, ref[name], 2 * tol)


def test_training_entry_with_delayed_scaling_amax():
  q, k, v = (normal(20 + i, (1, 16, 2, 16)) for i in range(3))
  amax = tuple(jnp.float32(a) for a in (1.0, 2.0, 3.0))  # below q's own amax: q saturates
  out = te_jax.fused_attn(q, k, v, fp8=True, fp8_amax=amax)
  deq = [values(*quantize_fp8(x, amax=a)) for x, a in zip((q, k, v), amax)]
  assert_close("out", out, attention_reference(*deq)["out"], 1e-5)
  assert float(jnp.abs(jnp.asarray(deq[0])).max()) == pytest.approx(1.0)


def _fp8_args(per_head=False):
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(30, 1, 8, 8, 2, 2, 16, 16, E4M3, per_head)
  return q8, k8, v8, dict(q_descale=qd, k_descale=kd, v_descale=vd)


def test_gradients_of_fp8_operands_and_descales_are_errors():
  q8, k8, v8, descales = _fp8_args()
  loss = lambda q, k, v, **d: te_jax.fused_attn(q, k, v, **d).astype(jnp.float32).sum()
  with pytest.raises(ValueError, match="k is an FP8 operand being differentiated"):
    jax.grad(loss, argnums=1)(q8, k8, v8, **descales)
  with pytest.raises(ValueError, match="v_descale is being differentiated"):
    jax.grad(lambda vd: loss(q8, k8, v8, q_descale=descales["q_descale"], k_descale=descales["k_descale"],
                             v_descale=vd))(descales["v_descale"])
  # Nothing differentiated through them: fine.
  jax.grad(lambda x: loss(q8, k8, v8, **descales) * x)(1.0)


@pytest.mark.parametrize("change, error, message", [
    (dict(drop="v_descale"), ValueError, "v_descale missing"),
    (dict(k_descale=jnp.ones((3,), jnp.float32)), ValueError, r"k_descale must be float32, a scalar or \[2\]"),
    (dict(q_descale=jnp.ones((), jnp.bfloat16)), ValueError, "q_descale must be float32, a scalar or"),
    (dict(v_dtype=jnp.float8_e5m2), TypeError, "one FP8 dtype"),
    (dict(fp8=True), ValueError, "already FP8"),
    (dict(out_dtype=jnp.int8), TypeError, "out_dtype must be"),
])
def test_prequantized_refusals(change, error, message):
  q8, k8, v8, kwargs = _fp8_args()
  change = dict(change)
  if "drop" in change:
    del kwargs[change.pop("drop")]
  if "v_dtype" in change:
    v8 = v8.astype(jnp.float32).astype(change.pop("v_dtype"))
  kwargs.update(change)
  with pytest.raises(error, match=message):
    te_jax.fused_attn(q8, k8, v8, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(q_descale=jnp.float32(1)), "go with FP8 q, k and v"),
    (dict(fp8="per_tensor"), "fp8 must be False, True"),
    (dict(fp8=1), "fp8 must be False, True"),
    (dict(fp8_amax=(jnp.float32(1),) * 3), "go with FP8 attention"),
    (dict(out_dtype=jnp.float32), "go with FP8 attention"),
    (dict(fp8=True, fp8_amax=(jnp.float32(1),) * 2), r"fp8_amax must be a tuple \(q_amax, k_amax, v_amax\)"),
    (dict(fp8="per_head", fp8_amax=(jnp.float32(1),) * 3), r"fp8_amax for q must be float32, \[2\]"),
])
def test_training_entry_refusals(kwargs, message):
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=message):
    te_jax.fused_attn(q, q, q, **kwargs)


@pytest.mark.parametrize("fp8_call", ["prequantized", "training"])
def test_gpu_lowering_refuses_fp8_instead_of_another_precision(fp8_call):
  if fp8_call == "prequantized":
    q8, k8, v8, descales = _fp8_args()
    fn, args = (lambda q: te_jax.fused_attn(q, k8, v8, **descales)), (q8,)
  else:
    fn, args = (lambda q: te_jax.fused_attn(q, q, q, fp8=True)), (jnp.ones((1, 8, 2, 16), jnp.bfloat16),)
  with pytest.raises(Exception, match="FP8 attention .* has no cuda kernels in te_jax yet"):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_fp8_values_transposed_is_the_kernels_layout():
  # Key 16 g + FP8_KEY_OF_SLOT[i] of each K/V head lands at V^T slot 16 g + i of that head's [Dv, Skv] rows, the order
  # in which the kernel's threads fill p's e4m3 fragments (kernels/primitives/fragment.h Fp8KeyOfSlot).
  from te_jax import fp8
  v = np.arange(2 * 32 * 3 * 4).reshape(2, 32, 3, 4)
  vt = np.asarray(fp8.fp8_values_transposed(jnp.asarray(v))).reshape(2, 3, 4, 32)
  slots = np.arange(32)
  keys = 16 * (slots // 16) + fp8.FP8_KEY_OF_SLOT[slots % 16]
  np.testing.assert_array_equal(vt, v[:, keys].transpose(0, 2, 3, 1))
  assert sorted(fp8.FP8_KEY_OF_SLOT) == list(range(16))


def test_fp8_descales_operand_per_query_head():
  from te_jax import fp8
  d = np.asarray(fp8.fp8_descales(jnp.float32(2), jnp.array([3, 5], jnp.float32), jnp.float32(7), 4))
  np.testing.assert_array_equal(d, [[[2, 2, 2, 2]], [[3, 3, 5, 5]], [[7, 7, 7, 7]]])


def test_gpu_lowering_of_prequantized_fp8_with_the_kernel_enabled(cuda_lowering, monkeypatch):
  # TE_JAX_CUDA_FP8_ATTENTION=1: the CUDA lowering passes FP8 q, k and V^T with the [3, 1, H] descales to the custom
  # call, whose out is bfloat16 (the kernel is not yet run on a GPU: without the variable the call is refused).
  monkeypatch.setenv("TE_JAX_CUDA_FP8_ATTENTION", "1")
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(31, 1, 8, 32, 4, 2, 128, 128, E4M3, True)
  def fn(q):  # a new function per lowering (jit caches one)
    return te_jax.fused_attn(q, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, mask_type="causal")
  (call,) = _custom_calls(cuda_lowering(fn, q8))
  assert call.count("f8E4M3FN") == 3 and "tensor<3x1x4xf32>" in call and "-> (tensor<1x8x4x128xbf16>" in call, call
  monkeypatch.setenv("TE_JAX_CUDA_FP8_ATTENTION", "2")
  with pytest.raises(ValueError, match="TE_JAX_CUDA_FP8_ATTENTION must be 0 or 1"):
    cuda_lowering(lambda q: fn(q), q8)


# An FP8 KV cache: k and v in FP8 with q in bfloat16/float16/float32, contiguous (fused_attn) or paged.

@pytest.mark.parametrize("granularity", ["tensor", "head", "page"])
def test_quantize_kv_pages_granularities(granularity):
  pages = normal(40, (6, 8, 2, 16)) * jnp.arange(1, 7, dtype=jnp.float32)[:, None, None, None]
  pages8, descale = te_jax.quantize_kv_pages(pages, granularity=granularity)
  amax = np.abs(np.asarray(pages)).max(axis={"tensor": None, "head": (0, 1, 3), "page": (1, 3)}[granularity])
  np.testing.assert_allclose(np.asarray(descale), amax / 448.0, rtol=1e-6)
  d = np.asarray(descale, np.float64)
  d = d[:, None, :, None] if granularity == "page" else d.reshape(1, 1, -1, 1) if d.ndim else d
  back = np.asarray(pages8.astype(jnp.float32), np.float64) * d
  np.testing.assert_allclose(back, np.asarray(pages), rtol=2.0**-4, atol=float(np.max(d)) * 2.0**-10)
  with pytest.raises(ValueError, match="granularity must be"):
    te_jax.quantize_kv_pages(pages, granularity="token")


def test_fp8_kv_cache_contiguous_decode_against_the_reference():
  q = normal(41, (2, 1, 8, 32), jnp.bfloat16)
  (k8, kd), (v8, vd) = (quantize_fp8(normal(42 + i, (2, 96, 2, 32)), per_head=True) for i in range(2))
  lengths = jnp.asarray([96, 50], jnp.int32)
  out = te_jax.fused_attn(q, k8, v8, mask_type="padding_causal_bottom_right", q_seqlens=jnp.ones(2, jnp.int32),
                          kv_seqlens=lengths, k_descale=kd, v_descale=vd)
  assert out.dtype == jnp.bfloat16
  ref = attention_reference(np.asarray(q, np.float64), values(k8, kd), values(v8, vd),
                            mask_type="padding_causal_bottom_right", q_seqlens=np.ones(2), kv_seqlens=np.asarray(lengths))
  assert_close("out", out, ref["out"], 2.0**-8)
  # q's gradient flows (in q's dtype); the FP8 cache's is refused.
  dq = jax.grad(lambda q: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd).astype(jnp.float32).sum())(q)
  assert dq.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="q_descale goes with an FP8 q"):
    te_jax.fused_attn(q, k8, v8, q_descale=jnp.float32(1), k_descale=kd, v_descale=vd)


def _paged_case(granularity, seed=50, batch=3, page_size=16, max_pages=4, hkv=2, d=32, dtype=jnp.bfloat16):
  num_pages = batch * max_pages + 1
  k_pool, v_pool = normal(seed, (num_pages, page_size, hkv, d)), normal(seed + 1, (num_pages, page_size, hkv, d))
  (k8, kd), (v8, vd) = (te_jax.quantize_kv_pages(p, granularity=granularity) for p in (k_pool, v_pool))
  table = jnp.asarray(np.random.default_rng(seed).permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages),
                      jnp.int32)
  lengths = jnp.asarray([64, 17, 40][:batch], jnp.int32)
  return k8, kd, v8, vd, table, lengths


def _gathered(pages8, descale, table):
  d = np.asarray(descale, np.float64)
  d = d[:, None, :, None] if d.ndim == 2 else d.reshape(1, 1, -1, 1) if d.ndim else d
  pool = np.asarray(pages8.astype(jnp.float32), np.float64) * d
  b, m = table.shape
  return pool[np.asarray(table)].reshape(b, m * pool.shape[1], *pool.shape[2:])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("granularity", ["tensor", "head", "page"])
@pytest.mark.parametrize("sq", [1, 5])
def test_fp8_paged_attention_against_the_reference(granularity, sq, path):
  k8, kd, v8, vd, table, lengths = _paged_case(granularity)
  q = normal(60, (3, sq, 8, 32), jnp.bfloat16)
  with te_jax.custom_call_path(path):
    out, lse = jax.jit(lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd,
                                                        return_lse=True))(q)
  assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  k, v = _gathered(k8, kd, table), _gathered(v8, vd, table)
  ref = attention_reference(np.asarray(q, np.float64), k, v, mask_type="padding_causal_bottom_right",
                            q_seqlens=np.full(3, sq), kv_seqlens=np.asarray(lengths))
  assert_close("out", out, ref["out"], 2.0**-8)
  assert_close("lse", lse, ref["lse"], 1e-5)


def test_fp8_paged_attention_gradient_of_q_and_refusals():
  k8, kd, v8, vd, table, lengths = _paged_case("page")
  q = normal(61, (3, 1, 8, 32), jnp.bfloat16)
  call = lambda q, k=k8, **kw: te_jax.paged_attention(q, k, v8, table, lengths, **{**dict(k_descale=kd, v_descale=vd),
                                                                                    **kw})
  dq = jax.grad(lambda q: call(q).astype(jnp.float32).sum())(q)
  assert dq.dtype == jnp.bfloat16 and np.isfinite(np.asarray(dq, np.float32)).all()
  with pytest.raises(ValueError, match="k is an FP8 operand being differentiated"):
    jax.grad(lambda k: call(q, k).astype(jnp.float32).sum())(k8)
  with pytest.raises(ValueError, match="v_descale missing"):
    call(q, v_descale=None)
  with pytest.raises(ValueError, match=r"k_descale must be float32, a scalar or \[2\] or \[13, 2\]"):
    call(q, k_descale=jnp.ones((13,), jnp.float32))
  with pytest.raises(ValueError, match="go with an FP8 KV cache"):
    te_jax.paged_attention(q, k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), table, lengths, k_descale=kd)
  with pytest.raises(TypeError, match="one FP8 dtype"):
    call(q.astype(jnp.float8_e4m3fn))


@pytest.fixture()
def cuda_lowering(monkeypatch):
  """Lowering for cuda on this machine: the CUDA backend without its GPU-time hook (compiling for the device), its FP8
  KV cache decision taken for the arch `arch(name)` sets (sm_90a by default)."""
  pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA backend")
  import dataclasses
  from te_jax import _backends, _cuda
  arch = ["sm_90a"]
  backend = dataclasses.replace(_backends.backend_for("cuda"), prepare=None,
                                fp8_kv_refusal=lambda params, direction: _cuda.fp8_kv_refusal(params, direction, arch[0]))
  monkeypatch.setitem(_backends._BACKENDS, "cuda", backend)
  def lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  lower.arch = lambda name: arch.__setitem__(0, name)
  return lower


def _custom_calls(text):
  return [line for line in text.splitlines() if "stablehlo.custom_call @te_jax_attention_forward_cuda" in line]


@pytest.mark.parametrize("granularity, descale", [("page", "2x13x2xf32"), ("head", "2x1x2xf32"),
                                                  ("tensor", "2x1x1xf32")])
def test_fp8_paged_decode_lowers_for_cuda_to_the_decode_kernels_over_the_pool(cuda_lowering, granularity, descale):
  """An FP8 KV cache decode (at most 16 query positions) is one custom call on the FP8 pools as they are and the
  [2, blocks, heads] descale operand: the decode kernels read the bytes."""
  k8, kd, v8, vd, table, lengths = _paged_case(granularity)
  fn = lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd)
  calls = _custom_calls(cuda_lowering(fn, normal(62, (3, 16, 8, 32), jnp.bfloat16)))
  assert len(calls) == 1, calls
  assert calls[0].count("tensor<13x16x2x32xf8E4M3FN>") == 2 and f"tensor<{descale}>" in calls[0], calls[0]


def test_fp8_paged_attention_beyond_the_decode_kernels_gathers_in_q_dtype_on_cuda(cuda_lowering):
  """More than 16 query positions: the gathered formulation on CUDA dequantizes the pools to q's dtype (its kernels
  compute in bfloat16/float16), a call in that dtype."""
  k8, kd, v8, vd, table, lengths = _paged_case("head")
  fn = lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd, engine="te")
  calls = _custom_calls(cuda_lowering(fn, normal(62, (3, 20, 8, 32), jnp.bfloat16)))
  assert len(calls) == 1 and "f8E4M3FN" not in calls[0] and "tensor<3x64x2x32xbf16>" in calls[0], calls


def test_fp8_paged_attention_gradient_on_cuda_is_over_the_pages_in_q_dtype(cuda_lowering):
  k8, kd, v8, vd, table, lengths = _paged_case("page")
  loss = lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd,
                                          engine="te").astype(jnp.float32).sum()
  text = cuda_lowering(jax.grad(loss), normal(62, (3, 1, 8, 32), jnp.bfloat16))
  backward = [line for line in text.splitlines() if "custom_call @te_jax_attention_backward_cuda" in line]
  assert len(backward) == 1 and "f8E4M3FN" not in backward[0] and "tensor<3x64x2x32xbf16>" in backward[0], backward


def test_fp8_kv_cache_fused_attn_decode_lowers_for_cuda(cuda_lowering):
  k8, kd = quantize_fp8(normal(70, (2, 80, 2, 64)), dtype=jnp.float8_e5m2, per_head=True)
  v8, vd = quantize_fp8(normal(71, (2, 80, 2, 64)), dtype=jnp.float8_e5m2, per_head=True)
  fn = lambda q: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd, mask_type="causal_bottom_right")
  calls = _custom_calls(cuda_lowering(fn, normal(72, (2, 1, 8, 64), jnp.float16)))
  assert len(calls) == 1 and calls[0].count("tensor<2x80x2x64xf8E5M2>") == 2 and "tensor<2x1x2xf32>" in calls[0]


@pytest.mark.parametrize("case, message", [
    ("queries", "a forward of at most 16 query positions"),
    ("arch", "on sm_89 and newer"),
    ("head_dim", r"multiples of 16 .*\(40, 40\)"),
])
def test_fp8_kv_cache_calls_the_cuda_kernels_do_not_serve_raise_why_and_what_to_do(cuda_lowering, case, message):
  d = 40 if case == "head_dim" else 32
  k8, kd = quantize_fp8(normal(73, (2, 64, 2, d)), per_head=True)
  v8, vd = quantize_fp8(normal(74, (2, 64, 2, d)), per_head=True)
  if case == "arch":
    cuda_lowering.arch("sm_80")
  fn = lambda q: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd, mask_type="causal_bottom_right")
  q = normal(75, (2, 20 if case == "queries" else 1, 8, d), jnp.bfloat16)
  with pytest.raises(ValueError, match=f"this FP8 KV cache call has no cuda kernel: .*{message}.*Dequantize the cache "
                                       r"to q's dtype first \(te_jax.dequantize_fp8"):
    cuda_lowering(fn, q)


def test_fp8_kv_cache_gradient_on_cuda_is_over_the_cache_in_q_dtype(cuda_lowering):
  """fused_attn's backward over an FP8 cache: the cache dequantized to q's dtype on a GPU (float32 on the CPU), one
  backward custom call in that dtype."""
  k8, kd = quantize_fp8(normal(76, (2, 64, 2, 32)), per_head=True)
  fn = jax.grad(lambda q: te_jax.fused_attn(q, k8, k8, k_descale=kd, v_descale=kd).astype(jnp.float32).sum())
  text = cuda_lowering(fn, normal(77, (2, 1, 8, 32), jnp.bfloat16))
  backward = [line for line in text.splitlines() if "custom_call @te_jax_attention_backward_cuda" in line]
  assert len(backward) == 1 and "tensor<2x64x2x32xbf16>" in backward[0], backward


@pytest.mark.parametrize("granularity", ["tensor", "head", "page", None])
def test_append_kv_pages_builds_the_cache_a_serving_loop_reads(granularity):
  """A prefill of 21 tokens, then three decode steps of one, into pages of 8: the cache read back equals the tokens
  written (exactly for a bfloat16 pool; within the format's rounding of each token's scale for FP8), and paged
  attention over it matches the reference over those tokens."""
  batch, page_size, hkv, d, steps = 2, 8, 2, 16, (21, 1, 1, 1)
  total = sum(steps)
  tokens = normal(70, (batch, total, hkv, d)) * jnp.asarray([1.0, 30.0])[None, None, :, None]
  num_pages, max_pages = 9, 4
  table = jnp.asarray([[3, 0, 7, 5], [1, 8, 2, 6]], jnp.int32)
  pool = jnp.full((num_pages, page_size, hkv, d), 7.0, jnp.float32)  # stale contents
  if granularity is None:
    pages, descale = pool.astype(jnp.bfloat16), None
  else:
    pages, descale = te_jax.quantize_kv_pages(pool, granularity=granularity)
    if granularity != "page":  # a static scale that covers the tokens
      descale = jnp.broadcast_to(jnp.float32(200.0 / 448.0), descale.shape)
  position = 0
  for count in steps:
    new = tokens[:, position:position + count]
    pages, descale = jax.jit(te_jax.append_kv_pages)(pages, descale, new, table,
                                                      jnp.full((batch,), position, jnp.int32))
    position += count
  got = _gathered(pages, descale if descale is not None else jnp.float32(1), table)[:, :total]
  want = np.asarray(tokens, np.float64)
  if granularity is None:
    np.testing.assert_array_equal(got, np.asarray(tokens.astype(jnp.bfloat16), np.float64))
  else:
    np.testing.assert_allclose(got, want, rtol=2.0**-3, atol=200.0 / 448.0 * 2.0**-9)  # requantized pages round twice
  if granularity == "page":  # each written page's descale is current scaling over what it holds
    held = np.abs(np.asarray(tokens)).reshape(batch, -1, page_size, hkv, d)  # total = 24 = 3 whole pages
    np.testing.assert_allclose(np.asarray(descale)[np.asarray(table)[:, :3]], held.max(axis=(2, 4)) / 448.0, rtol=1e-6)
  q = normal(71, (batch, 1, 4, d), jnp.float32 if descale is not None else jnp.bfloat16)
  kw = {} if descale is None else dict(k_descale=descale, v_descale=descale)
  out = te_jax.paged_attention(q, pages, pages, table,
                               jnp.full((batch,), total, jnp.int32), **kw)
  ref = attention_reference(np.asarray(q, np.float64), got, got)
  assert_close("out", out, ref["out"], 2.0**-7 if descale is None else 1e-5)


def test_append_kv_pages_leaves_other_pages_and_refuses():
  pages, descale = te_jax.quantize_kv_pages(normal(80, (5, 8, 1, 8)), granularity="page")
  table = jnp.asarray([[2, 9]], jnp.int32)  # its second page id is outside the pool: not written
  new_pages, new_descale = te_jax.append_kv_pages(pages, descale, normal(81, (1, 12, 1, 8)), table,
                                                  jnp.asarray([0], jnp.int32))
  untouched = np.array([0, 1, 3, 4])
  np.testing.assert_array_equal(np.asarray(new_pages.astype(jnp.float32))[untouched],
                                np.asarray(pages.astype(jnp.float32))[untouched])
  np.testing.assert_array_equal(np.asarray(new_descale)[untouched], np.asarray(descale)[untouched])
  with pytest.raises(ValueError, match="an FP8 pool needs its descale"):
    te_jax.append_kv_pages(pages, None, normal(81, (1, 2, 1, 8)), table, jnp.asarray([0], jnp.int32))
  with pytest.raises(ValueError, match="descale goes with an FP8 pool"):
    te_jax.append_kv_pages(pages.astype(jnp.bfloat16), descale, normal(81, (1, 2, 1, 8)), table,
                           jnp.asarray([0], jnp.int32))
  with pytest.raises(ValueError, match="must agree on Hkv and D"):
    te_jax.append_kv_pages(pages, descale, normal(81, (1, 2, 2, 8)), table, jnp.asarray([0], jnp.int32))


def test_nan_in_an_fp8_key_reaches_the_rows_that_see_it():
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(90, 1, 16, 16, 2, 2, 16, 16, E4M3, True)
  k8 = k8.at[0, 5, 1, 3].set(jnp.nan)  # e4m3fn has a NaN; key 5 of kv head 1
  out = te_jax.fused_attn(q8, k8, v8, mask_type="causal", q_descale=qd, k_descale=kd, v_descale=vd)
  nan = np.isnan(np.asarray(out, np.float32))
  assert nan[0, 5:, 1].all() and not nan[0, :5].any() and not nan[0, :, 0].any()  # rows that see it, its head only


def test_drop_in_takes_fp8_operands_as_fused_attn_does():
  (q8, qd), (k8, kd), (v8, vd) = _prequantized(95, 2, 24, 24, 4, 2, 16, 16, E4M3, True)
  descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
  mask = jax.random.bernoulli(jax.random.key(96), 0.8, (2, 1, 24, 24)).at[..., 0].set(True)
  out, residual = te_jax.dot_product_attention(q8, k8, v8, mask=mask, is_causal=True, return_residual=True,
                                               **descales)
  want, lse = te_jax.fused_attn(q8, k8, v8, mask_type="causal", bias=jnp.where(mask, 0.0, -jnp.inf), return_lse=True,
                                **descales)
  assert out.dtype == residual.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(residual), np.asarray(lse.transpose(0, 2, 1).astype(jnp.bfloat16)))
  q = normal(97, (2, 24, 4, 16), jnp.bfloat16)  # an FP8 KV cache: query keeps its dtype
  kv_cache = te_jax.dot_product_attention(q, k8, v8, is_causal=True, k_descale=kd, v_descale=vd)
  np.testing.assert_array_equal(np.asarray(kv_cache), np.asarray(te_jax.fused_attn(q, k8, v8, mask_type="causal",
                                                                                   k_descale=kd, v_descale=vd)))
  trained = te_jax.dot_product_attention(q, q, q, fp8="per_head")
  np.testing.assert_array_equal(np.asarray(trained), np.asarray(te_jax.fused_attn(q, q, q, fp8="per_head")))


def test_training_entry_under_remat_gives_the_same_gradients():
  q, k, v = (normal(100 + i, (1, 20, 2, 16), jnp.bfloat16) for i in range(3))
  loss = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", fp8="per_head").astype(jnp.float32).sum()
  plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  remat = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(plain, remat):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_append_kv_pages_mid_page_write_across_pages_requantizes_each_written_page():
  """A write of 12 tokens starting at slot 5 of a sequence's first page spans three pages: the first keeps its 5
  tokens (requantized with the page's new descale), the other two start fresh; a page of the other sequence and the
  pool's unused pages are untouched."""
  pool = normal(110, (6, 8, 1, 4))
  pages, descale = te_jax.quantize_kv_pages(pool, granularity="page")
  table = jnp.asarray([[4, 1, 3], [0, 5, 2]], jnp.int32)
  new = normal(111, (2, 12, 1, 4)) * 3.0
  positions = jnp.asarray([5, 0], jnp.int32)
  got_pages, got_descale = te_jax.append_kv_pages(pages, descale, new, table, positions)
  old = np.asarray(pages.astype(jnp.float32), np.float64) * np.asarray(descale, np.float64)[:, None, :, None]
  want = old.copy()
  for b in range(2):
    for t in range(12):
      pos = int(positions[b]) + t
      want[int(table[b, pos // 8]), pos % 8] = np.asarray(new[b, t], np.float64)
  written = {4: 8, 1: 8, 3: 1, 0: 8, 5: 4}  # page -> live slots after the write
  for page, live in written.items():
    amax = np.abs(want[page, :live]).max(axis=(0, 2))
    np.testing.assert_allclose(np.asarray(got_descale[page]), amax / 448.0, rtol=1e-6)
  got = np.asarray(got_pages.astype(jnp.float32), np.float64) * np.asarray(got_descale, np.float64)[:, None, :, None]
  for page, live in written.items():
    np.testing.assert_allclose(got[page, :live], want[page, :live], rtol=2.0**-3, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got_pages.astype(jnp.float32))[2], np.asarray(pages.astype(jnp.float32))[2])
  assert float(got_descale[2, 0]) == float(descale[2, 0])
