"""examples/generate.py at its tiny size on the CPU, as a user runs it: greedy decoding over a paged KV cache gives the
logits of a recomputation without the cache (float32 cache), and the FP8 cache stays within what e4m3 explains."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "generate.py")


def test_tiny_generation_with_paged_caches(tmp_path):
  summary = tmp_path / "summary.json"
  proc = subprocess.run([sys.executable, SCRIPT, "--check", "--summary-json", str(summary)], capture_output=True,
                        text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  result = json.loads(summary.read_text())
  model, fp8 = result["caches"]["model"], result["caches"]["fp8"]
  assert result["dtype"] == "float32" and model["tokens_per_s"] > 0 and fp8["tokens_per_s"] > 0
  assert len(model["tokens"]) == 2 and len(model["tokens"][0]) == 12
  # The cache holds exactly what a recomputation attends over: float32 rounding only.
  assert model["check_max_logit_diff"] < 1e-4, model["check_max_logit_diff"]
  # e4m3 keys and values (3 mantissa bits, a descale per page and head): a few percent of the logits' scale.
  assert 0 < fp8["cache_step_max_logit_diff"] < 0.1 * fp8["cache_step_logit_scale"], fp8
  assert fp8["check_max_logit_diff"] < 0.1 * fp8["cache_step_logit_scale"]
  assert any(line.lstrip().startswith("fp8 cache:") for line in proc.stdout.splitlines()), proc.stdout
