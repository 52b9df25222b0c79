"""The engine machinery without a GPU: the CUDA extension reports the cuDNN engine unavailable with its reason on a
machine (or build) without cuDNN; engine="auto" measures once per configuration and remembers the choice on disk;
a failed measurement falls back to the built-in table and says so; the length guard module compiles."""

from __future__ import annotations

import json
import logging

import pytest

from te_jax._engine_choice import EngineTuner, table_choice
from te_jax.attention_config import AttentionConfig
from te_jax.mask_type import MaskType


def test_cudnn_unavailable_with_a_reason():
  ext = pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA backend")
  available, reason = ext.cudnn_available()
  if available:
    pytest.skip("cuDNN is available here")
  # A build without the headers says how to get them; a build with them, on a machine without libcudnn, says what it
  # searched for.
  assert "nvidia-cudnn-cu13" in reason or "libcudnn" in reason, reason
  assert ext.cudnn_version() == ""


def test_length_guard_module_compiles(tmp_path, monkeypatch):
  ext = pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA backend")
  try:
    ext.nvrtc_version()
  except RuntimeError as e:
    pytest.skip(f"NVRTC not available: {e}")
  monkeypatch.setenv("TE_JAX_CACHE_DIR", str(tmp_path))
  config = {"kind": "length_guard", "arch": "sm_90a"}
  assert ext.kernel_name(config) == "length_guard_sm_90a"
  assert "EnforceLengthContract" in ext.render_source(config)
  assert ext.compile(config)["origin"] in ("compiled", "disk", "memory")


PARAMS = dict(batch=2, seqlen_q=1024, seqlen_kv=1024, num_heads=8, num_kv_heads=8, head_dim=128, head_dim_v=128,
              dtype=1, mask_type=1, window_left=-1, window_right=-1, scale=0.088, softcap=0.0, has_alibi=False,
              deterministic=False)


class FakeTimer:
  """Milliseconds per call for each engine code, counting the calls."""

  def __init__(self, te_ms, cudnn_ms, fail=False):
    self.ms = {0: te_ms, 1: cudnn_ms}
    self.fail = fail
    self.calls = []

  def __call__(self, params, direction):
    self.calls.append((params["engine"], direction))
    if self.fail:
      raise RuntimeError("te_jax engine timing could not allocate 123 bytes of scratch on the GPU")
    return self.ms[params["engine"]]


IDENTITY = dict(gpu="NVIDIA H200", driver=13000, cudnn="9.19.0", nvrtc="nvrtc 13.0", te_jax="0.1.0")


@pytest.mark.parametrize("te_ms,cudnn_ms,expected", [(2.0, 1.0, "cudnn"), (0.5, 1.0, "te")])
def test_auto_picks_the_faster_and_remembers_it(tmp_path, te_ms, cudnn_ms, expected):
  timer = FakeTimer(te_ms, cudnn_ms)
  choice = EngineTuner(timer, IDENTITY, tmp_path).choose(PARAMS, "forward")
  assert choice.engine == expected and choice.why.startswith("measured: ")
  assert sorted(timer.calls) == [(0, "forward"), (1, "forward")]
  records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
  assert len(records) == 1 and records[0]["engine"] == expected and records[0]["identity"] == IDENTITY
  # A fresh tuner (another process) reads the choice instead of measuring.
  again = FakeTimer(te_ms, cudnn_ms)
  choice = EngineTuner(again, IDENTITY, tmp_path).choose(PARAMS, "forward")
  assert choice.engine == expected and choice.why.startswith("measured earlier") and again.calls == []


def test_measurements_are_keyed_by_configuration_direction_and_identity(tmp_path):
  timer = FakeTimer(2.0, 1.0)
  tuner = EngineTuner(timer, IDENTITY, tmp_path)
  tuner.choose(PARAMS, "forward")
  tuner.choose(PARAMS, "forward")  # in memory: no new measurement
  tuner.choose(PARAMS, "backward")
  tuner.choose(dict(PARAMS, seqlen_q=2048, seqlen_kv=2048), "forward")
  EngineTuner(timer, dict(IDENTITY, cudnn="9.20.0"), tmp_path).choose(PARAMS, "forward")
  assert len(timer.calls) == 8 and len(list(tmp_path.glob("*.json"))) == 4


def test_the_lowerings_params_are_a_cache_key(tmp_path):
  # The params exactly as the lowering builds them (core fields, then the flex fields with their capture shapes).
  config = AttentionConfig(MaskType.CAUSAL, -1, -1, 0.125, 0.0, False)
  params = config.core_params((2, 256, 4, 64), (2, 256, 4, 64), (2, 256, 4, 64), "bfloat16")
  params.update(config.flex_params(("", ""), [(4, 1), (3,)], "forward"))
  timer = FakeTimer(2.0, 1.0)
  tuner = EngineTuner(timer, IDENTITY, tmp_path)
  assert tuner.choose(params, "forward") == tuner.choose(dict(params), "forward")
  assert len(timer.calls) == 2


def test_failed_measurement_uses_the_table_and_says_so(tmp_path, caplog):
  timer = FakeTimer(1.0, 1.0, fail=True)
  with caplog.at_level(logging.WARNING, logger="te_jax"):
    choice = EngineTuner(timer, IDENTITY, tmp_path).choose(PARAMS, "forward")
  assert choice == table_choice(PARAMS, "forward")
  assert "could not measure engine te" in caplog.text and "could not allocate" in caplog.text
  assert list(tmp_path.glob("*.json")) == []
