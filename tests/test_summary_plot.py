"""scripts/summary_plot.py draws BENCHMARKS.md's summary plot from the committed run data: every figure it reads is
there, and the ratios it draws are the tables' (spot checks)."""

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
  fwd = dict(plot._cuda_bench(f"{bench}/h200-sm90-fwd.json", "fwd", "fwd", [(128, 16384, True)]))
  assert fwd["fwd d128 s16k causal"] == pytest.approx(663 / 605, rel=0.01)  # run 14's table: 1.10
  fwd_bwd = dict(plot._cuda_bench(f"{bench}/h200-bwd64-steps128.json", "fwd+bwd", "f+b", [(64, 16384, True)]))
  assert fwd_bwd["f+b d64 s16k causal"] == pytest.approx(423.0 / 429.5, rel=0.01)  # run 33's table: 0.98
  decode = dict(plot._decode([f"{bench}/h200-decode.json"]))
  assert decode["decode b8 q1 kv8k"] == pytest.approx(94 / 92, rel=0.02)  # run 19's table: 1.03
  rounds = dict(plot._decode([f"{bench}/h200-decode-run65a-{r}.json" for r in (1, 2)]))
  assert rounds["decode b64 q1 kv4k"] == pytest.approx((0.996 * 0.990) ** 0.5, rel=0.002)  # run 65a, both rounds
  dropout = dict(plot._features(f"{bench}/h200-features.json", "dropout"))
  assert dropout["dropout fwd"] == pytest.approx(1.428 / 1.739)
  assert "bias fwd" not in dropout  # the bias's figures are run 46's, on the sm90 kernels
  bias = dict(plot._features(f"{bench}/h200-bias-sm90.json", "bias"))
  assert bias["bias fwd+bwd"] == pytest.approx(5.097 / 5.023, rel=0.01)  # run 46's table: 1.01
  out = tmp_path / "summary.png"
  plot.main(bench, str(out))
  assert out.stat().st_size > 10_000
