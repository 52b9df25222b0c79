"""The CUDA backend: registers the "cuda" platform with te_jax's backend registry and lowering when imported.

Kernels are compiled at lowering time (the `prepare` hook) by NVRTC for the GPU's exact arch, cached on disk
($TE_JAX_CACHE_DIR, default ~/.cache/te_jax/cubin) and loaded with the CUDA driver; see cpp/cuda/kernel_registry.h.
Importing this module needs the `_te_jax_cuda` extension (built when CUDA headers were found at install time) but no
GPU, driver or NVRTC: those are loaded on first use, with an error naming what is missing.
"""

from __future__ import annotations

import glob
import os
import pathlib

from te_jax import _logging
from te_jax import _te_jax_cuda as ext  # ImportError when te_jax was built without the CUDA backend
from te_jax._backends import Backend, register_backend
from te_jax._primitives import register_lowering

logger = _logging.logger.getChild("cuda")


def _kernel_root() -> str:
  """The folder holding cpp/cuda/kernels: te_jax/kernels in an installed package, else the source checkout."""
  here = pathlib.Path(__file__).resolve().parent
  for root in (here / "kernels", here.parent):
    if (root / "cpp" / "cuda" / "kernels").is_dir():
      return str(root)
  return str(here / "kernels")


def _nvrtc_candidates() -> list[str]:
  """$TE_JAX_NVRTC_PATH, then the pip wheel's NVRTC (nvidia-cuda-nvrtc: nvidia/cu13/lib or nvidia/cuda_nvrtc/lib)."""
  paths = []
  if os.environ.get("TE_JAX_NVRTC_PATH"):
    paths.append(os.environ["TE_JAX_NVRTC_PATH"])
  try:
    import nvidia  # namespace package of the pip CUDA wheels
    for base in nvidia.__path__:
      for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
        paths += sorted(glob.glob(os.path.join(base, sub, "libnvrtc.so.*[0-9]")))
  except ImportError:
    pass
  return [p for p in paths if "builtins" not in os.path.basename(p) and ".alt." not in os.path.basename(p)]


ext.set_kernel_root(_kernel_root())
ext.set_nvrtc_paths(_nvrtc_candidates())


def _log_report(report: dict) -> None:
  if report["origin"] == "compiled":
    logger.info("te_jax: compiled CUDA kernel %s in %.2f s (%s)", report["name"], report["seconds"], report["path"])
  elif report["origin"] == "disk":
    logger.debug("te_jax: loaded CUDA kernel %s from the disk cache in %.3f s", report["name"], report["seconds"])


def prepare(params: dict, direction: str) -> None:
  """Lowering-time hook: compiles (or finds in the disk cache) and loads this configuration's kernels, so a compile
  error is a Python exception at jit time and the first execution does not stall on NVRTC."""
  _log_report(ext.prepare(params, direction))


register_backend(Backend(platform="cuda", code=1, extension_name="_te_jax_cuda", legacy_api_version=2,
                         prepare=prepare))
register_lowering("cuda")
