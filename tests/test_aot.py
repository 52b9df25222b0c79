"""`python -m te_jax.aot` as a command: its help, its argument errors, and one clean failure (exit 2, no traceback) when
no kernel can be compiled. Compiling itself is tests/test_cuda_nvrtc_compile.py's job."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

# Runs the command with the pip NVRTC wheel (the `nvidia` namespace package, which te_jax/_cuda.py searches) made
# unimportable, and optionally the CUDA extension too; NVRTC's loaded state is per process, hence a subprocess.
RUN_HIDING = """
import runpy, sys
for name in filter(None, sys.argv.pop(1).split(",")):
  sys.modules[name] = None
runpy.run_module("te_jax.aot", run_name="__main__", alter_sys=True)
"""


def _aot(*args, hide=("nvidia",), env=None):
  return subprocess.run([sys.executable, "-c", RUN_HIDING, ",".join(hide), *args], capture_output=True, text=True,
                        timeout=120, env=env)


def _system_nvrtc() -> str | None:
  """The soname te_jax falls back on after its search paths, if the dynamic loader finds one on this machine."""
  for soname in ("libnvrtc.so.13", "libnvrtc.so.12"):
    try:
      ctypes.CDLL(soname)
      return soname
    except OSError:
      pass
  return None


def test_help_shows_the_defaults():
  result = _aot("--help")
  assert result.returncode == 0, result.stderr
  text = " ".join(result.stdout.split())  # argparse wraps lines
  assert "(default: common)" in text and "(default: sm_90a)" in text
  assert "common, all-head-dims, ci, bench, tests" in text
  assert f"(default: {os.cpu_count()})" in text


@pytest.mark.parametrize("args,match", [
    (["--set", "common,nope"], "--set: unknown configuration set nope; known: common, all-head-dims, ci, bench, tests"),
    (["--jobs", "0"], "--jobs: must be a positive integer, got '0'"),
])
def test_bad_arguments_name_the_argument_and_the_allowed_values(args, match):
  result = _aot(*args)
  assert result.returncode == 2
  assert match in result.stderr and "Traceback" not in result.stderr


def test_missing_nvrtc_fails_once_with_what_was_searched(tmp_path):
  pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA extension")
  if _system_nvrtc():
    pytest.skip(f"the dynamic loader finds {_system_nvrtc()} on this machine, so NVRTC cannot be hidden")
  env = {k: v for k, v in os.environ.items() if k != "TE_JAX_NVRTC_PATH"}
  result = _aot("--set", "common", "--jobs", "2", env=dict(env, TE_JAX_CACHE_DIR=str(tmp_path / "cache")))
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stdout == ""  # no per-configuration lines, no summary
  err = result.stderr
  assert "Traceback" not in err and "FAILED" not in err
  assert err.startswith("python -m te_jax.aot: nothing compiled: ")
  assert err.count("could not be loaded") == 1
  assert "libnvrtc.so.13: " in err  # what it searched, with the loader's reason
  assert "pip install" in err and "te_jax[cuda]" in err
  assert not (tmp_path / "cache").exists()


def test_an_nvrtc_path_that_does_not_load_is_an_error_naming_the_variable(tmp_path):
  # The pip wheel's NVRTC stays importable: a path the user names is never silently replaced by another library.
  pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA extension")
  missing = str(tmp_path / "no-such-libnvrtc.so.13")
  result = _aot("--set", "common", "--jobs", "2", hide=(),
                env=dict(os.environ, TE_JAX_NVRTC_PATH=missing, TE_JAX_CACHE_DIR=str(tmp_path / "cache")))
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stdout == ""
  err = result.stderr
  assert "Traceback" not in err
  assert f"TE_JAX_NVRTC_PATH is set to {missing}, which could not be loaded" in err
  assert f"{missing}: " in err  # with the loader's reason
  assert not (tmp_path / "cache").exists()


def test_missing_cuda_extension_fails_with_an_explanation():
  result = _aot("--set", "ci", hide=("nvidia", "te_jax._te_jax_cuda"))
  assert result.returncode == 2, result.stdout + result.stderr
  assert "Traceback" not in result.stderr
  assert "installed without its CUDA backend" in result.stderr
