"""Shared pytest configuration for the te_jax tests.

Deliberately does NOT import jax (or te_jax) at module level: the sharding tests need to set the CPU device count
(XLA_FLAGS / jax_num_cpu_devices) before any JAX backend is initialised, and this file is imported first. Helpers that
need jax live in tests/helpers.py, which imports jax but never initialises a backend at import time.
"""

from __future__ import annotations

import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:  # so `import helpers` works under any import mode / rootdir
  sys.path.insert(0, TESTS_DIR)

# The tests exercise the installed te_jax (with its compiled extensions), never the bare source folder that
# `python -m pytest` run from the checkout would otherwise put first on sys.path.
_REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _REPO_ROOT]
os.environ["PYTHONSAFEPATH"] = "1"  # the same for the Python subprocesses tests start (`python -c` would add the cwd)


@pytest.fixture(params=["ffi", "legacy"])
def path(request):
  """Each custom-call path; tests using it run once per path."""
  return request.param


@pytest.fixture
def no_pending_legacy_failures():
  """Drains legacy failures recorded by earlier tests in this process, so a test that expects a failure sees only
  its own. Yields nothing."""
  import te_jax  # imported lazily, see the module docstring

  try:
    te_jax.raise_legacy_failures()
  except te_jax.legacy_failures.LegacyCustomCallError as e:
    pytest.fail(f"an earlier test left a legacy custom-call failure pending: {e}")
  yield
