"""CPU CI: every shipped kernel configuration compiles with NVRTC (no GPU needed), and the JIT disk cache behaves:
hits are found, corrupt entries are rebuilt, concurrent compiles of one key are safe."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ext = pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA backend")
from te_jax import _cuda  # noqa: E402,F401
from te_jax import aot  # noqa: E402


def _nvrtc_or_skip():
  try:
    return ext.nvrtc_version()
  except RuntimeError as e:
    pytest.skip(f"NVRTC not available (pip install nvidia-cuda-nvrtc): {e}")


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("TE_JAX_CACHE_DIR", str(tmp_path))
  return tmp_path


def test_ci_configurations_compile(cache_dir):
  _nvrtc_or_skip()
  # sm_80 too (no vector float atomics there), on the cheapest head dim.
  configs = aot.config_set("ci", "sm_90a") + [c for c in aot.config_set("ci", "sm_80") if c["head_dim"] == 8]
  assert aot.compile_all(configs, jobs=os.cpu_count() or 1, log=lambda s: None) == []
  # Configurations that run the same module (e.g. both backwards at d = 256) share one cubin.
  assert len(list(pathlib.Path(cache_dir).glob("*.cubin"))) == len({ext.kernel_name(c) for c in configs})


def _fresh_process_compile(config, env):
  code = ("import sys, json; from te_jax import _cuda; from te_jax import _te_jax_cuda as ext; "
          f"print(json.dumps(ext.compile({config!r})))")
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  import json
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_disk_cache_hit_and_corruption(cache_dir):
  _nvrtc_or_skip()
  config = dict(direction="forward", dtype=2, head_dim=16, head_dim_v=16, softcap=False, alibi=False, arch="sm_80")
  env = dict(os.environ, TE_JAX_CACHE_DIR=str(cache_dir))
  first = _fresh_process_compile(config, env)
  assert first["origin"] == "compiled"
  second = _fresh_process_compile(config, env)
  assert second["origin"] == "disk" and second["seconds"] < 1.0
  path = pathlib.Path(second["path"])
  data = bytearray(path.read_bytes())
  data[-10] ^= 0xFF  # corrupt the payload: the checksum must catch it
  path.write_bytes(bytes(data))
  third = _fresh_process_compile(config, env)
  assert third["origin"] == "compiled"
  assert _fresh_process_compile(config, env)["origin"] == "disk"


def test_concurrent_compiles_of_one_key(cache_dir):
  _nvrtc_or_skip()
  config = dict(direction="forward", dtype=1, head_dim=24, head_dim_v=24, softcap=True, alibi=False, arch="sm_80")
  env = dict(os.environ, TE_JAX_CACHE_DIR=str(cache_dir))
  code = ("from te_jax import _cuda; from te_jax import _te_jax_cuda as ext; "
          f"print(ext.compile({config!r})['origin'])")
  procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
  assert all(p.wait() == 0 for p in procs)
  files = list(pathlib.Path(cache_dir).iterdir())
  assert len(files) == 1 and files[0].suffix == ".cubin", files  # no temporary files left behind
  assert _fresh_process_compile(config, env)["origin"] == "disk"


def test_compile_error_is_a_python_exception(cache_dir):
  _nvrtc_or_skip()
  with pytest.raises(ValueError):
    ext.compile(dict(direction="forward", dtype=0, head_dim=64, head_dim_v=64, softcap=False, alibi=False,
                     arch="sm_90a"))
  with pytest.raises(RuntimeError, match="NVRTC"):
    ext.compile(dict(direction="forward", dtype=1, head_dim=64, head_dim_v=64, softcap=False, alibi=False,
                     arch="sm_not_an_arch"))


@pytest.mark.parametrize("level,shown", [(None, True), ("WARNING", False)])
def test_compile_line_reaches_stderr_by_default(level, shown):
  """A jit-time compile takes seconds, so its line is printed unless the program configured logging or silenced it."""
  env = {k: v for k, v in os.environ.items() if k != "TE_JAX_LOG_LEVEL"}
  if level:
    env["TE_JAX_LOG_LEVEL"] = level
  code = ("from te_jax import _cuda; _cuda._log_report(dict(origin='compiled', name='fwd_bf16_d64_dv64_scaled_sm_90a', "
          "seconds=1.5, path='/cache/x.cubin'), 'auto: measured')")
  result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  line = "te_jax: compiled CUDA kernel fwd_bf16_d64_dv64_scaled_sm_90a in 1.50 s (/cache/x.cubin); engine te: auto: measured"
  assert (line in result.stderr) == shown, result.stderr


def _backward_params(d, dv, deterministic, batch=2, seqlen_q=100, heads=4):
  return dict(batch=batch, seqlen_q=seqlen_q, seqlen_kv=90, num_heads=heads, num_kv_heads=2, head_dim=d,
              head_dim_v=dv, dtype=1, mask_type=1, window_left=-1, window_right=-1, scale=0.1, softcap=0.0,
              has_alibi=False, deterministic=deterministic)


@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (40, 72), (96, 32)])
def test_backward_workspace_holds_the_float_dq_accumulator(d, dv):
  # The default backward (either family) needs a float dq for every (b, i, h) and every column, with Sq rounded up to
  # its 64-query tiles; the deterministic one needs nothing.
  need = ext.workspace_bytes(_backward_params(d, dv, False), 'backward')
  assert need >= 2 * 128 * 4 * d * 4
  assert need % 16 == 0
  assert ext.workspace_bytes(_backward_params(d, dv, True), 'backward') == 0


def test_large_head_dims_run_the_deterministic_backward():
  # For D + Dv > 256 the default backward is the three-kernel module (faster there): no workspace, one module.
  assert ext.workspace_bytes(_backward_params(256, 256, False), 'backward') == 0
  assert ext.workspace_bytes(_backward_params(256, 128, False), 'backward') == 0
  names = {ext.kernel_name(dict(direction="backward", deterministic=det, dtype=1, head_dim=256, head_dim_v=256,
                                softcap=False, alibi=False, arch="sm_90a")) for det in (False, True)}
  assert names == {"bwd_det_bf16_d256_dv256_scaled_sm_90a_sm90_64x64"}
  # Up to 128 the sm90 family serves the backward on sm_90a, with a module per scheme.
  names = [ext.kernel_name(dict(direction="backward", deterministic=det, dtype=1, head_dim=128, head_dim_v=128,
                                softcap=False, alibi=False, arch="sm_90a")) for det in (False, True)]
  assert names == ["bwd_bf16_d128_dv128_scaled_sm_90a_sm90_128x64", "bwd_det_bf16_d128_dv128_scaled_sm_90a_sm90_128x64"]
  assert ext.kernel_name(dict(direction="backward", dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False,
                              arch="sm_80")) == "bwd_bf16_d128_dv128_scaled_sm_80"


def test_sm90_forward_has_a_three_consumer_kernel_for_the_plain_product_at_head_dim_64():
  # The module name gives its first kernel's tile: 192 rows (three consumer warpgroups) where both head dims pad to 64
  # and the variant is the plain product; soft-cap, ALiBi, tokens and dropout keep 128 rows (they would spill).
  base = dict(direction="forward", dtype=1, head_dim=64, head_dim_v=64, softcap=False, alibi=False, arch="sm_90a")
  assert ext.kernel_name(base) == "fwd_bf16_d64_dv64_scaled_sm_90a_sm90_192x128"
  assert ext.kernel_name(dict(base, head_dim=56, head_dim_v=40)).endswith("_sm90_192x128")
  for feature in (dict(softcap=True), dict(alibi=True), dict(tokens=True), dict(dropout=True), dict(head_dim_v=72)):
    assert ext.kernel_name(dict(base, **feature)).endswith("_sm90_128x128"), feature
  assert ext.kernel_name(dict(base, head_dim=128, head_dim_v=128)).endswith("_sm90_128x128")


PERSISTENT = "te_jax_attention_forward_persistent"
ONE_CTA_PER_BLOCK = "te_jax_attention_forward"


@pytest.mark.parametrize("d, seqlen, causal, entry", [
    (128, 16384, False, PERSISTENT),        # two consumer warpgroups elsewhere: every call
    (128, 32768, True, PERSISTENT),
    (72, 9000, True, PERSISTENT),           # pads to 128
    (64, 1024, False, PERSISTENT),          # three consumer warpgroups elsewhere: up to 8 key tiles,
    (64, 1025, False, ONE_CTA_PER_BLOCK),
    (64, 2048, True, PERSISTENT),           # causal up to 16
    (64, 2049, True, ONE_CTA_PER_BLOCK),
    (256, 512, True, ONE_CTA_PER_BLOCK),    # no persistent kernel above 128
])
def test_which_sm90_forward_kernel_a_call_takes(d, seqlen, causal, entry, monkeypatch):
  monkeypatch.delenv("TE_JAX_SM90_PERSISTENT", raising=False)
  params = dict(_backward_params(d, d, False), seqlen_q=seqlen, seqlen_kv=seqlen, mask_type=int(causal))
  assert ext.call_forward_entry(params, "sm_90a") == entry
  monkeypatch.setenv("TE_JAX_SM90_PERSISTENT", "auto")
  assert ext.call_forward_entry(params, "sm_90a") == entry


H200 = dict(multiprocessors=132, smem_per_multiprocessor=233472)
A100 = dict(multiprocessors=108, smem_per_multiprocessor=167936)


def _decode_params(batch, seqlen_kv, d=128, seqlen_q=1, heads=32, kv_heads=8):
  return dict(batch=batch, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
              head_dim_v=d, dtype=1, mask_type=2, window_left=-1, window_right=-1, scale=0.1, softcap=0.0,
              has_alibi=False, deterministic=False)  # causal_bottom_right


@pytest.mark.parametrize("gpu, params, entry, splits", [
    # One 16-row tile per K/V head whose CTAs fit in one wave of the shallow ring's 396 slots (3 an SM): the shallow
    # ring, split to fill them (b 8 x 32k: 6 splits of 64 CTAs).
    (H200, _decode_params(8, 32768), "te_jax_attention_decode_rows16_shallow", 6),
    (H200, _decode_params(8, 1024), "te_jax_attention_decode_rows16_shallow", 6),
    (H200, _decode_params(48, 4096), "te_jax_attention_decode_rows16_shallow", 1),  # 384 CTAs: one wave
    # More CTAs than that wave: the deep ring (264 slots), in whole waves of its own.
    (H200, _decode_params(64, 4096), "te_jax_attention_decode_rows16", 1),
    # 16 positions of 4 heads: the 64-row tile, on the shallow ring (264 slots); d 256: one ring (two stages, 132 slots).
    (H200, _decode_params(8, 8192, seqlen_q=16), "te_jax_attention_decode_rows64", 4),
    (H200, _decode_params(8, 32768, d=256), "te_jax_attention_decode_rows16", 2),
    # An A100's 164 KB: two shallow CTAs an SM (216 slots) against one deep (108). 64 CTAs split in 10 fill three waves
    # (640 of 648 slots) where 3 splits would fill one to 89%; 256 CTAs would run as 2.4 waves of the deep ring, the
    # last at full time: two splits run 4.7 waves of half the keys.
    (A100, _decode_params(8, 32768), "te_jax_attention_decode_rows16_shallow", 10),
    (A100, _decode_params(32, 4096), "te_jax_attention_decode_rows16", 2),
])
def test_which_decode_kernel_and_splits_a_call_takes(gpu, params, entry, splits):
  g = ext.call_decode_geometry(params, "sm_90a" if gpu is H200 else "sm_80", **gpu)
  assert (g["entry"], g["splits"]) == (entry, splits)


def test_an_fp8_cache_splits_its_keys_into_whole_waves():
  # An FP8 cache at d 128 holds three CTAs an SM by its registers (~160 a thread): b 64 x 4k's 512 CTAs would run as
  # 1.3 waves of 396 slots, the second at full time (seen on an H100: 2.0 TB/s against the bf16 cache's 3.0); three
  # splits run four waves of a third of the keys. The bf16 cache's 264 slots take the same CTAs whole.
  params = dict(_decode_params(64, 4096), kv_format=1, kv_descale_blocks=1, kv_descale_heads=8)
  g = ext.call_decode_geometry(params, "sm_90a", **H200, registers=[160] * 4)
  assert (g["entry"], g["splits"], g["ctas_per_split"]) == ("te_jax_attention_decode_rows16", 3, 512)
  assert ext.call_decode_geometry(_decode_params(64, 4096), "sm_90a", **H200)["splits"] == 1


@pytest.mark.parametrize("seed", range(4))
def test_decode_workspace_holds_every_gpus_splits(seed):
  # The workspace is sized at lowering for the most splits any GPU takes: never fewer than a call takes on a given one.
  rng = np.random.default_rng(seed)
  for _ in range(50):
    kv_heads = int(rng.choice([1, 2, 4, 8]))
    params = _decode_params(int(rng.integers(1, 80)), int(rng.integers(1, 200000)), d=int(rng.choice([64, 128, 256])),
                            seqlen_q=int(rng.integers(1, 17)), heads=kv_heads * int(rng.choice([1, 2, 4, 8])),
                            kv_heads=kv_heads)
    for gpu, arch in ((H200, "sm_90a"), (A100, "sm_80")):
      g = ext.call_decode_geometry(params, arch, **gpu)
      rows = params["batch"] * params["seqlen_q"] * params["num_heads"]
      need = g["splits"] * rows * (params["head_dim_v"] + 1) * 4 if g["splits"] > 1 else 0
      assert ext.workspace_bytes(params, "forward") >= need, (params, g)
      assert g["splits"] * g["ctas_per_split"] <= max(g["ctas_per_split"], 2048)


def test_persistent_forward_override(monkeypatch):
  # TE_JAX_SM90_PERSISTENT=1 takes the persistent kernel wherever the module has one (the plain product up to d 128 on
  # sm_90a), =0 never; any other value is an error naming the variable and its values.
  long = dict(_backward_params(128, 128, False), seqlen_q=8192, seqlen_kv=8192)
  short = dict(long, seqlen_q=512, seqlen_kv=512)
  monkeypatch.setenv("TE_JAX_SM90_PERSISTENT", "1")
  assert ext.call_forward_entry(long, "sm_90a") == PERSISTENT
  for no_persistent_kernel in (dict(long, head_dim=256, head_dim_v=256), dict(long, softcap=5.0),
                               dict(long, has_alibi=True)):
    assert ext.call_forward_entry(no_persistent_kernel, "sm_90a") == ONE_CTA_PER_BLOCK
  assert ext.call_forward_entry(long, "sm_80") == ONE_CTA_PER_BLOCK
  monkeypatch.setenv("TE_JAX_SM90_PERSISTENT", "0")
  assert ext.call_forward_entry(short, "sm_90a") == ONE_CTA_PER_BLOCK
  monkeypatch.setenv("TE_JAX_SM90_PERSISTENT", "yes")
  with pytest.raises(ValueError, match="TE_JAX_SM90_PERSISTENT must be auto, 0 or 1"):
    ext.call_forward_entry(short, "sm_90a")


def test_sm90_forward_modules_hold_their_persistent_kernel():
  # The plain product's module at d <= 128 holds the persistent kernel after its first; others hold one kernel (and
  # the token kernels with tokens).
  base = dict(direction="forward", dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, arch="sm_90a")
  assert f"{PERSISTENT}(" in ext.render_source(base)
  assert f"{PERSISTENT}(" in ext.render_source(dict(base, head_dim=64, head_dim_v=64))
  for other in (dict(head_dim=256, head_dim_v=256), dict(softcap=True), dict(tokens=True), dict(dropout=True),
                dict(arch="sm_80")):
    assert f"{PERSISTENT}(" not in ext.render_source(dict(base, **other)), other


def test_sm90_token_forward_modules_hold_the_document_kernels_where_the_product_is_plain():
  # A packed call's forward module at d <= 128 without soft-cap, ALiBi, dropout or a bias also holds the persistent
  # kernel over the document table and the table's kernel, after the token kernel and before the token tables'.
  base = dict(direction="forward", dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, tokens=True,
              arch="sm_90a")
  entries = ["te_jax_attention_forward(", "te_jax_attention_forward_documents(", "te_jax_document_table(",
             "te_jax_token_tables(", "te_jax_token_spans("]
  for plain in (base, dict(base, head_dim=64, head_dim_v=64)):
    source = ext.render_source(plain)
    assert all(e in source for e in entries) and sorted(entries, key=source.index) == entries
    assert "ForwardKernel<te_jax::cuda::BFloat16, 128, 128, te_jax::LogitsVariant<false, false, false, false>, 2, " \
           "true, true>" in ext.render_source(base)
  for other in (dict(head_dim=256, head_dim_v=256), dict(softcap=True), dict(alibi=True), dict(dropout=True),
                dict(tokens=False), dict(arch="sm_80")):
    assert "te_jax_document_table(" not in ext.render_source(dict(base, **other)), other


def test_sm90_token_backward_modules_hold_the_document_kernels_where_the_product_is_plain():
  # A packed call's backward module accumulating dq, without soft-cap, ALiBi, dropout or a bias, also holds the plain
  # product's dk/dv kernel over the document table (entry 3) and the table's kernel (entry 4), before the token
  # tables'.
  base = dict(direction="backward", dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, tokens=True,
              arch="sm_90a")
  entries = ["te_jax_attention_backward_preprocess(", "te_jax_attention_backward_dkdv_dq(",
             "te_jax_attention_backward_dq_convert(", "te_jax_attention_backward_dkdv_dq_documents(",
             "te_jax_document_table(", "te_jax_token_tables(", "te_jax_token_spans("]
  for plain in (base, dict(base, head_dim=64, head_dim_v=64)):
    source = ext.render_source(plain)
    assert all(e in source for e in entries) and sorted(entries, key=source.index) == entries
  assert "BackwardKernel<te_jax::cuda::BFloat16, 128, 128, te_jax::LogitsVariant<false, false, false, false>, true, " \
         "true, true>" in ext.render_source(base)
  assert "DocumentTableKernel<128, 128, true, te_jax::cuda::BackwardArgs>" in \
      ext.render_source(dict(base, head_dim=64, head_dim_v=64))  # d 64: the plain product's 128-row steps
  for other in (dict(head_dim=256, head_dim_v=256), dict(softcap=True), dict(alibi=True), dict(dropout=True),
                dict(deterministic=True), dict(tokens=False), dict(arch="sm_80")):
    assert "te_jax_document_table(" not in ext.render_source(dict(base, **other)), other


def test_document_reading_override(monkeypatch):
  # Both directions read packed rows as documents by default (and with TE_JAX_SM90_DOCUMENTS=all), the forward alone
  # with "forward"; "0" neither; only modules with the document kernels; any other value is an error naming the values.
  packed = dict(_backward_params(128, 128, False), seqlen_q=2048, seqlen_kv=2048, has_segment_ids=True)
  for mode, forward, backward in ((None, True, True), ("forward", True, False), ("all", True, True),
                                  ("0", False, False)):
    if mode is None:
      monkeypatch.delenv("TE_JAX_SM90_DOCUMENTS", raising=False)
    else:
      monkeypatch.setenv("TE_JAX_SM90_DOCUMENTS", mode)
    assert ext.call_reads_documents(packed, "forward", "sm_90a") is forward, mode
    assert ext.call_reads_documents(packed, "backward", "sm_90a") is backward, mode
    assert not ext.call_reads_documents(dict(packed, softcap=5.0), "backward", "sm_90a")
    assert not ext.call_reads_documents(dict(packed, has_segment_ids=False), "forward", "sm_90a")
    assert not ext.call_reads_documents(packed, "forward", "sm_80")
  monkeypatch.setenv("TE_JAX_SM90_DOCUMENTS", "1")
  with pytest.raises(ValueError, match="TE_JAX_SM90_DOCUMENTS must be all, forward or 0"):
    ext.call_reads_documents(packed, "forward", "sm_90a")


def test_sm90_backward_steps_128_rows_at_head_dim_64_without_tokens_or_dropout():
  # The step's rows are in the module name: 128 where both head dims pad to 64, else 64 (tokens keep one granule per
  # step, dropout 32 keep bits per thread).
  base = dict(direction="backward", dtype=1, softcap=False, alibi=False, arch="sm_90a")
  assert ext.kernel_name(dict(base, head_dim=64, head_dim_v=64)) == "bwd_bf16_d64_dv64_scaled_sm_90a_sm90_128x128"
  assert ext.kernel_name(dict(base, head_dim=40, head_dim_v=64, deterministic=True)) == \
      "bwd_det_bf16_d40_dv64_scaled_sm_90a_sm90_128x128"
  assert ext.kernel_name(dict(base, head_dim=64, head_dim_v=72)).endswith("_sm90_128x64")
  assert ext.kernel_name(dict(base, head_dim=64, head_dim_v=64, tokens=True)).endswith("_tokens_sm_90a_sm90_128x64")
  assert ext.kernel_name(dict(base, head_dim=64, head_dim_v=64, dropout=True)).endswith("_dropout_sm_90a_sm90_128x64")


def test_sm90_backward_splits_columns_above_head_dim_128():
  # Where d or dv pads past 128 the CTA owns 64 rows and the consumer warpgroups split the accumulators' columns; the
  # default scheme's float dq block does not fit there, so a configuration that would accumulate dq (d + dv <= 256 in
  # the sm80 tuning, e.g. d 192, dv 64) stays on the sm80 family unless deterministic.
  base = dict(direction="backward", dtype=1, softcap=False, alibi=False, arch="sm_90a")
  assert ext.kernel_name(dict(base, head_dim=192, head_dim_v=128)) == "bwd_det_bf16_d192_dv128_scaled_sm_90a_sm90_64x64"
  assert ext.kernel_name(dict(base, head_dim=128, head_dim_v=256, tokens=True)).endswith("_tokens_sm_90a_sm90_64x64")
  assert ext.kernel_name(dict(base, head_dim=192, head_dim_v=64)) == "bwd_bf16_d192_dv64_scaled_sm_90a"
  assert ext.kernel_name(dict(base, head_dim=192, head_dim_v=64, deterministic=True)) == \
      "bwd_det_bf16_d192_dv64_scaled_sm_90a_sm90_64x64"
  assert ext.kernel_name(dict(base, head_dim=128, head_dim_v=128)).endswith("_sm90_128x64")


def test_bias_modules_families():
  # The sm90 family serves a bias whose rows TMA copies (bias_fits_tma) where its ring fits beside the tiles (the
  # forward of a float bias takes 64-key tiles, and at d = 256 the sm80 family; the backward steps 64 rows); the sm80
  # family serves the rest and every arch but sm_90a; never the decode kernels.
  base = dict(dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, arch="sm_90a")
  fwd = dict(base, direction="forward")
  assert ext.kernel_name(dict(fwd, bias_dtype=1, bias_fits_tma=True)) == \
      "fwd_bf16_d128_dv128_scaled_bias_bf16_sm_90a_sm90_128x128"
  assert ext.kernel_name(dict(fwd, bias_dtype=0, bias_fits_tma=True)) == \
      "fwd_bf16_d128_dv128_scaled_bias_f32_sm_90a_sm90_128x64"
  assert ext.kernel_name(dict(fwd, bias_dtype=0)) == "fwd_bf16_d128_dv128_scaled_bias_f32_sm_90a_sm80_128x32"
  assert ext.kernel_name(dict(fwd, head_dim=64, head_dim_v=64, bias_dtype=2, bias_fits_tma=True)).endswith(
      "_bias_fp16_sm_90a_sm90_128x128")  # two consumer warpgroups: the three-consumer kernel is the plain product's
  assert ext.kernel_name(dict(fwd, head_dim=256, head_dim_v=256, bias_dtype=1, bias_fits_tma=True)).endswith(
      "_sm90_128x64")
  assert "_sm80_" in ext.kernel_name(dict(fwd, head_dim=256, head_dim_v=256, bias_dtype=0, bias_fits_tma=True))
  assert "_sm80_" in ext.kernel_name(dict(fwd, bias_dtype=1, bias_fits_tma=True, arch="sm_80"))
  bwd = dict(base, direction="backward")
  assert ext.kernel_name(dict(bwd, bias_dtype=1)) == "bwd_bf16_d128_dv128_scaled_bias_bf16_sm_90a"
  assert ext.kernel_name(dict(bwd, bias_dtype=1, bias_fits_tma=True)) == \
      "bwd_bf16_d128_dv128_scaled_bias_bf16_sm_90a_sm90_128x64"
  assert ext.kernel_name(dict(bwd, head_dim=64, head_dim_v=64, bias_dtype=1, bias_fits_tma=True)).endswith(
      "_sm90_128x64")  # 64-row steps: a 128-row step's bias stages do not fit
  # The default scheme's dq block leaves no room for a float bias's stages at d 128; the deterministic one does.
  assert ext.kernel_name(dict(bwd, bias_dtype=0, bias_fits_tma=True)) == "bwd_bf16_d128_dv128_scaled_bias_f32_sm_90a"
  assert ext.kernel_name(dict(bwd, deterministic=True, bias_dtype=0, bias_fits_tma=True)).endswith("_sm90_128x64")
  assert ext.kernel_name(dict(bwd, deterministic=True, bias_dtype=2, tokens=True)) == \
      "bwd_det_bf16_d128_dv128_scaled_tokens_bias_fp16_sm_90a"
  assert ext.kernel_name(dict(fwd, bias_dtype=None)) == "fwd_bf16_d128_dv128_scaled_sm_90a_sm90_128x128"
  with pytest.raises(ValueError, match="bias_fits_tma applies to a bias"):
    ext.kernel_name(dict(bwd, bias_fits_tma=True))
  with pytest.raises(ValueError, match="decode kernels take no bias"):
    ext.kernel_name(dict(fwd, decode=True, bias_dtype=1))
  with pytest.raises(ValueError, match="bias_dtype must be"):
    ext.kernel_name(dict(fwd, bias_dtype=7))


@pytest.mark.parametrize("broadcast, seqlen_kv, bias_dtype, family", [
    (0b0000, 96, 1, "_sm90_128x128"),  # [B, H, Sq, Skv] bf16, rows of 192 bytes
    (0b0101, 96, 2, "_sm90_128x128"),  # [1, H, 1, Skv]: a query-broadcast bias stages one row
    (0b0000, 92, 0, "_sm90_128x64"),   # float rows of 368 bytes: the float bias's 64-key tiles
    (0b0000, 90, 1, "_sm80_128x32"),   # rows of 180 bytes: not whole 16-byte chunks
    (0b1000, 96, 1, "_sm80_128x32"),   # [B, H, Sq, 1]: broadcast along the keys
])
def test_which_family_serves_a_bias_call(broadcast, seqlen_kv, bias_dtype, family):
  params = dict(_backward_params(128, 128, False), seqlen_kv=seqlen_kv, has_bias=True, bias_dtype=bias_dtype,
                bias_broadcast=broadcast)
  assert ext.call_kernel_name(params, "forward", "sm_90a").endswith(family)
  backward = ext.call_kernel_name(params, "backward", "sm_90a")
  assert backward.endswith("_sm90_128x64" if bias_dtype > 0 and "sm90" in family else "_sm_90a"), backward
  assert "_sm80_" in ext.call_kernel_name(params, "forward", "sm_80")


def test_the_tests_set_holds_the_modules_the_bias_cases_run():
  # tests/test_cuda_bias.py's cases take the modules the "tests" AOT set precompiles (its bias_fits_tma, computed in
  # Python, agrees with the core's BiasFitsTma), so a GPU run compiles none of them at test time.
  from te_jax._cuda_test_configs import BIAS_CASES  # noqa: PLC0415
  names = {ext.kernel_name(c) for c in aot.config_set("tests", "sm_90a")}
  dtypes = {"bfloat16": 1, "float16": 2, "float32": 0}
  for case, pattern, bias_dtype in BIAS_CASES:
    params = dict(batch=case[2], seqlen_q=case[3], seqlen_kv=case[4], num_heads=case[5], num_kv_heads=case[6],
                  head_dim=case[7], head_dim_v=case[8], dtype=dtypes[case[1]], mask_type=1, window_left=-1,
                  window_right=-1, scale=0.1, softcap=case[11], has_alibi=case[12], has_bias=True,
                  bias_dtype=dtypes[bias_dtype],
                  bias_broadcast=sum(1 << i for i, keep in enumerate(pattern) if keep == "1"))
    for direction, deterministic in (("forward", False), ("backward", False), ("backward", True)):
      name = ext.call_kernel_name(dict(params, deterministic=deterministic), direction, "sm_90a")
      assert name in names, (case[0], name)


def test_backward_workspace_holds_a_summed_dbias_accumulator():
  # dbias sums over a broadcast dim: a float32 accumulator of the bias's shape after the dq accumulator (256-byte
  # aligned); a full-shape bias is written directly and needs nothing.
  def params(deterministic, broadcast):
    return dict(_backward_params(64, 64, deterministic), has_bias=True, bias_dtype=1, bias_broadcast=broadcast)

  dq_accum = ext.workspace_bytes(_backward_params(64, 64, False), "backward")
  assert ext.workspace_bytes(params(False, 0), "backward") == dq_accum
  assert ext.workspace_bytes(params(True, 0), "backward") == 0
  bias_elements = 4 * 100 * 90  # [1, H, Sq, Skv] of [2, 4, 100, 90]
  assert ext.workspace_bytes(params(False, 0b0001), "backward") == (dq_accum + 255) // 256 * 256 + 4 * bias_elements
  assert ext.workspace_bytes(params(False, 0b1111), "backward") == (dq_accum + 255) // 256 * 256 + 4


def test_modules_with_mods_compile_and_are_named_by_them(cache_dir):
  """A score_mod (a captured table, so its kernels add capture gradients) and a mask_mod compile into the sm90 forward
  and backward; the modules are named by the mods' hashes, and the sm80 family refuses them."""
  _nvrtc_or_skip()
  import jax.numpy as jnp
  from te_jax import flex
  from te_jax.flex.cuda_source import source_path
  table = jnp.zeros((4, 64))
  score = flex.translate_score_mod(lambda s, b, h, q, kv: s + table[h, jnp.clip(q - kv + 32, 0, 63)])
  mask = flex.translate_mask_mod(lambda b, h, q, kv: (q >= kv) | (kv < 16))
  mods = dict(score_mod=source_path(score.spec(), str(cache_dir)), mask_mod=source_path(mask.spec(), str(cache_dir)))
  base = dict(dtype=1, head_dim=64, head_dim_v=64, softcap=False, alibi=False, arch="sm_90a", **mods)
  for direction in ("forward", "backward"):
    config = dict(base, direction=direction)
    name = ext.kernel_name(config)
    assert f"_score{score.key[-16:]}_mask{mask.key[-16:]}_" in name and "_sm90_" in name, name
    assert ext.compile(config)["origin"] == "compiled"
    assert "te_jax::flex::ScoreMod" in ext.render_source(config)
  with pytest.raises(ValueError, match="score_mod/mask_mod run in the sm90 kernels so far"):
    ext.kernel_name(dict(base, direction="forward", arch="sm_80"))


# An FP8 KV cache (kv_format 1 = e4m3, 2 = e5m2; cpp/core/kv_format.h) in the decode kernels: each module holds the
# one- and four-row-tile kernels (contiguous and paged calls alike), so these cover d 64 (padded cp.async stages), 112
# (56 byte-pair columns in a 64-column swizzled stage: TMA's boxes reach past the row), 128 (one swizzle row: TMA
# stages on sm_90a) and 256, dv above d (the epilogue then outgrows the half-size rings and the q tile) and below,
# both formats, the variants, and sm_89 (cp.async, the oldest arch with the FP8 conversions).
FP8_DECODE_CONFIGS = [
    dict(dtype=2, head_dim=64, head_dim_v=64, softcap=True, alibi=False, kv_format=1, arch="sm_90a"),
    dict(dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, kv_format=1, arch="sm_90a"),
    dict(dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=True, kv_format=2, arch="sm_90a"),
    dict(dtype=1, head_dim=256, head_dim_v=256, softcap=True, alibi=True, kv_format=1, arch="sm_90a"),
    dict(dtype=2, head_dim=256, head_dim_v=256, softcap=False, alibi=False, kv_format=2, arch="sm_90a"),
    dict(dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, kv_format=1, arch="sm_89"),
    dict(dtype=1, head_dim=112, head_dim_v=112, softcap=False, alibi=False, kv_format=1, arch="sm_90a"),
    dict(dtype=1, head_dim=64, head_dim_v=128, softcap=False, alibi=False, kv_format=1, arch="sm_90a"),
    dict(dtype=2, head_dim=128, head_dim_v=256, softcap=False, alibi=False, kv_format=2, arch="sm_90a"),
    dict(dtype=1, head_dim=32, head_dim_v=192, softcap=False, alibi=False, kv_format=1, arch="sm_89"),
    dict(dtype=1, head_dim=256, head_dim_v=64, softcap=False, alibi=False, kv_format=1, arch="sm_90a"),
]


def _fp8_request(**fields):
  return dict(direction="forward", decode=True, **fields)


def test_fp8_kv_decode_configurations_compile(cache_dir):
  _nvrtc_or_skip()
  configs = [_fp8_request(**c) for c in FP8_DECODE_CONFIGS]
  assert aot.compile_all(configs, jobs=os.cpu_count() or 1, log=lambda s: None) == []
  names = {ext.kernel_name(c) for c in configs}
  assert "dec_fp16_kv_e4m3_d64_dv64_softcap_sm_90a_decode_n64" in names
  assert "dec_bf16_kv_e5m2_d128_dv128_alibi_sm_90a_decode_n64" in names


def test_fp8_kv_decode_modules_name_their_format():
  # The kernels take the KV element as their last template argument; 16-bit K/V keep their names and their element.
  config = _fp8_request(dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False, kv_format=2, arch="sm_90a")
  assert "te_jax::LogitsVariant<false, false, false, false>, 1, 3, te_jax::cuda::E5M2>" in ext.render_source(config)
  plain = dict(config, kv_format=0)
  assert ext.kernel_name(plain) == "dec_bf16_d128_dv128_scaled_sm_90a_decode_n64"
  assert "1, 3, te_jax::cuda::BFloat16>" in ext.render_source(plain)


@pytest.mark.parametrize("change, arch, message", [
    (dict(seqlen_q=17), "sm_90a", "at most 16 query positions"),
    (dict(), "sm_80", "on sm_89 and newer"),
    (dict(head_dim=72, head_dim_v=72), "sm_90a", "multiples of 16"),
    (dict(has_bias=True, bias_dtype=1, bias_broadcast=0), "sm_90a", "at most 16 query positions"),
])
def test_fp8_kv_calls_the_decode_kernels_do_not_serve_are_refused(change, arch, message):
  params = dict(_decode_params(2, 100), kv_format=1)
  assert ext.call_kernel_name(params, "forward", "sm_90a") == "dec_bf16_kv_e4m3_d128_dv128_scaled_sm_90a_decode_n64"
  with pytest.raises(ValueError, match="read an FP8 KV cache in the decode kernels only: .*" + message):
    ext.call_kernel_name(dict(params, **change), "forward", arch)
  # The same decision, as the lowering asks it (te_jax/_primitives.py _refuse_unread_kv_cache).
  assert ext.fp8_kv_refusal(params, "forward", "sm_90a") is None
  assert re.search(message, ext.fp8_kv_refusal(dict(params, **change), "forward", arch))
  assert "the forward" in ext.fp8_kv_refusal(params, "backward", "sm_90a")
  with pytest.raises(ValueError, match="takes an FP8 KV cache call's params"):
    ext.fp8_kv_refusal(dict(params, kv_format=0), "forward", "sm_90a")


def test_fp8_kv_decode_takes_the_deep_ring_at_head_dim_256():
  # Half-size stages: at d 256 an FP8 stage is 16-bit d 128's 32 KB, so the module has the deep (three-stage) ring and
  # the shallow one, as 16-bit d 128's has; 16-bit d 256's has one ring (three entries).
  fp8 = _fp8_request(dtype=1, head_dim=256, head_dim_v=256, softcap=False, alibi=False, kv_format=1, arch="sm_90a")
  assert "te_jax_attention_decode_rows16_shallow(" in ext.render_source(fp8)
  assert "te_jax_attention_decode_rows16_shallow(" not in ext.render_source(dict(fp8, kv_format=0))
  # 16-bit K/V keep their depths: a head dim above 128 takes the two-stage ring, whatever the other's bytes.
  for d, dv in ((64, 192), (192, 64)):
    plain = dict(fp8, kv_format=0, head_dim=d, head_dim_v=dv)
    assert "te_jax_attention_decode_rows16_shallow(" not in ext.render_source(plain)


# FP8 attention (q, k and v FP8: q_format = kv_format, cpp/core/kv_format.h's codes; out in dtype) in the sm90
# forward's FP8 kernel: FP8 wgmma for both products, V^T stages, p packed to e4m3 in registers.
FP8_ATTENTION = dict(direction="forward", dtype=1, head_dim=128, head_dim_v=128, softcap=False, alibi=False,
                     kv_format=1, q_format=1, arch="sm_90a")


def test_fp8_attention_configurations_compile(cache_dir):
  _nvrtc_or_skip()
  configs = [FP8_ATTENTION, dict(FP8_ATTENTION, softcap=True, dtype=2),
             dict(FP8_ATTENTION, alibi=True, kv_format=2, q_format=2)]
  assert aot.compile_all(configs, jobs=os.cpu_count() or 1, log=lambda s: None) == []
  assert ext.kernel_name(FP8_ATTENTION) == "fwd_bf16_qkv_e4m3_d128_dv128_scaled_sm_90a_sm90_128x128"
  source = ext.render_source(FP8_ATTENTION)
  assert "te_jax::LogitsVariant<false, false, false, false>, 2, false, false, te_jax::cuda::E4M3>" in source
  assert "forward_persistent" not in source  # the one-CTA-per-block kernel alone


@pytest.mark.parametrize("change, message", [
    (dict(kv_format=2), "k and v in q's FP8 format"),
    (dict(head_dim=64, head_dim_v=64), r"head dims \(128, 128\) so far, not \(64, 64\)"),
    (dict(arch="sm_89"), "on sm_90a"),
    (dict(direction="backward"), "the forward"),
    (dict(decode=True), "the forward"),
    (dict(tokens=True), "without segment ids"),
    (dict(dropout=True), "without segment ids"),
])
def test_fp8_attention_the_kernel_does_not_serve_is_refused(change, message):
  with pytest.raises(ValueError, match="serve FP8 attention .* in the sm90 forward only: " + message):
    ext.kernel_name(dict(FP8_ATTENTION, **change))
