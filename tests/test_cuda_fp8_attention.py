"""GPU tests of FP8 attention in the sm90 forward's FP8 kernel (kernels/sm90/attention_fwd.cuh with an E4M3/E5M2
Input): out and lse of te_jax.fused_attn on pre-quantized q, k and v against the float64 reference over the
dequantized values. The kernel's products are exact on those values but for p, which it rounds to e4m3 (3 mantissa
bits) before p v, so out carries that rounding (averaged over the keys) and lse (from float p) does not. Cases: e4m3
and e5m2, descales per tensor and per head, GQA, causal (both diagonals), a window and padding lengths, soft-cap, ALiBi,
sinks, 1 to 300 query positions, key counts that end inside a tile, a NaN in one key (only the rows that see it), and
the calls the kernel does not serve (clear errors). Skipped without a GPU, and (with its reason) where the sm90 family
does not run (before Hopper). The kernel is reached through TE_JAX_CUDA_FP8_ATTENTION=1 (te_jax/fp8.py) until these
tests have passed on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from test_cuda_attention import _rel  # noqa: E402  (skips this module where that one skips: no GPU or CUDA backend)

import te_jax  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
# Relative Frobenius error of out against the float64 reference: p rounded to e4m3 (relative steps of 2^-3, so about
# 2^-5 on each p) averages over a row's keys; out rounded to bfloat16. lse comes from float p.
TOL = dict(out=3e-2, lse=1e-3)


@pytest.fixture(scope="module", autouse=True)
def _fp8_kernel_enabled():
  """The FP8 kernel's opt-in, and a skip (naming why) where the GPU is no Hopper."""
  mp = pytest.MonkeyPatch()
  mp.setenv("TE_JAX_CUDA_FP8_ATTENTION", "1")
  if not jax.devices()[0].device_kind.startswith(("NVIDIA H100", "NVIDIA H200", "NVIDIA GH200", "NVIDIA H800")):
    mp.undo()
    pytest.skip(f"FP8 attention runs in the sm90 family (Hopper); this GPU is {jax.devices()[0].device_kind}")
  yield
  mp.undo()


def _operands(rng, *, b, sq, skv, h, hkv, fmt, per_head, nan_key=None):
  """Pre-quantized q, k, v (te_jax.quantize_fp8) and their float64 dequantized values."""
  q, k, v = (rng.standard_normal((b, s, n, 128)).astype(np.float32) for s, n in ((sq, h), (skv, hkv), (skv, hkv)))
  q *= rng.uniform(0.5, 3.0, (1, 1, h, 1))  # heads of different magnitudes: per-head descales differ
  out = []
  for x in (q, k, v):
    x8, descale = te_jax.quantize_fp8(jnp.asarray(x), dtype=FORMATS[fmt], per_head=per_head)
    out.append((x8, descale))
  (q8, qd), (k8, kd), (v8, vd) = out
  if nan_key is not None:  # v of one key of batch entry 0, K/V head 0, every dim
    v8 = v8.at[0, nan_key, 0, :].set(jnp.asarray(np.nan, v8.dtype))
  dequantized = [np.asarray(te_jax.dequantize_fp8(x8, d, jnp.float32), np.float64)
                 for x8, d in ((q8, qd), (k8, kd), (v8, vd))]
  return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd), dequantized


CASES = [
    # (id, fmt, per_head, b, sq, skv, h, hkv, options)
    ("e4m3_tensor_causal", "e4m3", False, 2, 256, 256, 4, 4, dict(mask_type="causal")),
    ("e4m3_head_gqa_nomask", "e4m3", True, 1, 300, 320, 8, 2, dict()),
    ("e5m2_head_bottom_right", "e5m2", True, 2, 96, 400, 4, 2, dict(mask_type="causal_bottom_right")),
    ("e4m3_decode_one_query", "e4m3", True, 3, 1, 1024, 8, 2, dict(mask_type="causal_bottom_right")),
    ("e4m3_window", "e4m3", False, 1, 384, 384, 4, 1, dict(mask_type="causal", window_size=(100, 0))),
    ("e4m3_softcap", "e4m3", True, 1, 200, 208, 4, 2, dict(softcap=20.0)),
    ("e4m3_alibi", "e4m3", True, 1, 256, 256, 4, 2, dict(mask_type="causal", alibi=True)),
    ("e4m3_padding", "e4m3", True, 2, 160, 176, 4, 2, dict(mask_type="padding", lengths=True)),
    ("e4m3_sinks", "e4m3", False, 1, 128, 128, 4, 4, dict(sinks=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp8_attention_against_the_reference_over_dequantized_values(case):
  _, fmt, per_head, b, sq, skv, h, hkv, options = case
  rng = np.random.default_rng(CASES.index(case))
  (q8, k8, v8), descales, (q, k, v) = _operands(rng, b=b, sq=sq, skv=skv, h=h, hkv=hkv, fmt=fmt, per_head=per_head)
  kwargs, ref_kwargs = {}, {}
  for name in ("mask_type", "window_size", "softcap"):
    if name in options:
      kwargs[name] = ref_kwargs[name] = options[name]
  if options.get("alibi"):
    slopes = jnp.asarray(2.0 ** -np.arange(1, h + 1), jnp.float32)
    kwargs["alibi_slopes"] = slopes
    ref_kwargs["alibi_slopes"] = np.asarray(slopes, np.float64)
  if options.get("lengths"):
    q_len = rng.integers(1, sq + 1, b).astype(np.int32)
    kv_len = rng.integers(1, skv + 1, b).astype(np.int32)
    kwargs.update(q_seqlens=jnp.asarray(q_len), kv_seqlens=jnp.asarray(kv_len))
    ref_kwargs.update(q_seqlens=q_len, kv_seqlens=kv_len)
  if options.get("sinks"):
    sinks = rng.standard_normal(h).astype(np.float32)
    kwargs["sink_logits"] = jnp.asarray(sinks)
    ref_kwargs["sink_logits"] = sinks.astype(np.float64)
  out, lse = te_jax.fused_attn(q8, k8, v8, **descales, return_lse=True, engine="te", **kwargs)
  assert out.dtype == jnp.bfloat16
  ref = attention_reference(q, k, v, **ref_kwargs)
  valid = np.isfinite(ref["lse"])
  assert _rel(np.where(valid[..., None].transpose(0, 2, 1, 3), out, 0), ref["out"]) < TOL["out"]
  assert _rel(np.where(valid, lse, 0), np.where(valid, ref["lse"], 0)) < TOL["lse"]


def test_a_nan_value_reaches_only_the_rows_that_see_its_key():
  rng = np.random.default_rng(5)
  (q8, k8, v8), descales, (q, k, v) = _operands(rng, b=1, sq=256, skv=256, h=2, hkv=1, fmt="e4m3", per_head=True,
                                                nan_key=150)
  out = np.asarray(te_jax.fused_attn(q8, k8, v8, **descales, mask_type="causal", engine="te"), np.float64)
  assert np.isnan(out[0, 150:]).all() and not np.isnan(out[0, :150]).any()
  ref = attention_reference(q, k, v, mask_type="causal")["out"]
  assert _rel(out[0, :150], ref[0, :150]) < TOL["out"]


@pytest.mark.parametrize("change, message", [
    (dict(d=64), r"head dims \(128, 128\) so far, not \(64, 64\)"),
    (dict(skv=100), "a multiple of 16 keys"),
])
def test_calls_the_kernel_does_not_serve_are_refused(change, message):
  d, skv = change.get("d", 128), change.get("skv", 128)
  x8 = lambda s: jnp.zeros((1, s, 2, d), jnp.float8_e4m3fn)  # noqa: E731
  one = jnp.float32(1.0)
  with pytest.raises(ValueError, match=message):
    te_jax.fused_attn(x8(64), x8(skv), x8(skv), q_descale=one, k_descale=one, v_descale=one, engine="te")
