"""examples/train_lm.py at its tiny size on the CPU, as a user runs it: with te_jax's attention the loss falls well
below its start, the loss curve PNG is written and the summary gives tokens/s; with JAX's attention the same run gives
the same losses (same seed, both float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_lm.py")


def _train(tmp_path, attention: str, *extra: str) -> tuple[dict, str]:
  tag = attention + "".join(extra).replace("-", "_")
  png, summary = tmp_path / f"loss_{tag}.png", tmp_path / f"summary_{tag}.json"
  proc = subprocess.run([sys.executable, SCRIPT, "--size", "tiny", "--attention", attention, "--plot", str(png),
                         "--summary-json", str(summary), *extra], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the loss curve is not a PNG"
  return json.loads(summary.read_text()), proc.stdout


def test_tiny_lm_trains_with_te_jax_and_matches_jax_attention(tmp_path):
  te, stdout = _train(tmp_path, "te_jax")
  assert te["attention"] == "te_jax" and te["backend"] == "cpu" and te["packing"] == "documents"
  assert te["last_loss"] < 0.6 * te["first_loss"], f"the loss did not fall: {te['first_loss']} -> {te['last_loss']}"
  assert te["tokens_per_s"] > 0
  assert any(line.startswith("summary:") and "tokens/s" in line for line in stdout.splitlines()), stdout[-2000:]
  assert te["total_s"] < 120, f"the tiny run took {te['total_s']:.0f} s on the CPU"
  ref, _ = _train(tmp_path, "jax")
  # Float32 on both sides; per-step differences ~1e-7 relative grow over 600 AdamW steps, but stay far below the
  # loss's own step-to-step noise.
  np.testing.assert_allclose(te["losses"], ref["losses"], rtol=1e-2)
  np.testing.assert_allclose(te["last_loss"], ref["last_loss"], rtol=2e-3)


def test_tiny_lm_trains_with_fp8_attention_close_to_full_precision(tmp_path):
  """--fp8: fused_attn(fp8=True), q, k, v quantized to e4m3 each step with straight-through gradients: the loss falls
  as far as the full-precision run's, within a few percent."""
  fp8, stdout = _train(tmp_path, "te_jax", "--fp8")
  assert fp8["fp8"] and "attention te_jax fp8" in stdout
  full, _ = _train(tmp_path, "te_jax")
  assert fp8["last_loss"] < 0.6 * fp8["first_loss"]
  np.testing.assert_allclose(fp8["last_loss"], full["last_loss"], rtol=0.05)
  assert fp8["losses"] != full["losses"]  # the quantization does change the run


def test_tiny_lm_packed_as_plain_causal_rows(tmp_path):
  """--packing rows (each row one causal sequence) on the CPU, a short run."""
  summary, _ = _train(tmp_path, "te_jax", "--packing", "rows", "--steps", "60", "--no-progress")
  assert summary["packing"] == "rows" and summary["last_loss"] < 0.7 * summary["first_loss"]
