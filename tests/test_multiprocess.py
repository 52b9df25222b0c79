"""Two real processes on this machine (4 CPU devices each) joined by jax.distributed.initialize on localhost, one
global (dp=2, cp=4) mesh, train a tiny attention model with context parallelism; the losses must equal those of one
process running the same model unsharded (tests/multiprocess_train.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_train.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script sets its own device count
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _losses(output: str) -> list[float]:
  lines = [l for l in output.splitlines() if l.startswith("LOSSES ")]
  assert lines, output[-3000:]
  return json.loads(lines[-1][len("LOSSES "):])


@pytest.mark.parametrize("strategy", ["ring"])  # all_gather: tests/test_sharding.py; keeps CI short
def test_two_processes_match_one(strategy):
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, SCRIPT, "--num-processes", "2", "--process-id", str(i), "--port",
                             str(port), "--strategy", strategy], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env()) for i in range(2)]
  outputs = []
  try:
    for p in procs:
      out, _ = p.communicate(timeout=240)
      outputs.append(out)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-3000:]
  single = subprocess.run([sys.executable, SCRIPT, "--no-cp"], capture_output=True, text=True, env=_env(),
                          timeout=240)
  assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-2000:]
  reference = _losses(single.stdout)
  for out in outputs:
    np.testing.assert_allclose(_losses(out), reference, rtol=2e-5, atol=1e-6)
  assert reference[-1] < reference[0]  # it trains
