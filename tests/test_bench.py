"""te_jax.bench: the FLOP model, presets, the registry's declared limits ("why not"), availability proven by running
(wrong or failing backends are unavailable with the reason), timing arithmetic, inputs and result files. CPU only."""

from __future__ import annotations

import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax.bench import registry, table
from te_jax.bench.accuracy import measure_errors
from te_jax.bench.availability import Availability, probe, probe_case
from te_jax.bench.backends_jax import JaxBackend
from te_jax.bench.cases import Case, parse_dtype, parse_mode
from te_jax.bench.flops import attention_flops, visible_pairs
from te_jax.bench.inputs import make_inputs, rotation_sets
from te_jax.bench.presets import PRESETS
from te_jax.bench.registry import Capabilities
from te_jax.bench.results import Result, apply_speedups
from te_jax.bench.runner import Options, SweepStopped, run_sweep
from te_jax.bench.timing import TimingPlan, measure
from te_jax.reference import visible_mask

ALL = ("float32", "bfloat16", "float16")


def case(**kw):
  base = dict(batch=1, seq_q=64, seq_kv=64, heads=2, head_dim=32, dtype="float32")
  base.update(kw)
  base.setdefault("kv_heads", base["heads"])
  return Case(**base)


# ---------------------------------------------------------------- FLOP model

def test_flops_known_cases():
  c = case(seq_q=4, seq_kv=4, heads=1, head_dim=8)
  assert attention_flops(c, "fwd") == 4 * 4 * 4 * 8 == 512
  assert attention_flops(case(seq_q=4, seq_kv=4, heads=1, head_dim=8, causal=True), "fwd") == 256
  # causal + window (1, 0): the rows see 1, 2, 2, 2 keys.
  assert attention_flops(case(seq_q=4, seq_kv=4, heads=1, head_dim=8, causal=True, window=(1, 0)), "fwd") == 4 * 7 * 8
  # The fa preset's largest point: B = 1, S = 16k, H = 16, D = 128 is exactly 2^41 FLOPs forward.
  fa = Case(batch=1, seq_q=16384, seq_kv=16384, heads=16, kv_heads=16, head_dim=128)
  assert attention_flops(fa, "fwd") == 2.0 ** 41
  assert attention_flops(fa, "bwd") == 2.5 * 2.0 ** 41
  assert attention_flops(fa, "fwd+bwd") == 3.5 * 2.0 ** 41
  # Batch and heads scale linearly, kv heads do not count (GQA does the same math per query head).
  assert attention_flops(case(batch=3, heads=8, kv_heads=2)) == 3 * 4 * attention_flops(case())


@pytest.mark.parametrize("sq,skv,causal,window", [(7, 7, True, None), (5, 9, True, None), (9, 5, True, None),
                                                   (8, 8, False, (2, 1)), (6, 10, False, (0, 3)), (10, 6, True, (3, 0)),
                                                   (16, 16, True, (-1, 0)), (3, 3, False, (5, 5))])
def test_visible_pairs_matches_reference_mask(sq, skv, causal, window):
  mask = visible_mask("causal" if causal else "no_mask", sq, skv, [sq], [skv], window or (-1, -1))
  assert visible_pairs(sq, skv, causal, window) == int(mask.sum())


def test_window_flops_count_visible_pairs():
  c = case(seq_q=1024, seq_kv=1024, heads=1, head_dim=64, causal=True, window=(127, 0))
  pairs = sum(min(i + 1, 128) for i in range(1024))
  assert attention_flops(c) == 4 * 64 * pairs
  assert attention_flops(c) < attention_flops(case(seq_q=1024, seq_kv=1024, heads=1, head_dim=64, causal=True)) / 3


# ---------------------------------------------------------------- presets and cases

def test_fa_preset_shapes():
  sweep = PRESETS["fa"]("gpu")
  cases = sweep.cases("gpu")
  assert len(cases) == 6 * 3 * 2
  assert {c.seq_q for c in cases} == {512, 1024, 2048, 4096, 8192, 16384}
  assert {c.head_dim for c in cases} == {64, 128, 256}
  assert all(c.batch * c.seq_q == 16384 and c.heads * c.head_dim == 2048 for c in cases)
  assert all(c.dtype == "bfloat16" for c in cases) and {c.causal for c in cases} == {False, True}
  assert sweep.modes == ["fwd", "fwd+bwd"]


def test_llama_preset():  # the decode preset: tests/test_bench_decode.py
  llama = PRESETS["llama"]("gpu").cases("gpu")
  assert all(c.causal for c in llama) and any(c.gqa for c in llama)
  assert any(c.softcap for c in llama) and any(c.window for c in llama)


def test_cpu_preset():
  sweep = PRESETS["cpu"]("cpu")
  cases = sweep.cases("cpu")
  assert sweep.modes == ["fwd"]
  assert sorted((c.seq_q, c.causal) for c in cases) == [(2048, False), (2048, True), (4096, False), (4096, True)]
  assert all((c.batch, c.heads, c.kv_heads, c.head_dim, c.dtype) == (1, 8, 8, 64, "float32") for c in cases)


def test_quick_cpu_preset_is_small():
  cases = PRESETS["quick"]("cpu").cases("cpu")
  assert [c.seq_q for c in cases] == [512, 1024, 2048]
  assert all(c.dtype == "float32" and c.batch == 1 and c.heads == 8 and c.head_dim == 64 for c in cases)


def test_cli_flags_override_preset():
  from te_jax.bench.__main__ import build_sweep, parse_args
  args = parse_args(["--preset", "fa", "--seq", "256,512", "--heads", "4", "--kv-heads", "2", "--head-dim", "64",
                     "--causal", "--window", "31", "--softcap", "30", "--dtype", "bf16", "--mode", "bwd,train"])
  sweep = build_sweep(args, "cpu")
  cases = sweep.cases("cpu")
  assert len(cases) == 2 and sweep.modes == ["bwd", "fwd+bwd"]
  assert all(c.heads == 4 and c.kv_heads == 2 and c.head_dim == 64 and c.causal and c.window == (31, 0)
             and c.softcap == 30 and c.dtype == "bfloat16" and c.batch * c.seq_q == 16384 for c in cases)
  with pytest.raises(ValueError):
    parse_mode("sideways")
  assert parse_dtype("fp16") == "float16"


def test_small_case_keeps_what_matters():
  c = Case(batch=16, seq_q=4096, seq_kv=4096, heads=32, kv_heads=8, head_dim=256, causal=True, window=(1023, 0),
           softcap=50.0, dtype="bfloat16")
  s = c.small()
  assert (s.batch, s.seq_q, s.seq_kv) == (1, 256, 256)
  assert s.heads // s.kv_heads == 4 and s.head_dim == 256 and s.causal and s.softcap == 50.0
  assert s.dtype == "bfloat16" and s.window == (64, 0)


# ---------------------------------------------------------------- registry and reasons

def test_registry_has_every_backend():
  names = [b.name for b in registry.all_backends()]
  for expected in ("te_jax-ffi", "te_jax-legacy", "te_jax-te", "te_jax-cudnn", "te_jax-deterministic", "te_jax-packed",
                   "te_jax-unsorted-packed", "te_jax-cp-ring", "te_jax-cp-all_gather", "te_jax-paged16", "te_jax-paged64", "kv-read",
                   "jax-cudnn", "jax-xla", "pallas",
                   "torch-flash", "torch-cudnn", "torch-efficient", "flash-attn-jax", "flash-attn", "tokamax-mosaic",
                   "tokamax-triton", "tokamax-xla", "jax-fp8-cudnn", "te_jax-fp8-paged64", "te_jax-fp8-cache"):
    assert expected in names
  assert registry.default_baseline("cpu") == "jax-xla" and registry.default_baseline("gpu") == "jax-cudnn"
  with pytest.raises(ValueError, match="unknown backend"):
    registry.get("nope")


def test_te_jax_engines_declare_what_they_serve():
  """Each engine is a backend: te_jax-te serves what te_jax-ffi does; te_jax-cudnn is GPU-only, without soft-cap or
  ALiBi, and says so (on a CPU, its reason is the platform)."""
  te, cudnn = registry.get("te_jax-te"), registry.get("te_jax-cudnn")
  assert te.caps == registry.get("te_jax-ffi").caps
  assert cudnn.why_not(case(dtype="bfloat16"), "fwd+bwd", "gpu") is None
  assert cudnn.why_not(case(dtype="bfloat16", softcap=30.0), "fwd", "gpu") == "no logit softcap"
  assert cudnn.why_not(case(dtype="bfloat16", alibi=True), "fwd", "gpu") == "no ALiBi"
  assert "runs on gpu only" in cudnn.why_not(case(), "fwd", "cpu")


def test_deterministic_backend_runs_the_backward_only():
  det = registry.get("te_jax-deterministic")
  assert det.fused_attn_kwargs(case())["deterministic"] is True and det.fused_attn_kwargs(case())["engine"] == "te"
  assert "no fwd (supports bwd, fwd+bwd)" in det.why_not(case(), "fwd", "cpu")
  assert det.why_not(case(heads=4, kv_heads=2, causal=True), "fwd+bwd", "cpu") is None
  a = probe(det, "cpu")
  assert a.available and a.modes == ("bwd", "fwd+bwd"), a.reason
  e = measure_errors(det, case(heads=4, kv_heads=2, causal=True, dtype="bfloat16"), "fwd+bwd")
  assert e.ok, e


def test_te_jax_declares_everything():
  te = registry.get("te_jax-ffi")
  assert te.caps.platforms["cpu"] == ALL and te.caps.platforms["gpu"] == ("bfloat16", "float16")
  full = case(heads=8, kv_heads=2, causal=True, window=(16, 0), softcap=30.0, alibi=True, head_dim=256)
  for mode in ("fwd", "bwd", "fwd+bwd"):
    assert te.why_not(full, mode, "cpu") is None
  assert "fp32 unsupported on gpu" in te.why_not(case(), "fwd", "gpu")
  assert "head dim 264" in te.why_not(case(head_dim=264), "fwd", "cpu")


@pytest.mark.parametrize("name,kw,platform,expected", [
    ("jax-cudnn", {}, "cpu", "runs on gpu only"),
    ("jax-cudnn", dict(dtype="float32"), "gpu", "fp32 unsupported on gpu"),
    ("jax-cudnn", dict(window=(8, 8), dtype="bfloat16"), "gpu", "window must be (left, 0)"),
    ("jax-xla", dict(softcap=30.0), "cpu", "no logit softcap"),
    ("jax-xla", dict(alibi=True), "cpu", "no ALiBi"),
    ("pallas", dict(heads=4, kv_heads=2, seq_q=128, seq_kv=128, dtype="bfloat16"), "gpu", "no GQA"),
    ("pallas", dict(seq_q=100, seq_kv=100, dtype="bfloat16"), "gpu", "multiples of 128"),
    ("torch-flash", dict(window=(8, 0), dtype="bfloat16"), "gpu", "no sliding window"),
])
def test_why_not_reasons(name, kw, platform, expected):
  reason = registry.get(name).why_not(case(**kw), "fwd", platform)
  assert reason is not None and expected in reason


def test_pallas_backward_needs_equal_lengths():
  pallas = registry.get("pallas")
  c = case(seq_q=128, seq_kv=256, dtype="bfloat16")
  assert pallas.why_not(c, "fwd", "gpu") is None
  assert "Sq == Skv" in pallas.why_not(c, "fwd+bwd", "gpu")


def test_a_decode_only_backend_is_probed_on_one_query():
  # The GPU reads an FP8 KV cache in its decode kernels alone: the availability probe takes a one-query case there
  # (a 128-query probe would call the backend unavailable), and the square case wherever the backend serves it.
  fp8 = registry.get("te_jax-fp8-cache")
  assert probe_case(fp8, "gpu").seq_q == 1 and fp8.why_not(probe_case(fp8, "gpu"), "fwd", "gpu") is None
  assert probe_case(fp8, "cpu").seq_q == 128
  assert probe_case(registry.get("te_jax-ffi"), "gpu").seq_q == 128


def test_a_one_head_dim_backend_is_probed_at_its_head_dim():
  # FP8 q, k and v on a GPU: the sm90 FP8 kernel serves d 128 alone, so the probe takes d 128 there, d 64 elsewhere.
  fp8 = registry.get("te_jax-fp8-qkv")
  case = probe_case(fp8, "gpu")
  assert (case.seq_q, case.head_dim) == (128, 128) and fp8.why_not(case, "fwd", "gpu") is None
  assert probe_case(fp8, "cpu").head_dim == 64


# ---------------------------------------------------------------- availability is proven by running

class _FakeJax(JaxBackend):
  caps = Capabilities(platforms={"cpu": ALL})

  def __init__(self, name, fn):
    self.name, self.label, self._fn = name, name, fn

  def attention_fn(self, case):
    return self._fn(case)


def _xla(case):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation="xla")


def _wrong(case):
  return lambda q, k, v: q * 2.0


def _raises(case):
  def fn(q, k, v):
    raise RuntimeError("boom: kernel not built")
  return fn


def _bad_backward(case):
  @jax.custom_vjp
  def f(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")

  f.defvjp(lambda q, k, v: (f(q, k, v), (q, k, v)),
           lambda res, g: tuple(jnp.zeros_like(x) for x in res))
  return f


def _ignores_causal(case):
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")


def _fails_above_256(case):
  if case.seq_q > 256:
    raise RuntimeError("too long for this kernel")
  return _xla(case)


def test_wrong_backend_is_unavailable_with_reason():
  a = probe(_FakeJax("wrong", _wrong), "cpu")
  assert not a.available and a.reason.startswith("wrong forward result") and "relative error" in a.reason


def test_failing_backend_is_unavailable_with_reason():
  a = probe(_FakeJax("raises", _raises), "cpu")
  assert not a.available and "forward fails" in a.reason and "boom: kernel not built" in a.reason


def test_missing_package_is_not_installed():
  fake = _FakeJax("missing", _xla)
  fake.requires = ("te_jax_no_such_module",)
  a = probe(fake, "cpu")
  assert not a.available and a.reason.startswith("not installed")
  assert "not installed" in probe(registry.get("flash-attn-jax"), "cpu").reason


def test_tokamax_backends_pass_the_case_as_tokamax_takes_it(monkeypatch):
  """The tokamax rows call tokamax.dot_product_attention with their implementation pinned and the case's causal mask,
  window, soft-cap and bias by tokamax's names (a stand-in module records the call; tokamax needs Python 3.12)."""
  import importlib.machinery
  import types
  calls = []

  def dot_product_attention(q, k, v, bias=None, **kwargs):
    calls.append(dict(kwargs, bias=bias))
    return q

  fake = types.ModuleType("tokamax")
  fake.__spec__ = importlib.machinery.ModuleSpec("tokamax", None)
  fake.dot_product_attention = dot_product_attention
  monkeypatch.setitem(sys.modules, "tokamax", fake)
  case = Case(batch=1, seq_q=8, seq_kv=8, heads=2, kv_heads=1, head_dim=8, causal=True, window=(3, 0), softcap=30.0)
  q = jnp.ones((1, 8, 2, 8))
  for implementation in ("mosaic", "triton", "xla"):
    backend = registry.get(f"tokamax-{implementation}")
    backend.attention_fn(case)(q, q, q, bias="the bias")
    assert calls[-1] == dict(implementation=implementation, is_causal=True, local_window_size=(3, 0),
                             logits_soft_cap=30.0, bias="the bias")
  plain = Case(batch=1, seq_q=8, seq_kv=8, heads=2, kv_heads=2, head_dim=8)
  registry.get("tokamax-xla").attention_fn(plain)(q, q, q)
  assert calls[-1] == dict(implementation="xla", is_causal=False, bias=None)
  assert registry.get("tokamax-xla").why_not(plain, "fwd+bwd", "cpu") is None
  assert "runs on gpu only" in registry.get("tokamax-mosaic").why_not(plain, "fwd", "cpu")


def test_tokamax_xla_agrees_with_the_reference_on_the_cpu():
  pytest.importorskip("tokamax", reason="tokamax is not installed (it needs Python 3.12 and jax 0.11.1)")
  a = probe(registry.get("tokamax-xla"), "cpu")
  assert a.available, a.reason


def test_wrong_backward_only_loses_backward():
  a = probe(_FakeJax("badbwd", _bad_backward), "cpu")
  assert a.available and a.modes == ("fwd",) and "backward unavailable: wrong result" in a.reason


def test_real_cpu_backends_are_available():
  for name in ("te_jax-ffi", "te_jax-legacy", "jax-xla"):
    a = probe(registry.get(name), "cpu")
    assert a.available, a.reason
    assert a.modes == ("fwd", "bwd", "fwd+bwd")
  assert "runs on gpu only" in probe(registry.get("jax-cudnn"), "cpu").reason


def test_torch_sdpa_path_on_cpu_if_installed():
  pytest.importorskip("torch")
  flash = registry.get("torch-flash")
  a = probe(flash, "cpu")
  assert a.available and a.modes == ("fwd", "bwd", "fwd+bwd"), a.reason
  c = case(heads=4, kv_heads=2, causal=True)  # GQA through enable_gqa, [B, H, S, D] layout and back
  assert flash.why_not(c, "fwd", "cpu") is None
  for mode in ("fwd", "bwd"):
    e = measure_errors(flash, c, mode)
    assert e.ok and e.rel < 1e-4, (mode, e)
  assert "no sliding window" in flash.why_not(case(window=(8, 0)), "fwd", "cpu")


def test_errors_against_reference_for_each_mode():
  te = registry.get("te_jax-ffi")
  c = case(heads=4, kv_heads=2, causal=True, window=(8, 0), softcap=20.0, alibi=True)
  for mode in ("fwd", "bwd", "fwd+bwd"):
    e = measure_errors(te, c, mode)
    assert e.ok and e.rel < 1e-5, (mode, e)
    assert e.worst in (("out",) if mode == "fwd" else ("dq", "dk", "dv"))
  e = measure_errors(te, case(dtype="bfloat16", causal=True), "fwd+bwd")
  assert e.ok and 1e-4 < e.rel < 5e-2  # bf16 is measurably less exact, and still within tolerance


# ---------------------------------------------------------------- optional operands: bias, sinks, dropout

FEATURES = [dict(bias="heads"), dict(bias="keys"), dict(sinks=True), dict(dropout=0.1)]


def test_features_name_themselves_and_are_checked():
  assert case(bias="heads").mask_label == "no_mask+bias[1,H,Sq,Skv]"
  assert case(causal=True, bias="keys", sinks=True, dropout=0.25).mask_label == \
      "causal+bias[B,1,1,Skv]+sinks+dropout0.25"
  assert case(dropout=0.1).te_jax_kwargs()["dropout_rate"] == 0.1 and "dropout_rate" not in case().te_jax_kwargs()
  with pytest.raises(ValueError, match="bias must be '' or one of heads, keys"):
    case(bias="rows")
  with pytest.raises(ValueError, match=r"dropout must be a rate in \[0, 1\)"):
    case(dropout=1.0)
  assert Case.from_dict(case(bias="keys", sinks=True, dropout=0.5).to_dict()) == case(bias="keys", sinks=True,
                                                                                    dropout=0.5)


def test_inputs_carry_the_operands_of_the_case():
  c = case(batch=2, heads=4, kv_heads=2, seq_q=32, seq_kv=48, bias="heads", sinks=True, dropout=0.1, alibi=True)
  inputs = make_inputs(c, seed=3)
  named = inputs.operands()
  assert sorted(named) == ["alibi_slopes", "bias", "dropout_rng", "sink_logits"]
  assert named["bias"].shape == (1, 4, 32, 48) and named["bias"].dtype == np.float32
  assert named["sink_logits"].shape == (4,) and named["sink_logits"].dtype == np.float32
  assert named["dropout_rng"].dtype == np.uint32 and named["dropout_rng"].shape == (2,)
  np.testing.assert_array_equal(make_inputs(c, seed=3).bias, inputs.bias)  # deterministic
  assert make_inputs(case(batch=2, bias="keys", dtype="bfloat16")).bias.shape == (2, 1, 1, 64)
  assert make_inputs(case(batch=2, bias="keys", dtype="bfloat16")).bias.dtype.name == "bfloat16"
  assert make_inputs(case()).operands() == {}


@pytest.mark.parametrize("feature", FEATURES, ids=lambda f: "-".join(map(str, f.values())))
def test_te_jax_matches_the_reference_with_each_feature(feature):
  """Each operand through te_jax against the float64 reference, which applies the bias, te_jax.dropout_keep_mask's
  mask and a sink per head (its gradients too)."""
  te = registry.get("te_jax-ffi")
  c = case(heads=4, kv_heads=2, causal=True, **feature)
  for mode in ("fwd", "fwd+bwd"):
    e = measure_errors(te, c, mode)
    assert e.ok and e.rel < 1e-5, (mode, e)


def _ignores_operands(case):
  return lambda q, k, v, **operands: jax.nn.dot_product_attention(q, k, v, is_causal=case.causal, implementation="xla")


@pytest.mark.parametrize("feature", [dict(sinks=True), dict(dropout=0.1), dict(bias="heads")], ids=str)
def test_a_backend_ignoring_an_operand_is_caught(feature):
  """The reference's features change the result: a backend that takes an operand and drops it is out of tolerance."""
  fake = _FakeJax("ignores", _ignores_operands)
  fake.caps = Capabilities(platforms={"cpu": ALL}, bias=True, sinks=True, dropout=True)
  for mode in ("fwd", "fwd+bwd"):
    assert not measure_errors(fake, case(heads=4, causal=True, **feature), mode).ok


def test_backends_declare_the_operands_they_take():
  gpu = dict(dtype="bfloat16")
  for name in ("te_jax-ffi", "te_jax-te"):
    assert all(registry.get(name).why_not(case(**gpu, **f), "fwd+bwd", "gpu") is None for f in FEATURES)
  cudnn = registry.get("te_jax-cudnn")
  assert cudnn.why_not(case(**gpu, sinks=True), "fwd", "gpu") is None
  assert cudnn.why_not(case(**gpu, bias="keys"), "fwd", "gpu") == "no additive bias"
  assert cudnn.why_not(case(**gpu, dropout=0.1), "fwd", "gpu") == "no dropout"
  for name in ("jax-cudnn", "jax-xla"):
    assert registry.get(name).why_not(case(**gpu, bias="heads"), "fwd", "gpu") is None
    assert registry.get(name).why_not(case(**gpu, sinks=True), "fwd", "gpu") == "no attention sinks"
    assert registry.get(name).why_not(case(**gpu, dropout=0.1), "fwd", "gpu") == "no dropout"
  assert registry.get("te_jax-cp-ring").why_not(case(bias="heads"), "fwd", "cpu") == "no additive bias"
  assert registry.get("te_jax-paged16").why_not(case(sinks=True), "fwd", "cpu") == "no attention sinks"
  assert registry.get("torch-flash").why_not(case(**gpu, bias="keys"), "fwd", "gpu") == "no additive bias"


def test_features_preset():
  gpu = PRESETS["features"]("gpu")
  cases = gpu.cases("gpu")
  assert gpu.modes == ["fwd", "fwd+bwd"]
  assert [(c.bias, c.sinks, c.dropout) for c in cases] == [("", False, 0.0), ("", True, 0.0), ("heads", False, 0.0),
                                                          ("keys", False, 0.0), ("", False, 0.1)]
  assert all((c.batch, c.seq_q, c.seq_kv, c.heads, c.kv_heads, c.head_dim) == (4, 4096, 4096, 16, 16, 128) and c.causal
             and c.dtype == "bfloat16" for c in cases)
  cpu = PRESETS["features"]("cpu").cases("cpu")
  assert all(c.batch * c.seq_q <= 2048 and c.dtype == "float32" for c in cpu) and len(cpu) == 5


# ---------------------------------------------------------------- packed documents

def test_packed_row_matches_the_batch_it_packs():
  """te_jax-packed runs the batch as one row with segment ids and puts the results back per document: its errors are
  those of the batch's problem, checked on three documents (a packed row with a middle document)."""
  packed = registry.get("te_jax-packed")
  c = case(batch=4, heads=4, kv_heads=2, causal=True, window=(8, 0), softcap=20.0, alibi=True, sinks=True)
  assert packed.why_not(c, "fwd+bwd", "cpu") is None and packed.error_case(c).batch == 3
  for mode in ("fwd", "bwd", "fwd+bwd"):
    e = measure_errors(packed, c, mode)
    assert e.ok and e.rel < 1e-5, (mode, e)


def test_unsorted_packed_row_falls_and_still_matches_the_batch():
  """te_jax-unsorted-packed's ids fall document by document, and its errors are the batch's problem's."""
  unsorted = registry.get("te_jax-unsorted-packed")
  c = case(batch=3, heads=2, causal=True)
  ids = np.asarray(unsorted.segment_ids(c))[0]
  assert list(ids[::c.seq_q]) == [3, 2, 1] and (np.diff(ids) <= 0).all()
  for mode in ("fwd", "fwd+bwd"):
    e = measure_errors(unsorted, c, mode)
    assert e.ok and e.rel < 1e-5, (mode, e)


def test_a_packed_row_without_segment_ids_is_caught():
  """Without the ids every document sees the ones before it in the row: out of tolerance."""
  from te_jax.bench.backends_jax import PackedBackend

  class Unsegmented(PackedBackend):
    def attention_fn(self, case):
      import te_jax
      return lambda q, k, v: te_jax.fused_attn(q, k, v, **case.te_jax_kwargs())

  for mode in ("fwd", "fwd+bwd"):
    assert not measure_errors(Unsegmented(), case(batch=2, causal=True), mode).ok


def test_packed_backend_declares_what_it_packs():
  packed = registry.get("te_jax-packed")
  assert packed.why_not(case(batch=2, seq_q=64, seq_kv=128), "fwd", "cpu") == \
      "a packed row holds whole documents: Sq = Skv"
  assert packed.why_not(case(batch=1), "fwd", "cpu") == "one document: the packed row is the batch"
  assert packed.why_not(case(batch=2, bias="keys"), "fwd", "cpu") == "no additive bias"
  assert packed.why_not(case(batch=2, dtype="bfloat16"), "fwd+bwd", "gpu") is None


def test_packed_preset_and_its_flags():
  from te_jax.bench.__main__ import build_sweep, parse_args
  gpu = PRESETS["packed"]("gpu").cases("gpu")
  assert [(c.batch, c.seq_q, c.heads, c.head_dim, c.causal, c.dtype) for c in gpu] == [
      (b, 16384 // b, 16, 128, causal, "bfloat16") for causal in (True, False) for b in (32, 8, 2)]
  assert [(c.batch, c.seq_q, c.heads, c.head_dim) for c in PRESETS["packed"]("cpu").cases("cpu")] == [(8, 2048, 4, 64)]
  sweep = build_sweep(parse_args(["--preset", "packed", "--batch", "16", "--seq", "512,1024"]), "cpu")
  assert [(c.batch, c.seq_q) for c in sweep.cases("cpu")] == [(16, 512), (16, 1024)]
  assert sweep.modes == ["fwd", "fwd+bwd"]


# ---------------------------------------------------------------- the runner

def _items(cases, modes=("fwd",)):
  return [(c, m) for c in cases for m in modes]


FAST = TimingPlan(sample_s=0.001, samples=2, min_samples=2)


def _available(*backends):
  return {b.name: Availability(b.name, True, "", ("fwd", "bwd", "fwd+bwd")) for b in backends}


def test_runner_flags_inaccurate_results():
  ok, sloppy = _FakeJax("ok", _xla), _FakeJax("sloppy", _ignores_causal)
  results = run_sweep(_items([case(causal=True)]), [ok, sloppy], _available(ok, sloppy),
                      Options(platform="cpu", plan=FAST))
  by = {r.backend: r for r in results}
  assert by["ok"].status == "ok" and by["ok"].err_ok and by["ok"].tflops > 0 and by["ok"].rel_err < 1e-5
  assert by["ok"].median_ms > 0 and by["ok"].memory_mib > 0 and by["ok"].samples == 2
  # Right without a mask (so it passed the probe), wrong with one: measured, and flagged.
  assert by["sloppy"].status == "ok" and by["sloppy"].err_ok is False and by["sloppy"].rel_err > 0.05
  assert by["sloppy"].reason.startswith("inaccurate")


def test_runner_records_failures_and_unsupported_or_stops():
  flaky = _FakeJax("flaky", _fails_above_256)
  nogqa = _FakeJax("nogqa", _xla)
  nogqa.caps = Capabilities(platforms={"cpu": ALL}, gqa=False)
  avail = _available(flaky, nogqa)
  items = _items([case(seq_q=512, seq_kv=512, heads=4, kv_heads=2)])
  results = run_sweep(items, [flaky, nogqa], avail, Options(platform="cpu", keep_going=True, plan=FAST))
  by = {r.backend: r for r in results}
  assert by["flaky"].status == "failed" and "too long for this kernel" in by["flaky"].reason
  assert by["nogqa"].status == "unsupported" and "no GQA" in by["nogqa"].reason
  seen = []
  with pytest.raises(SweepStopped, match="too long for this kernel"):
    run_sweep(items + items, [flaky, nogqa], avail, Options(platform="cpu", keep_going=False, plan=FAST),
              on_result=seen.append)
  assert [r.status for r in seen] == ["failed"]  # stopped at the first failure, which was still reported


def test_runner_times_each_feature_where_declared():
  """The features' operands reach the timed calls (as arguments, a bias among them) and the error check; a backend
  without a feature records why."""
  te, xla = registry.get("te_jax-ffi"), registry.get("jax-xla")
  cases = [case(seq_q=128, seq_kv=128, causal=True, **f) for f in FEATURES]
  results = run_sweep(_items(cases, ("fwd", "fwd+bwd")), [te, xla], _available(te, xla),
                      Options(platform="cpu", plan=FAST))
  assert len(results) == 16
  for r in results:
    if r.backend == "te_jax-ffi" or r.case.bias:
      assert r.status == "ok" and r.err_ok and r.median_ms > 0, (r.backend, r.case.mask_label, r.reason)
    else:
      assert r.status == "unsupported" and r.reason in ("no attention sinks", "no dropout")


def test_runner_skips_past_the_budget():
  ok = _FakeJax("ok", _xla)
  results = run_sweep(_items([case()]), [ok], _available(ok), Options(platform="cpu", deadline=0.0))
  assert [r.status for r in results] == ["skipped"] and "budget" in results[0].reason


def test_speedups_are_relative_to_the_baseline():
  c = case()
  rs = [Result(c, "fwd", "base", "ok", median_ms=2.0), Result(c, "fwd", "fast", "ok", median_ms=0.5),
        Result(c, "fwd", "broken", "failed")]
  apply_speedups(rs, "base")
  assert [r.speedup for r in rs] == [1.0, 4.0, None]


# ---------------------------------------------------------------- the terminal table

def _timed(backend, **kw):
  return Result(case(), "fwd", backend, "ok", median_ms=1.0, p25_ms=0.9, p75_ms=1.1, tflops=0.01, speedup=1.0, **kw)


def _table_lines(results, plain, monkeypatch, capsys):
  """The printed table's header line (split into columns) and its title, from rich or from the plain fallback."""
  if plain:
    monkeypatch.setitem(sys.modules, "rich.table", None)  # the fallback without rich
  table.print_table(results, "cpu", "jax-xla", "a test CPU")
  lines = capsys.readouterr().out.splitlines()
  header = next(l for l in lines if "median ms" in l)
  return re.split(r"\s*[┃│]\s*|\s{2,}", header.strip(" ┃│")), " ".join(lines[:3])


@pytest.mark.parametrize("plain", [False, True])
def test_table_leaves_out_the_columns_no_row_fills(plain, monkeypatch, capsys):
  checked = [_timed("te_jax-ffi", max_err=1e-6, rel_err=2e-7, err_ok=True, memory_mib=16.0),
             Result(case(), "fwd", "jax-cudnn", "unsupported", reason="runs on gpu only")]
  header, title = _table_lines(checked, plain, monkeypatch, capsys)
  assert header[-8:] == ["backend", "median ms", "GFLOP/s", "speedup", "max err", "rel err", "mem MiB", "note"]
  assert "errors vs float64 reference" in title and "mem = peak of one call" in title

  forward = [_timed("te_jax-ffi", tbps=0.002), _timed("jax-xla")]  # a forward's K/V bandwidth, in GB/s on the CPU
  header, title = _table_lines(forward, plain, monkeypatch, capsys)
  assert header[-5:] == ["backend", "median ms", "GFLOP/s", "GB/s", "speedup"]
  assert "bandwidth = K/V" in title

  unchecked = [_timed("te_jax-ffi"), _timed("jax-xla")]  # --no-check, no memory figure, nothing to note
  header, title = _table_lines(unchecked, plain, monkeypatch, capsys)
  assert header[-4:] == ["backend", "median ms", "GFLOP/s", "speedup"]
  assert "errors vs" not in title and "mem =" not in title and "speedup over jax-xla" in title


def test_self_check_speed_table_shows_only_filled_columns(monkeypatch, capsys):
  """`python -m te_jax` times without the error check (its own table has the errors): no empty error columns."""
  import te_jax.__main__ as self_check
  monkeypatch.setitem(self_check.SPEED_SHAPES, "cpu", ["--batch", "1", "--seq", "64", "--heads", "2", "--head-dim",
                                                       "32", "--samples", "2", "--sample-ms", "2"])
  self_check.compare_speed()
  out = capsys.readouterr().out
  header = next(l for l in out.splitlines() if "median ms" in l)
  assert "speedup" in header and "mem MiB" in header  # te_jax and XLA both report their peak memory on the CPU
  assert "err" not in header and "errors vs" not in out


# ---------------------------------------------------------------- timing and inputs

class _ScriptedPrepared:
  """Pretends each call takes 1 ms, except the very first (warm-up, 'compile'), which takes 10 s."""

  def __init__(self):
    self.calls = 0

  def run_calls(self, n):
    first = self.calls == 0
    self.calls += n
    return 10.0 + (n - 1) * 1e-3 if first else n * 1e-3 * (1.0 + 0.01 * (self.calls % 3))


def test_timing_excludes_warmup_and_calibrates_calls():
  p = _ScriptedPrepared()
  t = measure(p, num_sets=1, plan=TimingPlan(sample_s=0.02, samples=5))
  assert t.samples == 5 and 19 <= t.calls_per_sample <= 20
  assert 1e-3 <= t.median_s <= 1.03e-3 and t.max_s < 0.01
  assert t.min_s <= t.p25_s <= t.median_s <= t.p75_s <= t.max_s


class _StalledOncePrepared:
  """1 ms a call, but the first run after the warm-up stalls 13 ms (a one-off on the host or the GPU)."""

  def __init__(self):
    self.runs = 0

  def run_calls(self, n):
    self.runs += 1
    return 10.0 if self.runs == 1 else n * 1e-3 + (13e-3 if self.runs == 2 else 0.0)


def test_timing_calibration_survives_a_one_off_stall():
  t = measure(_StalledOncePrepared(), num_sets=1, plan=TimingPlan(sample_s=0.04, samples=5))
  assert t.calls_per_sample == 40 and t.samples == 5 and t.median_s == pytest.approx(1e-3)


def test_inputs_are_deterministic_and_rotated():
  c = case(seq_q=256, seq_kv=256, heads=4, kv_heads=4, head_dim=64, dtype="bfloat16")
  a, b = make_inputs(c, 2, seed=3), make_inputs(c, 2, seed=3)
  assert a.first.q.dtype.name == "bfloat16"
  for x, y in zip(a.sets, b.sets):
    np.testing.assert_array_equal(np.asarray(x.q, np.float32), np.asarray(y.q, np.float32))
  assert not np.array_equal(np.asarray(a.sets[0].k, np.float32), np.asarray(a.sets[1].k, np.float32))
  assert not np.array_equal(np.asarray(a.first.q, np.float32), np.asarray(a.first.k, np.float32))
  assert abs(float(np.asarray(a.first.q, np.float32).std()) - 1.0) < 0.05
  assert rotation_sets(c, "cpu") == 4  # 512 KiB per set: rotate the maximum
  big = Case(batch=1, seq_q=16384, seq_kv=16384, heads=16, kv_heads=16, head_dim=128, dtype="bfloat16")
  assert rotation_sets(big, "gpu") == 1 and math.isclose(rotation_sets(big, "cpu"), 1)
