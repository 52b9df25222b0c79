"""te_jax.bench on decode-shaped attention: queries at the end of the keys (bottom-right causal) through the FLOP
model, the reference and the backends that lack such a mask; the paged backends and the K/V read beside them. CPU
only, small shapes."""

from __future__ import annotations

import numpy as np
import pytest

from te_jax.bench import registry
from te_jax.bench.availability import Availability
from te_jax.bench.cases import Case
from te_jax.bench.flops import attention_flops, visible_pairs, workload
from te_jax.bench.inputs import make_inputs
from te_jax.bench.paging import paged_layout
from te_jax.bench.presets import PRESETS
from te_jax.bench.runner import Options, run_sweep
from te_jax.bench.timing import TimingPlan
from te_jax.reference import visible_mask

FAST = TimingPlan(sample_s=0.001, samples=2, min_samples=2)


def decode_case(**kw):
  base = dict(batch=1, seq_q=1, seq_kv=256, heads=4, kv_heads=2, head_dim=32, causal=True, bottom_right=True)
  base.update(kw)
  return Case(**base)


def _measure(names, cases, mode="fwd"):
  backends = [registry.get(n) for n in names]
  available = {n: Availability(n, True, "", ("fwd",)) for n in names}
  return run_sweep([(c, mode) for c in cases], backends, available, Options(platform="cpu", plan=FAST))


# ---------------------------------------------------------------- the case and its FLOPs

def test_bottom_right_case_carries_its_mask():
  c = decode_case(seq_q=16)
  assert c.mask_type == "causal_bottom_right" and c.mask_label == "causal_bottom_right"
  assert c.te_jax_kwargs()["mask_type"] == "causal_bottom_right" and c.bottom_right_differs
  assert not decode_case(seq_q=256).bottom_right_differs  # Sq == Skv: one mask, whichever the alignment
  assert Case.from_dict(c.to_dict()) == c
  with pytest.raises(ValueError, match="needs causal=True"):
    decode_case(causal=False)


@pytest.mark.parametrize("sq,skv,window", [(1, 9, None), (4, 9, None), (5, 9, (2, 0)), (9, 9, None), (3, 8, (1, 1))])
def test_bottom_right_pairs_match_reference_mask(sq, skv, window):
  mask = visible_mask("causal_bottom_right", sq, skv, [sq], [skv], window or (-1, -1))
  assert visible_pairs(sq, skv, True, window, bottom_right=True) == int(mask.sum())


def test_decode_flops_count_every_key_for_one_query():
  c = decode_case(batch=8, seq_kv=8192, heads=32, kv_heads=8, head_dim=128)
  assert attention_flops(c) == 4 * 8 * 32 * 128 * 8192
  assert attention_flops(decode_case(seq_q=16, seq_kv=64, heads=1, kv_heads=1, head_dim=8)) == 4 * 8 * sum(
      range(64 - 16 + 1, 64 + 1))


# ---------------------------------------------------------------- backends without a bottom-right mask

def test_backends_without_bottom_right_mask_run_decode_unmasked():
  xla, te = registry.get("jax-xla"), registry.get("te_jax-ffi")
  one, several = decode_case(), decode_case(seq_q=16)
  assert xla.computed_case(one) == (Case(**{**one.to_dict(), "causal": False, "bottom_right": False}), "")
  unmasked, note = xla.computed_case(several)
  assert not unmasked.causal and "runs without a mask" in note
  assert te.computed_case(several) == (several, "")
  assert "bottom-right" in xla.why_not(decode_case(window=(8, 0)), "fwd", "cpu")


def test_decode_run_notes_the_unmasked_backend_and_checks_each_against_its_own_mask():
  results = _measure(["te_jax-ffi", "te_jax-paged16", "jax-xla"], [decode_case(), decode_case(seq_q=16)])
  by = {(r.backend, r.case.seq_q): r for r in results}
  assert all(r.status == "ok" and r.err_ok for r in results), [(r.backend, r.reason) for r in results]
  assert by[("jax-xla", 16)].reason == "runs without a mask (it has no bottom-right causal mask)"
  assert by[("jax-xla", 1)].reason == "" and by[("te_jax-ffi", 16)].reason == ""


# ---------------------------------------------------------------- the paged backends

def _gathered(paged):
  """The contiguous K and V the page table lists: what paged_attention reads."""
  batch, pages_per_seq = paged.page_table.shape
  gather = lambda pool: pool[paged.page_table].reshape(batch, pages_per_seq * pool.shape[1], *pool.shape[2:])
  return gather(paged.k_pages), gather(paged.v_pages)


@pytest.mark.parametrize("page_size", [16, 64])
def test_page_pool_gathers_back_to_the_contiguous_kv(page_size):
  c = decode_case(batch=3, seq_kv=256, dtype="bfloat16")
  inputs = make_inputs(c)
  k, v = inputs.first.k, inputs.first.v
  paged = paged_layout(k, v, page_size)
  pages = 3 * 256 // page_size
  assert paged.k_pages.shape == (pages, page_size, 2, 32) and paged.k_pages.dtype == k.dtype
  assert paged.page_table.dtype == np.int32 and paged.page_table.shape == (3, 256 // page_size)
  assert sorted(paged.page_table.ravel()) == list(range(pages))  # every slot used once
  assert not np.array_equal(paged.page_table.ravel(), np.arange(pages))  # and shuffled across sequences
  np.testing.assert_array_equal(paged.kv_lengths, [256] * 3)
  for got, want in zip(_gathered(paged), (k, v)):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(paged_layout(k, v, page_size).page_table, paged.page_table)  # a fixed permutation
  with pytest.raises(ValueError, match="multiple of the page size"):
    paged_layout(k[:, :40], v[:, :40], 16)


def test_paged_backends_declare_what_they_run():
  paged16, paged64 = registry.get("te_jax-paged16"), registry.get("te_jax-paged64")
  assert paged16.why_not(decode_case(seq_kv=1024), "fwd", "cpu") is None
  assert paged64.why_not(decode_case(seq_kv=1040), "fwd", "cpu") == "Skv (1040) is not a multiple of the page size (64)"
  assert paged16.why_not(decode_case(seq_kv=1040), "fwd", "cpu") is None
  assert "no fwd+bwd" in paged16.why_not(decode_case(), "fwd+bwd", "cpu")
  assert "needs top-left" in paged16.why_not(decode_case(seq_q=4, bottom_right=False), "fwd", "cpu")


# ---------------------------------------------------------------- bandwidth

def test_forward_results_carry_their_kv_bandwidth():
  results = _measure(["te_jax-paged16", "te_jax-ffi"], [decode_case(batch=2, seq_kv=512)])
  for r in results:
    assert r.status == "ok" and r.kv_bytes == 2 * 512 * 2 * (32 + 32) * 4  # fp32 K and V, read once
    assert r.tbps == pytest.approx(r.kv_bytes / (r.median_ms / 1e3) / 1e12)
    assert r.tokens_per_s == pytest.approx(2 / (r.median_ms / 1e3))  # two sequences, one token each
  assert workload(decode_case(), "fwd+bwd")["kv_bytes"] is None  # a training step is not bandwidth-bound this way
  prefill, = _measure(["te_jax-ffi"], [decode_case(seq_q=32, seq_kv=64)])
  assert prefill.tbps is not None and prefill.tokens_per_s is None  # 32 queries a sequence: no decode step


def test_kv_read_row_times_the_kv_alone_and_runs_only_when_named():
  """kv-read: the case's K and V read once by XLA, the ceiling a decode's bandwidth is read against. It computes no
  attention: charged no FLOPs, proven available by running, never checked against the reference, left out unless
  named, and no contender for the fastest row."""
  from te_jax.bench import table
  from te_jax.bench.__main__ import select_backends
  from te_jax.bench.availability import probe
  kv_read = registry.get("kv-read")
  assert not kv_read.computes_attention and kv_read.why_not(decode_case(seq_q=16), "fwd", "cpu") is None
  assert "no fwd+bwd" in kv_read.why_not(decode_case(), "fwd+bwd", "cpu")
  available = probe(kv_read, "cpu")
  assert available.available and available.modes == ("fwd",) and "no error check" in available.reason
  assert "kv-read" not in [b.name for b in select_backends(None)]
  assert "kv-read" in [b.name for b in select_backends(None, everything=True)]
  assert [b.name for b in select_backends("kv-read")] == ["kv-read"]
  results = _measure(["te_jax-ffi", "kv-read"], [decode_case(batch=2, seq_kv=512)])
  by = {r.backend: r for r in results}
  read = by["kv-read"]
  assert read.status == "ok" and read.flops is None and read.tflops is None
  assert read.rel_err is None and read.err_ok is None and read.reason == ""
  assert read.kv_bytes == by["te_jax-ffi"].kv_bytes and read.tbps == pytest.approx(
      read.kv_bytes / (read.median_ms / 1e3) / 1e12)
  assert by["te_jax-ffi"].err_ok and by["te_jax-ffi"].tflops > 0
  read.median_ms = by["te_jax-ffi"].median_ms / 2  # faster than attention, yet not marked the fastest
  (_, lines), = table.rows(results, "cpu", "te_jax-ffi")
  assert [style for _, style in lines] == ["", ""]


@pytest.mark.parametrize("fp8, full", [("te_jax-fp8-paged64", "te_jax-paged64"), ("te_jax-fp8-cache", "te_jax-te")])
def test_fp8_cache_row_counts_its_bytes_and_is_judged_by_the_fp8_tolerance(fp8, full):
  """te_jax-fp8-paged64 / te_jax-fp8-cache: the same K/V quantized to e4m3 (per page and head / per head); its K/V
  bytes are one a value, its error against the reference on the unquantized inputs is e4m3's (above the float32
  tolerance, within the FP8 one)."""
  from te_jax.bench.accuracy import FP8_TOLERANCE, TOLERANCE
  results = _measure([full, fp8], [decode_case(batch=2, seq_kv=512)])
  by = {r.backend: r for r in results}
  assert by[fp8].status == "ok" and by[fp8].err_ok and TOLERANCE["float32"] < by[fp8].rel_err < FP8_TOLERANCE
  assert by[fp8].kv_bytes == by[full].kv_bytes / 4  # float32 K/V in the case, one byte each in the cache
  # On a GPU the decode kernels read the cache: up to 16 queries.
  assert registry.get(fp8).why_not(decode_case(dtype="bfloat16", seq_q=16), "fwd", "gpu") is None
  assert "decode kernels" in registry.get(fp8).why_not(decode_case(dtype="bfloat16", seq_q=17), "fwd", "gpu")


# ---------------------------------------------------------------- the decode preset

def _shapes(cases):
  return [(c.batch, c.seq_q, c.seq_kv) for c in cases]


def test_decode_preset_has_the_decoding_shapes_on_a_gpu():
  preset = PRESETS["decode"]("gpu")
  cases = preset.cases("gpu")
  assert preset.modes == ["fwd"]
  assert sorted(_shapes(cases)) == sorted([(8, 1, s) for s in (1024, 4096, 8192, 16384, 32768, 65536, 131072)]
                                          + [(64, 1, 4096), (8, 16, 8192)])
  assert all(c.heads == 32 and c.kv_heads == 8 and c.head_dim == 128 and c.dtype == "bfloat16" for c in cases)
  assert all(c.mask_type == "causal_bottom_right" and c.window is None and not c.softcap for c in cases)
  assert len({c.label for c in cases}) == 3  # the KV sweep, the large batch and the 16 queries: one plot panel each


def test_decode_preset_is_small_on_the_cpu():
  cases = PRESETS["decode"]("cpu").cases("cpu")
  assert sorted(_shapes(cases)) == [(1, 1, 1024), (1, 1, 4096), (1, 1, 16384), (1, 16, 4096), (2, 1, 4096)]
  assert all(c.dtype == "float32" and c.mask_type == "causal_bottom_right" for c in cases)


def test_decode_preset_takes_dtype_and_mode_and_refuses_shape_flags():
  from te_jax.bench.__main__ import build_sweep, parse_args
  sweep = build_sweep(parse_args(["--preset", "decode", "--dtype", "bf16,fp16", "--mode", "fwd"]), "cpu")
  assert {c.dtype for c in sweep.cases("cpu")} == {"bfloat16", "float16"} and len(sweep.cases("cpu")) == 10
  for flags in (["--seq", "1"], ["--batch", "4", "--seq-kv", "2048"], ["--causal", "no"], ["--alibi"]):
    with pytest.raises(SystemExit, match="--preset decode lists its cases one by one") as e:
      build_sweep(parse_args(["--preset", "decode"] + flags), "cpu")
    assert all(f"{flag} " in str(e.value) or f"{flag}," in str(e.value) for flag in flags if flag.startswith("--"))
  assert "cannot apply to it; only --dtype and --mode do" in str(e.value)
