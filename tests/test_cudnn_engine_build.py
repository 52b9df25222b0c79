"""The cuDNN engine is part of a plain install: where the environment te_jax was installed into has cuDNN 9's headers
(nvidia-cudnn-cu13's nvidia/cudnn/include, which JAX's CUDA plugin installs), the build compiled the engine, with the
frontend's headers from its build requirements. CI installs those headers before te_jax, so this proves the engine
compiles on every submission; without a GPU nothing of it runs."""

from __future__ import annotations

import os
import site
import sys
import sysconfig

import pytest


def _cudnn_headers() -> list[str]:
  dirs = sys.path + site.getsitepackages() + [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
  return sorted({os.path.join(d, "nvidia", "cudnn", "include") for d in dirs if d and
                 os.path.isfile(os.path.join(d, "nvidia", "cudnn", "include", "cudnn_version.h"))})


def test_the_cudnn_engine_is_built_where_the_environment_has_its_headers():
  ext = pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA extension")
  headers = _cudnn_headers()
  if not headers:
    pytest.skip("no nvidia/cudnn/include in this environment (nvidia-cudnn-cu13 is not installed)")
  assert ext.cudnn_built(), (f"cuDNN's headers are in {headers}, but te_jax's build did not compile its cuDNN engine: "
                             f"{ext.cudnn_available()[1]}")


def test_a_build_without_the_engine_says_how_to_get_it():
  ext = pytest.importorskip("te_jax._te_jax_cuda", reason="te_jax was built without its CUDA extension")
  if ext.cudnn_built():
    pytest.skip("this build has the cuDNN engine")
  available, reason = ext.cudnn_available()
  assert not available
  assert "nvidia-cudnn-cu13" in reason and "reinstall te_jax" in reason
