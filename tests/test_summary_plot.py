"""scripts/summary_plot.py draws BENCHMARKS.md's summary plot from the committed data: every figure it reads is there,
and the ratios it draws are the tables' (spot checks against docs/BENCHMARKS.md's figures)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

pytest.importorskip("matplotlib")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _script():
  spec = importlib.util.spec_from_file_location("summary_plot", ROOT / "scripts" / "summary_plot.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_draws_the_summary_from_the_committed_data(tmp_path):
  plot = _script()
  bench = str(ROOT / "docs" / "bench")
  fwd = dict(plot._cuda_bench(f"{bench}/h200-fwd-bwd.json", "fwd", "fwd", [(128, 16384, True)]))
  assert fwd["fwd d128 s16k causal"] == pytest.approx(1.07, rel=0.01)  # the forward table's first round: 1.07
  fwd_bwd = dict(plot._cuda_bench(f"{bench}/h200-fwd-bwd.json", "fwd+bwd", "f+b", [(64, 16384, True)]))
  assert fwd_bwd["f+b d64 s16k causal"] == pytest.approx(1.05, rel=0.01)  # the forward + backward table: 1.05
  decode = dict(plot._decode([f"{bench}/h200-decode-round1.json"]))
  assert decode["decode b8 q1 kv8k"] == pytest.approx(76.4 / 74.5, rel=0.002)  # the H200 decode table, round 1
  rounds = dict(plot._decode([f"{bench}/h200-decode-round{r}.json" for r in (1, 2)]))
  assert rounds["decode b64 q1 kv4k"] == pytest.approx((0.990 * 0.982) ** 0.5, rel=0.002)  # both rounds
  h100 = dict(plot._decode([f"{bench}/h100-decode-round{r}.json" for r in (1, 2)]))
  assert h100["decode b64 q1 kv4k"] == pytest.approx((1.011 * 1.010) ** 0.5, rel=0.002)  # the H100's two rounds
  dropout = dict(plot._features(f"{bench}/h200-dropout.json", "dropout"))
  assert dropout["dropout fwd"] == pytest.approx(1.057 / 1.100, rel=0.001)
  bias = dict(plot._features(f"{bench}/h200-bias.json", "bias"))
  assert set(bias) == {"bias fwd", "bias fwd+bwd"}  # the [B, 1, 1, S] bias's rows (no cuDNN figure) are left out
  assert bias["bias fwd+bwd"] == pytest.approx(5.097 / 5.023, rel=0.01)  # the bias table: 1.01
  out = tmp_path / "summary.png"
  plot.main(bench, str(out))
  assert out.stat().st_size > 10_000
