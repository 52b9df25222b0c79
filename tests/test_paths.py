"""The two custom-call paths: selection (context manager, environment variable), what the lowered HLO shows, jit
caching per path, bitwise equality of results, and the run-time check of traced seqlens on each path."""

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
# A plain import: a core extension that fails to import must fail the run, not skip these tests.
from te_jax import _te_jax_cpu as te_jax_cpu
from te_jax.legacy_failures import LegacyCustomCallError
from helpers import Case, assert_bitwise_equal, make_inputs, run_on_path


def _small(dtype=jnp.float32, seed=0, b=2, sq=13, skv=21, h=4, hkv=2, d=16, dv=8):
  rng = np.random.default_rng(seed)
  arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return arr(b, sq, h, d), arr(b, skv, hkv, d), arr(b, skv, hkv, dv)


def _custom_calls(lowered):
  """The stablehlo.custom_call ops of a lowered module."""
  found = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for inner in block.operations:
          if inner.name == "stablehlo.custom_call":
            found.append(inner)
          walk(inner.operation)

  walk(lowered.compiler_ir("stablehlo").operation)
  return found


KW = dict(mask_type="padding_causal_bottom_right", window_size=(3, 1), scale=0.25, softcap=4.0)


def _loss_fn(**kw):
  def loss(q, k, v, alibi, q_seqlens, kv_seqlens):
    out, lse = te_jax.fused_attn(q, k, v, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens, alibi_slopes=alibi,
                                 return_lse=True, **kw)
    return out.astype(jnp.float32).sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _loss_args():
  q, k, v = _small()
  return q, k, v, jnp.linspace(0.1, 0.4, 4), jnp.array([13, 5], jnp.int32), jnp.array([21, 0], jnp.int32)


@pytest.mark.skipif(os.environ.get("TE_JAX_CUSTOM_CALL", "ffi") != "ffi", reason="TE_JAX_CUSTOM_CALL is set")
def test_default_path_is_ffi():
  assert te_jax.current_custom_call_path() == "ffi"


def test_context_manager_nests_and_restores():
  initial = te_jax.current_custom_call_path()
  with te_jax.custom_call_path("legacy"):
    assert te_jax.current_custom_call_path() == "legacy"
    with te_jax.custom_call_path("ffi"):
      assert te_jax.current_custom_call_path() == "ffi"
    assert te_jax.current_custom_call_path() == "legacy"
  assert te_jax.current_custom_call_path() == initial
  with pytest.raises(RuntimeError, match="boom"):
    with te_jax.custom_call_path("legacy"):
      raise RuntimeError("boom")
  assert te_jax.current_custom_call_path() == initial


@pytest.mark.parametrize("bad", ["bogus", "FFI", "", None, 3])
def test_unknown_path_raises_naming_allowed_values(bad):
  initial = te_jax.current_custom_call_path()
  with pytest.raises(ValueError, match=r"custom_call_path must be one of 'ffi', 'legacy'"):
    with te_jax.custom_call_path(bad):
      pass
  assert te_jax.current_custom_call_path() == initial


def test_ffi_hlo():
  lowered = _loss_fn(**KW).lower(*_loss_args())
  calls = _custom_calls(lowered)
  targets = sorted(str(c.attributes["call_target_name"]).strip('"') for c in calls)
  assert targets == ["te_jax_attention_backward_cpu_ffi", "te_jax_attention_forward_cpu_ffi"]
  text = lowered.as_text()
  assert "TEJD" not in text and "_legacy" not in text
  # Typed attributes, one per option, in the mhlo.backend_config dictionary.
  assert text.count("mhlo.backend_config = {deterministic = false, dropout_threshold = 0 : i64, engine = 0 : i64, "
                    "flex_batch_fold = 1 : i64, flex_block_kv = 0 : i64, flex_block_q = 0 : i64, "
                    "has_alibi = true, has_bias = false, has_positions = false, "
                    "has_segment_ids = false, has_sinks = false, mask_mod_library = \"\", "
                    "mask_type = 5 : i64, page_size = 0 : i64, scale = 2.500000e-01 : f32, "
                    "score_mod_captures = 0 : i64, score_mod_gradients = 0 : i64, score_mod_library = \"\", "
                    "softcap = 4.000000e+00 : f32, window_left = 3 : i64, window_right = 1 : i64}") == 2
  # Operands: forward q, k, v, q_seqlens, kv_seqlens, alibi_slopes (float32 [B, H] here), then the placeholders of
  # sinks, the four token operands (q/kv segment ids, q/kv positions), the page table, kv_descale, the bias and the
  # dropout operand; backward adds out, lse, dout, dlse.
  operand_counts = sorted(len(c.operands) for c in calls)
  assert operand_counts == [15, 19]
  forward = next(c for c in calls if "forward" in str(c.attributes["call_target_name"]))
  assert [str(o.type) for o in forward.operands[5:]] == ["tensor<2x4xf32>", "tensor<1x1xf32>"] + [
      "tensor<1x1xi32>"] * 5 + ["tensor<1x1x1xf32>", "tensor<1x1x1x1xf32>", "tensor<1xui32>"]
  hlo = lowered.as_text(dialect="hlo")
  assert hlo.count("api_version=API_VERSION_TYPED_FFI") == 2  # = 4 in xla::CustomCallApiVersion
  assert "API_VERSION_STATUS_RETURNING" not in hlo


@pytest.mark.parametrize("path", ["ffi", "legacy"])
def test_absent_operands_cost_no_kernels(path):
  """A call's placeholders and default lengths are literal constants in the compiled program: nothing but the custom
  call runs (zeros of the full shape were broadcast kernels, 3-7 us per call on an H200)."""
  q, k, v = _small()
  call = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal"))
  with te_jax.custom_call_path(path):
    hlo = call.lower(q, k, v).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  ops = re.findall(r"^\s*(?:ROOT )?%\S+ = (?:\([^=]*?\)|\S+) ([\w-]+)\(", entry, re.MULTILINE)
  assert ops.count("custom-call") == 1
  assert set(ops) <= {"parameter", "constant", "custom-call", "get-tuple-element", "tuple"}, sorted(set(ops))


def test_vmap_keeps_placeholders_unbatched():
  """Under vmap (the mapped axis folded into the batch) the absent operands stay one-element placeholders, and the
  lengths of a call without a padding mask stay absent: nothing of the full batch is materialised for them."""
  q, k, v = _small()
  mapped = jax.vmap(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal"))
  jaxpr = jax.make_jaxpr(mapped)(*(jnp.stack([x, x]) for x in (q, k, v)))

  def te_jax_calls(jaxpr):  # through the custom_vjp's and the partitioning's inner jaxprs
    for e in jaxpr.eqns:
      if e.primitive.name.startswith("te_jax"):
        yield e
      for p in e.params.values():
        inner = getattr(p, "jaxpr", p)
        if hasattr(inner, "eqns"):
          yield from te_jax_calls(inner)
  calls = list(te_jax_calls(jaxpr.jaxpr))
  assert len(calls) == 1
  shapes = [tuple(x.aval.shape) for x in calls[0].invars]
  assert shapes[0] == (4,) + q.shape[1:]  # the two mapped examples folded into the batch
  # lengths ... page table; kv_descale; dropout
  assert shapes[3:12] == [(1,), (1,)] + [(1, 1)] * 7 and shapes[12] == (1, 1, 1) and shapes[14] == (1,)


@pytest.mark.parametrize("operand, shape, match", [
    (3, (3,), r"q_seqlens has shape \[3\], expected \[2\]"),  # neither the placeholder [1] nor [B]
    (5, (2, 3), r"alibi_slopes has shape \[2, 3\], expected \[2, 4\]"),
    (8, (2, 13), r"kv_segment_ids has shape \[2, 13\], expected \[2, 21\]"),  # q's length on the kv side
    (12, (2, 1, 1), r"kv_descale must be float32 \[2, blocks, heads\] with an FP8 KV cache .*, else the float32 "
                    r"\[1, 1, 1\] placeholder"),
    (14, (6, 1), r"dropout has shape \[6, 1\], expected \[6\]"),
])
def test_ffi_handler_names_an_unread_operand_of_the_wrong_shape(operand, shape, match):
  """An operand the call does not read must be its placeholder (its rank, every dim 1) or its full shape; anything
  else is an error naming it, before any kernel runs (a causal call reads no lengths, no slopes, no ids)."""
  from te_jax import _primitives
  from te_jax.attention_config import AttentionConfig
  from te_jax.mask_type import MaskType
  q, k, v = _small()
  config = AttentionConfig(mask_type=MaskType.CAUSAL, window_left=-1, window_right=-1, scale=0.25, softcap=0.0,
                           has_alibi=False)
  operands = [q, k, v, _primitives.no_lengths(), _primitives.no_lengths(), _primitives.no_alibi(),
              _primitives.no_sinks(), *_primitives.no_tokens(), _primitives.no_page_table(),
              _primitives.no_kv_descale(), _primitives.no_bias(), _primitives.no_dropout()]
  operands[operand] = jnp.zeros(shape, operands[operand].dtype)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT: " + match):
    jax.block_until_ready(_primitives.attention_forward_p.bind(*operands, config=config))


def test_legacy_hlo_and_descriptor_contents():
  with te_jax.custom_call_path("legacy"):
    lowered = _loss_fn(**KW).lower(*_loss_args())
  calls = _custom_calls(lowered)
  targets = sorted(str(c.attributes["call_target_name"]).strip('"') for c in calls)
  assert targets == ["te_jax_attention_backward_cpu_legacy", "te_jax_attention_forward_cpu_legacy"]
  text = lowered.as_text()
  assert text.count("api_version = 3 : i32") == 2 and text.count('backend_config = "TEJD') == 2
  assert "mhlo.backend_config" not in text and "_ffi" not in text
  hlo = lowered.as_text(dialect="hlo")
  assert hlo.count("api_version=API_VERSION_STATUS_RETURNING_UNIFIED") == 2  # = 3
  assert "API_VERSION_TYPED_FFI" not in hlo
  for call in calls:
    params = te_jax_cpu.unpack_descriptor(call.attributes["backend_config"].value_bytes)
    assert params == dict(batch=2, seqlen_q=13, seqlen_kv=21, num_heads=4, num_kv_heads=2, head_dim=16, head_dim_v=8,
                          dtype=0, mask_type=5, window_left=3, window_right=1, scale=0.25, softcap=4.0, has_alibi=True,
                          has_sinks=False, deterministic=False, engine=0, has_segment_ids=False, has_positions=False,
                          has_bias=False, bias_dtype=0, bias_broadcast=15, dropout_threshold=0, page_size=0,
                          num_pages=0, kv_format=0, kv_descale_blocks=1, kv_descale_heads=1, q_format=0)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("path", ["ffi", "legacy"])
def test_workspace_result_and_deterministic_in_hlo(path, deterministic):
  """Each custom call has one result more than its primitive, the engine's workspace (uint8, 0 bytes on the CPU), on
  both paths (the backward's dbias, here of the bias placeholder, before it); deterministic reaches both calls as an attribute (FFI) or the descriptor's flags (legacy)."""
  with te_jax.custom_call_path(path):
    lowered = _loss_fn(deterministic=deterministic, **KW).lower(*_loss_args())
  calls = {str(c.attributes["call_target_name"]).strip('"'): c for c in _custom_calls(lowered)}
  forward, backward = calls[f"te_jax_attention_forward_cpu_{path}"], calls[f"te_jax_attention_backward_cpu_{path}"]
  assert [str(r.type) for r in forward.results] == ["tensor<2x13x4x8xf32>", "tensor<2x4x13xf32>", "tensor<0xui8>"]
  assert [str(r.type) for r in backward.results] == ["tensor<2x13x4x16xf32>", "tensor<2x21x2x16xf32>",
                                                     "tensor<2x21x2x8xf32>", "tensor<1x1x1x1xf32>",
                                                     "tensor<0xui8>"]
  for call in (forward, backward):
    if path == "ffi":
      assert call.attributes["mhlo.backend_config"]["deterministic"].value is deterministic
    else:
      params = te_jax_cpu.unpack_descriptor(call.attributes["backend_config"].value_bytes)
      assert params["deterministic"] is deterministic


def test_jitted_function_recompiles_per_path():
  f = _loss_fn(**KW)
  args = _loss_args()
  ffi_text = f.lower(*args).as_text()
  with te_jax.custom_call_path("legacy"):
    legacy_text = f.lower(*args).as_text()
  assert ffi_text != legacy_text
  grads_ffi = f(*args)
  assert f._cache_size() == 1
  with te_jax.custom_call_path("legacy"):
    grads_legacy = f(*args)
  assert f._cache_size() == 2, "calling under the other path must compile again"
  grads_ffi_again = f(*args)
  assert f._cache_size() == 2
  te_jax.raise_legacy_failures()
  for a, b, c in zip(grads_ffi, grads_legacy, grads_ffi_again):
    assert np.array_equal(np.asarray(a), np.asarray(b)) and np.array_equal(np.asarray(a), np.asarray(c))


# A handful of configurations for the bitwise comparison, beyond those test_attention_numerics compares.
BITWISE_CASES = [
    Case(batch=2, seqlen_q=33, seqlen_kv=47, heads=4, kv_heads=4, head_dim=64, mask="padding_causal",
         q_seqlens=(33, 17), kv_seqlens=(0, 47), dtype="float16"),
    Case(batch=1, seqlen_q=64, seqlen_kv=64, heads=2, kv_heads=1, head_dim=16, head_dim_v=48, window=(7, 0),
         softcap=1.5, alibi="h", dtype="bfloat16"),
    Case(batch=3, seqlen_q=70, seqlen_kv=9, heads=3, kv_heads=1, head_dim=24, mask="causal_bottom_right", scale=1.3),
    Case(batch=2, seqlen_q=1, seqlen_kv=70, heads=4, kv_heads=2, head_dim=40, mask="padding_causal_bottom_right",
         q_seqlens=(1, 1), kv_seqlens=(70, 33), alibi="bh", dtype="bfloat16"),
]


@pytest.mark.parametrize("case", BITWISE_CASES, ids=Case.id)
def test_ffi_and_legacy_bitwise_equal(case):
  inputs = make_inputs(case)
  ffi, legacy = run_on_path(case, inputs, "ffi"), run_on_path(case, inputs, "legacy")
  assert_bitwise_equal(ffi, legacy)
  assert all(np.isfinite(x.astype(np.float32)).any() for n, x in ffi.items() if x is not None and n != "lse")


def test_ffi_and_legacy_bitwise_equal_under_vmap():
  q, k, v = _small(jnp.bfloat16, seed=5)
  qs, ks, vs = (jnp.stack([x, x[::-1] * 0.5]) for x in (q, k, v))

  def grads(q, k, v):
    return jax.grad(lambda q, k, v: (te_jax.fused_attn(q, k, v, mask_type="causal").astype(jnp.float32) ** 2).sum(),
                    argnums=(0, 1, 2))(q, k, v)

  f = jax.jit(jax.vmap(grads))
  a = f(qs, ks, vs)
  with te_jax.custom_call_path("legacy"):
    b = f(qs, ks, vs)
  te_jax.raise_legacy_failures()
  for x, y in zip(a, b):
    assert np.array_equal(np.asarray(x).view(np.uint16), np.asarray(y).view(np.uint16))


SUBPROCESS_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, te_jax
    q = jnp.ones((1, 4, 1, 8), jnp.float32)
    f = jax.jit(lambda q: te_jax.fused_attn(q, q, q))
    print("PATH", te_jax.current_custom_call_path())
    print("HLO", "TEJD" in f.lower(q).as_text(), "_legacy" in f.lower(q).as_text())
    with te_jax.custom_call_path("ffi"):
      print("CTX", te_jax.current_custom_call_path(), "_ffi" in f.lower(q).as_text())
    print("OUT", float(f(q).sum()))
    te_jax.raise_legacy_failures()
""")


def _start_python(script, env_value):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("TE_JAX_CUSTOM_CALL", None)
  if env_value is not None:
    env["TE_JAX_CUSTOM_CALL"] = env_value
  return subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def test_env_var_in_subprocesses():
  """TE_JAX_CUSTOM_CALL is read at import: legacy and ffi select the path (the context manager still overrides it);
  any other value is a ValueError at import naming the variable and the allowed values. The three interpreters run
  concurrently (starting JAX dominates their cost)."""
  procs = {value: _start_python(script, value) for value, script in
           (("legacy", SUBPROCESS_SCRIPT), ("ffi", SUBPROCESS_SCRIPT), ("Legacy", "import te_jax"))}
  results = {value: (p.wait(timeout=180), *p.communicate()) for value, p in procs.items()}

  rc, out, err = results["legacy"]
  assert rc == 0, err
  lines = out.splitlines()
  assert "PATH legacy" in lines, out
  assert "HLO True True" in lines, out
  assert "CTX ffi True" in lines, out  # the context manager overrides the environment
  assert "OUT 32.0" in lines, out

  rc, out, err = results["ffi"]
  assert rc == 0, err
  assert "PATH ffi" in out.splitlines() and "HLO False False" in out.splitlines(), out

  rc, out, err = results["Legacy"]  # values are case-sensitive
  assert rc != 0
  last = err.strip().splitlines()[-1]
  assert last.startswith("ValueError"), err
  assert "TE_JAX_CUSTOM_CALL" in last and "'ffi', 'legacy'" in last and "'Legacy'" in last, last


# Run-time validation of traced seqlens: Python cannot see their values under jit.
def _padding_fn():
  return jax.jit(lambda q, k, v, qs, ks: te_jax.fused_attn(q, k, v, mask_type="padding", q_seqlens=qs,
                                                             kv_seqlens=ks))


@pytest.mark.parametrize("q_seqlens,kv_seqlens,match", [
    ((5, 14), (21, 21), r"q_seqlens\[1\] = 14 is outside \[0, 13\]"),
    ((-1, 3), (21, 21), r"q_seqlens\[0\] = -1 is outside"),
    ((13, 13), (22, 0), r"kv_seqlens\[0\] = 22 is outside \[0, 21\]"),
])
def test_traced_seqlens_out_of_range_ffi_raises(q_seqlens, kv_seqlens, match, no_pending_legacy_failures):
  q, k, v = _small()
  f = _padding_fn()
  with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT: " + match):
    jax.block_until_ready(f(q, k, v, jnp.array(q_seqlens, jnp.int32), jnp.array(kv_seqlens, jnp.int32)))
  te_jax.raise_legacy_failures()  # the FFI path records nothing


@pytest.mark.parametrize("q_seqlens,kv_seqlens,match", [
    ((5, 14), (21, 21), r"te_jax_attention_forward_cpu_legacy: q_seqlens\[1\] = 14 is outside \[0, 13\]"),
    ((13, 13), (22, 0), r"kv_seqlens\[0\] = 22 is outside \[0, 21\]"),
])
def test_traced_seqlens_out_of_range_legacy_nan_and_recorded(q_seqlens, kv_seqlens, match,
                                                              no_pending_legacy_failures):
  q, k, v = _small()
  f = _padding_fn()
  with te_jax.custom_call_path("legacy"):
    out = np.asarray(f(q, k, v, jnp.array(q_seqlens, jnp.int32), jnp.array(kv_seqlens, jnp.int32)))
  assert np.isnan(out).all()
  with pytest.raises(LegacyCustomCallError, match=match):
    te_jax.raise_legacy_failures()
  te_jax.raise_legacy_failures()  # taken: a second call raises nothing
  # A valid call afterwards is clean and records nothing.
  with te_jax.custom_call_path("legacy"):
    out = np.asarray(f(q, k, v, jnp.array([13, 0], jnp.int32), jnp.array([21, 4], jnp.int32)))
  assert not np.isnan(out).any()
  te_jax.raise_legacy_failures()


def test_traced_seqlens_out_of_range_legacy_backward(no_pending_legacy_failures):
  q, k, v = _small()
  grad = jax.jit(jax.grad(lambda q, k, v, qs, ks: te_jax.fused_attn(q, k, v, mask_type="padding_causal",
                                                                      q_seqlens=qs, kv_seqlens=ks).sum(),
                          argnums=(0, 1, 2)))
  with te_jax.custom_call_path("legacy"):
    dq, dk, dv = grad(q, k, v, jnp.array([13, 99], jnp.int32), jnp.array([21, 21], jnp.int32))
  for x in (dq, dk, dv):
    assert np.isnan(np.asarray(x)).all()
  with pytest.raises(LegacyCustomCallError) as info:
    te_jax.raise_legacy_failures()
  message = str(info.value)
  assert "te_jax_attention_forward_cpu_legacy: q_seqlens[1] = 99" in message
  assert "te_jax_attention_backward_cpu_legacy: q_seqlens[1] = 99" in message
  te_jax.raise_legacy_failures()


def test_same_jitted_function_fails_per_path(no_pending_legacy_failures):
  """One jitted function, bad traced seqlens: FFI raises, legacy gives NaN. If the path were not part of the jit cache
  key, the second call would reuse the first executable and behave like it."""
  q, k, v = _small()
  f = _padding_fn()
  bad = (jnp.array([14, 0], jnp.int32), jnp.array([21, 21], jnp.int32))
  with pytest.raises(jax.errors.JaxRuntimeError, match="q_seqlens"):
    jax.block_until_ready(f(q, k, v, *bad))
  with te_jax.custom_call_path("legacy"):
    assert np.isnan(np.asarray(f(q, k, v, *bad))).all()
  with pytest.raises(LegacyCustomCallError, match="q_seqlens"):
    te_jax.raise_legacy_failures()
  with pytest.raises(jax.errors.JaxRuntimeError, match="q_seqlens"):
    jax.block_until_ready(f(q, k, v, *bad))
