"""scripts/cp_overlap.py (issue 14's overlap figure) on 4 of 8 virtual CPU devices, in a subprocess (the device count
is fixed at JAX's start): the ring's output matches the one-device call, every time is measured, the efficiency and
exposed communication follow from them, and a length the load-balanced layout cannot cut is refused by name."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "cp_overlap.py")
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
SMALL = ["--devices", "4", "--heads", "4", "--kv-heads", "2", "--dim", "32", "--dtype", "float32", "--calls", "1",
         "--samples", "1"]


def test_cp_overlap_reports_the_ring_against_one_device(tmp_path):
  json_path = tmp_path / "overlap.json"
  result = subprocess.run([sys.executable, SCRIPT, "--seq", "256,512", *SMALL, "--json", str(json_path)], env=ENV,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  rows = json.load(open(json_path))
  assert [r["seq"] for r in rows] == [256, 512]
  for r in rows:
    assert r["devices"] == 4 and r["ring_rel_err"] < 1e-5, r
    assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("one_ms", "ring_ms", "perm_ms")), r
    assert math.isclose(r["efficiency"], r["one_ms"] / (4 * r["ring_ms"]), rel_tol=1e-9)
    assert math.isclose(r["exposed_ms"], r["ring_ms"] - r["one_ms"] / 4, rel_tol=1e-9, abs_tol=1e-12)


def test_cp_overlap_refuses_a_length_the_layout_cannot_cut():
  result = subprocess.run([sys.executable, SCRIPT, "--seq", "100", *SMALL], env=ENV, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode != 0 and "--seq 100: a multiple of 2 x 4 devices" in result.stderr, result.stderr[-2000:]
