"""The CUDA backend: registers the "cuda" platform with te_jax's backend registry and lowering when imported.

Kernels are compiled at lowering time (the `prepare` hook) by NVRTC for the GPU's exact arch, cached on disk
($TE_JAX_CACHE_DIR, default $XDG_CACHE_HOME/te_jax/cubin, else ~/.cache/te_jax/cubin) and loaded with the CUDA
driver; see cpp/cuda/kernel_registry.h.
Importing this module needs the `_te_jax_cuda` extension (built when CUDA headers were found at install time) but no
GPU, driver or NVRTC: those are loaded on first use, with an error naming what is missing.
"""

from __future__ import annotations

import functools
import glob
import importlib.metadata
import os
import pathlib

from te_jax import _logging
from te_jax import _te_jax_cuda as ext  # ImportError when te_jax was built without the CUDA backend
from te_jax._backends import Backend, register_backend
from te_jax._engine_choice import EngineTuner, table_choice
from te_jax._primitives import register_lowering
from te_jax.engine import Choice, EngineUnavailableError
from te_jax.flex.cuda_source import source_path

logger = _logging.logger.getChild("cuda")


def _kernel_root() -> str:
  """The folder holding cpp/cuda/kernels: te_jax/kernels in an installed package, else the source checkout."""
  here = pathlib.Path(__file__).resolve().parent
  for root in (here / "kernels", here.parent):
    if (root / "cpp" / "cuda" / "kernels").is_dir():
      return str(root)
  return str(here / "kernels")


def _wheel_libraries(*patterns: str) -> list[str]:
  """The pip CUDA wheels' copies of a library (nvidia/<pattern>, e.g. nvidia/cu13/lib/libnvrtc.so.13). The extension
  tries them after the path an environment variable names (TE_JAX_NVRTC_PATH, TE_JAX_CUDNN_PATH, TE_JAX_CUDART_PATH:
  when set, that path alone, and an error naming the variable if it does not load)."""
  paths = []
  try:
    import nvidia  # namespace package of the pip CUDA wheels
    for base in nvidia.__path__:
      for pattern in patterns:
        paths += sorted(glob.glob(os.path.join(base, pattern)))
  except ImportError:
    pass
  return paths


def _nvrtc_candidates() -> list[str]:
  """The pip wheel's NVRTC (nvidia-cuda-nvrtc: nvidia/cu13/lib or nvidia/cuda_nvrtc/lib)."""
  paths = _wheel_libraries(*(f"{sub}/libnvrtc.so.*[0-9]" for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib")))
  return [p for p in paths if "builtins" not in os.path.basename(p) and ".alt." not in os.path.basename(p)]


ext.set_kernel_root(_kernel_root())
ext.set_nvrtc_paths(_nvrtc_candidates())
ext.set_cudnn_paths(_wheel_libraries("cudnn/lib/libcudnn.so.9"), _wheel_libraries("cu13/lib/libcudart.so.13"))


def _log_report(report: dict, why: str) -> None:
  if report.get("note"):
    why = f"{why}; {report['note']}"
  if report["origin"] == "compiled":
    logger.info("te_jax: compiled CUDA kernel %s in %.2f s (%s); engine te: %s", report["name"], report["seconds"],
                report["path"], why)
  elif report["origin"] == "cudnn":
    logger.info("te_jax: %s on engine cudnn (cuDNN %s): %s", report["name"], ext.cudnn_version(), why)
  elif report["origin"] == "disk":
    logger.debug("te_jax: loaded CUDA kernel %s from the disk cache in %.3f s; engine te: %s", report["name"],
                 report["seconds"], why)


def prepare(params: dict, direction: str, why: str) -> None:
  """Lowering-time hook: compiles (or finds in the disk cache) and loads this configuration's kernels, or builds its
  cuDNN graph, so an error is a Python exception at jit time and the first execution does not stall."""
  _log_report(ext.prepare(params, direction), why)


def cudnn_refusal(params: dict, direction: str, config) -> str | None:
  """Why the cuDNN engine cannot serve this call, or None when it can."""
  available, reason = ext.cudnn_available()
  if not available:
    return reason
  if direction == "backward" and config.lse_cotangent:
    return ("its backward takes no gradient through lse, and this call's lse has one (return_lse=True, or context "
            "parallelism, which merges partial results by their lse)")
  return ext.cudnn_supports(params, direction)


@functools.lru_cache(maxsize=None)
def _tuner() -> EngineTuner:
  name, driver = ext.device_description()
  identity = dict(gpu=name, driver=driver, cudnn=ext.cudnn_version(), nvrtc=ext.nvrtc_version(),
                  te_jax=importlib.metadata.version("te_jax"), kernels=ext.kernel_sources_digest()[:16])
  cache = pathlib.Path(ext.cache_dir()).parent / "autotune"
  return EngineTuner(ext.time_attention, identity, cache)


def choose_engine(params: dict, direction: str, config) -> Choice:
  """Resolves config.engine for a call on this GPU (te_jax/engine.py)."""
  if config.engine == "te":
    return Choice("te", "requested (engine='te')")
  refusal = cudnn_refusal(params, direction, config)
  if config.engine == "cudnn":
    if refusal is not None:
      raise EngineUnavailableError(f"engine='cudnn' cannot run this {direction}: {refusal}")
    return Choice("cudnn", "requested (engine='cudnn')")
  if refusal is not None:
    return Choice("te", f"auto: cuDNN cannot serve it: {refusal}")
  if os.environ.get("TE_JAX_AUTOTUNE", "1") == "0":
    return table_choice(params, direction)
  return _tuner().choose(params, direction)


def fp8_kv_refusal(params: dict, direction: str, arch: str | None = None) -> str | None:
  """Why te_jax's CUDA kernels on this GPU (or `arch`) do not read this FP8 KV cache call, or None where its decode
  kernels do."""
  return ext.fp8_kv_refusal(params, direction, arch)


def _flex_source(spec) -> str:
  """A mod's generated source, which the sm90 kernels compile in (te_jax/flex/cuda_source.py)."""
  return source_path(spec, ext.cache_dir())


register_backend(Backend(platform="cuda", code=1, extension_name="_te_jax_cuda", legacy_api_version=2,
                         prepare=prepare, choose_engine=choose_engine, fp8_kv_refusal=fp8_kv_refusal,
                         flex_library=_flex_source))
register_lowering("cuda")
