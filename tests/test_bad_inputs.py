"""Bad arguments raise TypeError/ValueError naming the argument, before anything is lowered.

"Before lowering" is checked by calling fused_attn under jax.eval_shape, which traces but never lowers or compiles:
an error that only the C++ validation (run at lowering time) or the kernel would raise does not show up there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax

B, SQ, SKV, H, HKV, D, DV = 2, 9, 11, 4, 2, 16, 8


def _arr(*shape, dtype=np.float32):
  return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _qkv(dtype=np.float32):
  return _arr(B, SQ, H, D, dtype=dtype), _arr(B, SKV, HKV, D, dtype=dtype), _arr(B, SKV, HKV, DV, dtype=dtype)


def _seqlens(*values, dtype=np.int32):
  return np.asarray(values, dtype)


def _with(q=None, k=None, v=None, **kw):
  dq, dk, dv = _qkv()
  return (dq if q is None else q, dk if k is None else k, dv if v is None else v), kw


BF16 = jnp.bfloat16
PAD = dict(mask_type="padding")

# (id, (args, kwargs), exception, regex the message must match: the argument's name)
BAD = [
    # ranks
    ("q_rank3", _with(q=_arr(B, SQ, H * D)), ValueError, r"\bq must have rank 4"),
    ("k_rank5", _with(k=_arr(B, SKV, HKV, D, 1)), ValueError, r"\bk must have rank 4"),
    ("v_rank2", _with(v=_arr(B, SKV)), ValueError, r"\bv must have rank 4"),
    ("q_not_array", _with(q=[[1.0]]), TypeError, r"\bq must be a JAX or NumPy array"),
    ("v_scalar_float", _with(v=1.0), TypeError, r"\bv must be a JAX or NumPy array"),
    # batch / seq / heads / dims
    ("batch_mismatch_k", _with(k=_arr(B + 1, SKV, HKV, D), v=_arr(B + 1, SKV, HKV, DV)), ValueError, r"batch"),
    ("batch_mismatch_q", _with(q=_arr(B + 1, SQ, H, D)), ValueError, r"batch"),
    ("seq_mismatch_k_v", _with(v=_arr(B, SKV + 1, HKV, DV)), ValueError, r"\bk and v must agree"),
    ("heads_mismatch_k_v", _with(v=_arr(B, SKV, HKV * 2, DV)), ValueError, r"\bk and v must agree"),
    ("h_not_multiple_of_hkv", _with(k=_arr(B, SKV, 3, D), v=_arr(B, SKV, 3, DV)), ValueError,
     r"number of q heads \(4\).*k/v heads \(3\)"),
    ("hkv_greater_than_h", _with(k=_arr(B, SKV, 8, D), v=_arr(B, SKV, 8, DV)), ValueError, r"q heads"),
    ("zero_kv_heads", _with(k=_arr(B, SKV, 0, D), v=_arr(B, SKV, 0, DV)), ValueError, r"k/v heads"),
    ("d_mismatch_q_k", _with(k=_arr(B, SKV, HKV, D + 8)), ValueError, r"\bq and k must have the same head dim"),
    ("d_not_multiple_of_8", _with(q=_arr(B, SQ, H, 12), k=_arr(B, SKV, HKV, 12)), ValueError, r"head dim D"),
    ("d_zero", _with(q=_arr(B, SQ, H, 0), k=_arr(B, SKV, HKV, 0)), ValueError, r"head dim D"),
    ("d_over_256", _with(q=_arr(B, 2, H, 264), k=_arr(B, 2, HKV, 264), v=_arr(B, 2, HKV, 8)), ValueError,
     r"head dim D.*264"),
    ("dv_not_multiple_of_8", _with(v=_arr(B, SKV, HKV, 20)), ValueError, r"head dim Dv of v"),
    ("dv_over_256", _with(v=_arr(B, SKV, HKV, 512)), ValueError, r"head dim Dv of v"),
    # dtypes
    ("mixed_dtypes_k", _with(k=_arr(B, SKV, HKV, D).astype(BF16)), TypeError, r"\bq, k and v must share one dtype"),
    ("mixed_dtypes_v", _with(v=_arr(B, SKV, HKV, DV).astype(np.float16)), TypeError, r"must share one dtype"),
    ("int_q", _with(q=np.ones((B, SQ, H, D), np.int32)), TypeError, r"\bq must be float32, bfloat16 or float16"),
    ("int_qkv", ((np.ones((B, SQ, H, D), np.int8), np.ones((B, SKV, HKV, D), np.int8),
                  np.ones((B, SKV, HKV, DV), np.int8)), {}), TypeError, r"\bq must be float32"),
    ("float64_k", _with(k=_arr(B, SKV, HKV, D, dtype=np.float64)), TypeError, r"\bk must be float32"),
    ("bool_v", _with(v=np.ones((B, SKV, HKV, DV), bool)), TypeError, r"\bv must be float32"),
    # mask_type
    ("mask_unknown", _with(mask_type="causal_top_left"), ValueError, r"mask_type must be one of.*'causal_top_left'"),
    ("mask_empty", _with(mask_type=""), ValueError, r"mask_type must be one of"),
    ("mask_int", _with(mask_type=1), ValueError, r"mask_type"),
    ("mask_none", _with(mask_type=None), ValueError, r"mask_type"),
    # seqlens presence
    ("padding_without_q_seqlens", _with(kv_seqlens=_seqlens(1, 2), **PAD), ValueError, r"requires q_seqlens"),
    ("padding_without_kv_seqlens", _with(q_seqlens=_seqlens(1, 2), **PAD), ValueError, r"requires kv_seqlens"),
    ("padding_causal_without_any", _with(mask_type="padding_causal"), ValueError, r"requires q_seqlens"),
    ("q_seqlens_without_padding", _with(q_seqlens=_seqlens(1, 2)), ValueError, r"q_seqlens is only accepted"),
    ("kv_seqlens_with_causal", _with(kv_seqlens=_seqlens(1, 2), mask_type="causal"), ValueError,
     r"kv_seqlens is only accepted"),
    # seqlens shape / dtype / values
    ("q_seqlens_wrong_len", _with(q_seqlens=_seqlens(1, 2, 3), kv_seqlens=_seqlens(1, 2), **PAD), ValueError,
     r"q_seqlens must have shape \[B\]"),
    ("kv_seqlens_2d", _with(q_seqlens=_seqlens(1, 2), kv_seqlens=_seqlens([1], [2]), **PAD), ValueError,
     r"kv_seqlens must have shape"),
    ("q_seqlens_scalar", _with(q_seqlens=np.int32(3), kv_seqlens=_seqlens(1, 2), **PAD), ValueError,
     r"q_seqlens must have shape"),
    ("q_seqlens_float", _with(q_seqlens=_seqlens(1.0, 2.0, dtype=np.float32), kv_seqlens=_seqlens(1, 2), **PAD),
     TypeError, r"q_seqlens must be an integer array"),
    ("kv_seqlens_bool", _with(q_seqlens=_seqlens(1, 2), kv_seqlens=_seqlens(True, False, dtype=bool), **PAD),
     TypeError, r"kv_seqlens must be an integer array"),
    ("q_seqlens_float_list", _with(q_seqlens=[1.0, 2.0], kv_seqlens=_seqlens(1, 2), **PAD), TypeError,
     r"q_seqlens must be an integer array"),
    ("kv_seqlens_list_too_long", _with(q_seqlens=_seqlens(1, 2), kv_seqlens=[1, 12], **PAD), ValueError,
     r"kv_seqlens values must lie in"),
    ("q_seqlens_str", _with(q_seqlens="12", kv_seqlens=_seqlens(1, 2), **PAD), TypeError, r"q_seqlens"),
    ("q_seqlens_negative", _with(q_seqlens=_seqlens(-1, 2), kv_seqlens=_seqlens(1, 2), **PAD), ValueError,
     r"q_seqlens values must lie in \[0, 9\]"),
    ("q_seqlens_too_long", _with(q_seqlens=_seqlens(SQ + 1, 2), kv_seqlens=_seqlens(1, 2), **PAD), ValueError,
     r"q_seqlens values must lie in"),
    ("kv_seqlens_too_long", _with(q_seqlens=_seqlens(1, 2), kv_seqlens=_seqlens(1, SKV + 1), **PAD), ValueError,
     r"kv_seqlens values must lie in \[0, 11\]"),
    ("kv_seqlens_int64_huge", _with(q_seqlens=_seqlens(1, 2), kv_seqlens=_seqlens(1, 2**33, dtype=np.int64), **PAD),
     ValueError, r"kv_seqlens values must lie in"),
    # window_size
    ("window_minus2", _with(window_size=(-2, 0)), ValueError, r"window_size left must be -1"),
    ("window_right_minus5", _with(window_size=(3, -5)), ValueError, r"window_size right must be -1"),
    ("window_float", _with(window_size=(1.5, 2)), TypeError, r"window_size left must be an int"),
    ("window_bool", _with(window_size=(True, 2)), TypeError, r"window_size left must be an int"),
    ("window_str", _with(window_size=(0, "2")), TypeError, r"window_size right must be an int"),
    ("window_len3", _with(window_size=(1, 2, 3)), TypeError, r"window_size must be a pair"),
    ("window_len1", _with(window_size=(1,)), TypeError, r"window_size must be a pair"),
    ("window_int", _with(window_size=4), TypeError, r"window_size must be a pair"),
    ("window_none", _with(window_size=None), TypeError, r"window_size must be a pair"),
    # Past the kernels' 32-bit range (a 2**63 window used to die in lowering with std::bad_cast).
    ("window_2_63", _with(window_size=(2**63, 0)), ValueError, r"window_size left must be -1 \(unbounded\) or in \[0, 2147483647\]"),
    ("window_2_31", _with(window_size=(0, 2**31)), ValueError, r"window_size right must be -1 \(unbounded\) or in"),
    # engine
    ("engine_unknown", _with(engine="fastest"), ValueError, r"engine must be one of 'auto', 'te', 'cudnn', got 'fastest'"),
    ("engine_not_str", _with(engine=1), ValueError, r"engine must be one of"),
    # scale
    ("scale_zero", _with(scale=0.0), ValueError, r"scale must be a finite positive number"),
    ("scale_negative", _with(scale=-0.5), ValueError, r"scale must be a finite positive"),
    ("scale_nan", _with(scale=float("nan")), ValueError, r"scale must be a finite positive"),
    ("scale_inf", _with(scale=float("inf")), ValueError, r"scale must be a finite positive"),
    ("scale_bool", _with(scale=True), TypeError, r"scale must be a Python float"),
    ("scale_str", _with(scale="0.1"), TypeError, r"scale must be"),
    ("scale_array", _with(scale=np.ones(2)), TypeError, r"scale must be"),
    # softcap
    ("softcap_negative", _with(softcap=-1.0), ValueError, r"softcap must be 0 \(off\) or a positive number"),
    ("softcap_inf", _with(softcap=float("inf")), ValueError, r"softcap must be 0 \(off\) or a positive number"),
    ("softcap_nan", _with(softcap=float("nan")), ValueError, r"softcap must be 0 \(off\) or a positive number"),
    ("softcap_none", _with(softcap=None), TypeError, r"softcap must be"),
    ("softcap_bool", _with(softcap=False), TypeError, r"softcap must be"),
    # alibi
    ("alibi_wrong_h", _with(alibi_slopes=_arr(H + 1)), ValueError, r"alibi_slopes must have shape \[H\]"),
    ("alibi_hkv", _with(alibi_slopes=_arr(HKV)), ValueError, r"alibi_slopes must have shape"),
    ("alibi_h_b", _with(alibi_slopes=_arr(H, B)), ValueError, r"alibi_slopes must have shape"),
    ("alibi_3d", _with(alibi_slopes=_arr(B, H, 1)), ValueError, r"alibi_slopes must have shape"),
    ("alibi_int", _with(alibi_slopes=np.ones(H, np.int32)), TypeError, r"alibi_slopes must be a float array"),
    ("alibi_int_list", _with(alibi_slopes=[1] * H), TypeError, r"alibi_slopes must be a float array"),
    ("alibi_list_wrong_len", _with(alibi_slopes=[0.1] * (H - 1)), ValueError, r"alibi_slopes must have shape"),
    ("alibi_dict", _with(alibi_slopes={"h": 1.0}), TypeError, r"alibi_slopes"),
    # return_lse
    ("return_lse_int", _with(return_lse=1), TypeError, r"return_lse must be a bool"),
    ("return_lse_str", _with(return_lse="yes"), TypeError, r"return_lse must be a bool"),
    ("return_lse_none", _with(return_lse=None), TypeError, r"return_lse must be a bool"),
    # deterministic
    ("deterministic_int", _with(deterministic=1), TypeError, r"deterministic must be a bool"),
    ("deterministic_str", _with(deterministic="true"), TypeError, r"deterministic must be a bool"),
    ("deterministic_none", _with(deterministic=None), TypeError, r"deterministic must be a bool"),
    # bias: rank 4, each dim full or 1, a float dtype
    ("bias_rank_3", _with(bias=_arr(H, SQ, SKV)), ValueError, r"bias must have rank 4, \[B or 1, H or 1, Sq or 1"),
    ("bias_rank_5", _with(bias=_arr(1, B, H, SQ, SKV)), ValueError, r"bias must have rank 4"),
    ("bias_kv_heads", _with(bias=_arr(B, HKV, SQ, SKV)), ValueError,
     r"bias must have shape \[B or 1, H or 1, Sq or 1, Skv or 1\] = \[2 or 1, 4 or 1, 9 or 1, 11 or 1\]"),
    ("bias_swapped", _with(bias=_arr(1, 1, SKV, SQ)), ValueError, r"each dim full or 1"),
    ("bias_int", _with(bias=np.zeros((1, 1, 1, SKV), np.int32)), TypeError,
     r"bias must be float32, bfloat16 or float16, got int32"),
    ("bias_float64", _with(bias=np.zeros((1, 1, 1, SKV), np.float64)), TypeError, r"bias must be float32"),
    ("bias_list", _with(bias=[[[[0.0]]]]), TypeError, r"bias must be a JAX or NumPy array"),
]


@pytest.mark.parametrize("args_kwargs,exc,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_argument_raises_before_lowering(args_kwargs, exc, match):
  args, kwargs = args_kwargs
  # Tracing only: jax.eval_shape never lowers, so only the Python argument checks can raise here.
  with pytest.raises(exc, match=match):
    jax.eval_shape(lambda: te_jax.fused_attn(*args, **kwargs))
  # And the eager call raises the same error (not some later one from the C++ validation or the kernel).
  with pytest.raises(exc, match=match):
    te_jax.fused_attn(*args, **kwargs)


@pytest.mark.parametrize("args_kwargs", [b[1] for b in BAD if b[0].startswith(("q_seqlens_too", "kv_seqlens_too"))])
def test_concrete_seqlens_checked_under_jit_too(args_kwargs):
  """Seqlens closed over by a jitted function are concrete, so Python still checks them at trace time."""
  args, kwargs = args_kwargs
  q_seqlens, kv_seqlens = (jnp.asarray(kwargs[n]) for n in ("q_seqlens", "kv_seqlens"))
  kw = dict(kwargs, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens)
  with pytest.raises(ValueError, match=r"seqlens values must lie in"):
    jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, **kw)).lower(*args)


# Each accepted variant of the arguments, to show the checks are not simply refusing everything.
GOOD = [
    ("mask_enum", dict(mask_type=te_jax.MaskType.CAUSAL_BOTTOM_RIGHT)),
    ("mask_upper_case", dict(mask_type="CAUSAL")),
    ("window_numpy_ints", dict(window_size=(np.int64(2), np.int32(-1)))),
    ("window_list", dict(window_size=[0, 0])),
    ("scale_int", dict(scale=2)),
    ("scale_numpy", dict(scale=np.float32(0.25))),
    ("softcap_int", dict(softcap=3)),
    ("alibi_bh", dict(alibi_slopes=_arr(B, H))),
    ("alibi_list", dict(alibi_slopes=[0.1] * H)),
    ("seqlens_lists", dict(mask_type="padding", q_seqlens=[1, 2], kv_seqlens=(3, 4))),
    ("alibi_h_bf16", dict(alibi_slopes=_arr(H).astype(BF16))),
    ("return_lse_numpy_bool", dict(return_lse=np.bool_(True))),
    ("deterministic_numpy_bool", dict(deterministic=np.bool_(True))),
    ("bias_full", dict(bias=_arr(B, H, SQ, SKV))),
    ("bias_key_mask_bf16", dict(bias=_arr(B, 1, 1, SKV).astype(BF16))),
    ("bias_scalar_like", dict(bias=_arr(1, 1, 1, 1).astype(np.float16))),
    ("padding_edges", dict(mask_type="padding", q_seqlens=_seqlens(0, SQ), kv_seqlens=_seqlens(SKV, 0))),
    ("padding_uint8", dict(mask_type="padding", q_seqlens=_seqlens(1, 2, dtype=np.uint8),
                           kv_seqlens=_seqlens(3, 4, dtype=np.int64))),
]


@pytest.mark.parametrize("kwargs", [g[1] for g in GOOD], ids=[g[0] for g in GOOD])
def test_valid_argument_variants_are_accepted(kwargs):
  q, k, v = _qkv()
  result = jax.eval_shape(lambda: te_jax.fused_attn(q, k, v, **kwargs))
  outs = result if isinstance(result, tuple) else (result,)
  assert outs[0].shape == (B, SQ, H, DV) and outs[0].dtype == jnp.float32
  if kwargs.get("return_lse"):
    assert isinstance(result, tuple) and outs[1].shape == (B, H, SQ) and outs[1].dtype == jnp.float32


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16], ids=["f32", "bf16", "f16"])
def test_output_dtypes(dtype):
  q, k, v = _qkv(dtype)
  out, lse = jax.eval_shape(lambda: te_jax.fused_attn(q, k, v, return_lse=True))
  assert out.dtype == np.dtype(dtype) and lse.dtype == jnp.float32


# Values that pass as Python floats but are not representable as the float32 the kernels receive.
@pytest.mark.parametrize("kwargs,match", [
    (dict(scale=1e39), r"scale"),
    (dict(scale=1e-50), r"scale"),
    (dict(softcap=1e39), r"softcap"),
], ids=["scale_f32_overflow", "scale_f32_underflow", "softcap_f32_overflow"])
def test_float32_unrepresentable_scale_softcap_refused_before_lowering(kwargs, match):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda: te_jax.fused_attn(q, k, v, **kwargs))


@pytest.mark.parametrize("kwargs", [dict(scale=1e39), dict(scale=1e-50), dict(softcap=1e39)],
                         ids=["scale_f32_overflow", "scale_f32_underflow", "softcap_f32_overflow"])
def test_float32_unrepresentable_scale_softcap_refused_at_lowering(kwargs):
  """Whatever the Python check does, the C++ validation refuses these at lowering time with a ValueError."""
  q, k, v = _qkv()
  name = next(iter(kwargs))
  with pytest.raises(ValueError, match=re.escape(name)):
    jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, **kwargs)).lower(q, k, v)


@pytest.mark.parametrize("dtype,value", [(np.int64, 2**32 + 5), (np.uint32, 2**32 - 1), (np.int64, -(2**32) + 3)],
                         ids=["int64_wraps_to_5", "uint32_reads_as_minus_1", "int64_negative_wraps_to_3"])
def test_traced_seqlens_convert_saturating(dtype, value):
  """A traced length of a wider or unsigned integer type is clamped to int32, never wrapped: it stays out of range
  and the run-time check names the saturated value (2147483647 or -2147483648), not a wrapped one that looks valid."""
  q, k, v = _qkv()
  batch = q.shape[0]
  f = jax.jit(lambda q, k, v, lengths: te_jax.fused_attn(q, k, v, mask_type="padding", q_seqlens=lengths,
                                                           kv_seqlens=lengths))
  with jax.enable_x64(True):
    lengths = jnp.asarray([value] + [1] * (batch - 1), dtype)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"q_seqlens\[0\] = (2147483647|-2147483648) is outside"):
      jax.block_until_ready(f(q, k, v, lengths))


@pytest.mark.parametrize("value,engine", [("te", "te"), ("auto", "te")])
def test_engine_environment_variable(monkeypatch, value, engine):
  """$TE_JAX_ENGINE is the default of fused_attn's engine; on the CPU "auto" resolves to te_jax's kernels, named in
  the custom call."""
  monkeypatch.setenv("TE_JAX_ENGINE", value)
  q, k, v = _qkv()
  text = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v)).lower(q, k, v).as_text()
  assert f"engine = {['te', 'cudnn'].index(engine)} : i64" in text


def test_engine_environment_variable_checked(monkeypatch):
  monkeypatch.setenv("TE_JAX_ENGINE", "gpu")
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"TE_JAX_ENGINE must be one of auto, te, cudnn, got 'gpu'"):
    te_jax.fused_attn(q, k, v)


def test_engine_cudnn_on_cpu_raises_at_lowering():
  """The platform is known when the call is lowered: an explicit engine it lacks raises then, saying why, and nothing
  falls back to another engine."""
  q, k, v = _qkv()
  with pytest.raises(te_jax.EngineUnavailableError, match=r"engine='cudnn' needs an NVIDIA GPU"):
    jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, engine="cudnn")).lower(q, k, v)


def test_gpu_lowering_without_the_cuda_backend_names_the_cause():
  """A te_jax built without CUDA headers (no _te_jax_cuda; simulated in a subprocess) refuses to lower for a GPU with
  a RuntimeError that says why, where JAX would only say that no lowering rule exists."""
  script = textwrap.dedent("""
      import sys
      sys.modules["te_jax._te_jax_cuda"] = None  # as if it had not been built
      import jax, jax.numpy as jnp, te_jax
      q = jnp.ones((1, 8, 2, 16))
      assert te_jax.fused_attn(q, q, q).shape == q.shape  # the CPU backend is unaffected
      jax.jit(lambda q: te_jax.fused_attn(q, q, q)).trace(q).lower(lowering_platforms=("cuda",))
  """)
  proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode != 0
  assert "RuntimeError: te_jax was installed without its CUDA backend: no cuda.h was found" in proc.stderr, \
      proc.stderr[-2000:]
