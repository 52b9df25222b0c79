"""The platforms te_jax lowers to, and what each needs at lowering time: its extension module (custom-call targets,
validation, descriptor packing), its custom-call API version for the legacy path, and an optional hook that prepares
kernels before the call is emitted (the CUDA backend compiles them there)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from typing import Any, Callable

import jax

from te_jax.engine import Choice, EngineUnavailableError
from te_jax.flex.cpu_library import library_path


@dataclasses.dataclass(frozen=True)
class Backend:
  platform: str  # JAX's lowering platform name
  code: int  # cpp/core/validate.h: Backend
  extension_name: str  # the nanobind module inside te_jax
  legacy_api_version: int  # XLA:CPU runs only 3, XLA:GPU 2 or 3 (docs/ARCHITECTURE.md)
  # (core params with the resolved engine, "forward"|"backward", why that engine) -> None
  prepare: Callable[[dict, str, str], None] | None = None
  # (core params, direction, AttentionConfig) -> Choice: resolves config.engine for this platform, raising
  # EngineUnavailableError for an explicit engine that cannot serve the call.
  choose_engine: Callable[[dict, str, Any], Choice] = lambda params, direction, config: _te_only(config)
  # Whether the backend serves FP8 attention (AttentionConfig.fp8): the CPU attends over the dequantized values in
  # float32, the reference; a backend without FP8 kernels refuses such a call at lowering.
  serves_fp8: bool = False
  # (core params, direction) -> why the backend's kernels do not read this FP8 KV cache call (k and v FP8 as they are,
  # q in its own dtype), or None where they do; consulted where serves_fp8 is False (None: no kernel reads one).
  fp8_kv_refusal: Callable[[dict, str], str | None] | None = None
  # (te_jax.flex.ModSpec) -> the path of what serves the mod (the CPU: its compiled library; CUDA: its generated source,
  # which the kernels compile in), made or found in the disk cache; None: the backend serves no score_mod / mask_mod
  # and refuses such a call at lowering.
  flex_library: Callable[[Any], str] | None = None

  def target_name(self, direction: str, path: str) -> str:
    return f"te_jax_attention_{direction}_{self.platform}_{path}"

  @functools.cached_property
  def extension(self) -> Any:
    try:
      return importlib.import_module(f"te_jax.{self.extension_name}")
    except ImportError as e:
      package_dir = os.path.dirname(os.path.abspath(__file__))
      if os.path.exists(os.path.join(os.path.dirname(package_dir), "CMakeLists.txt")):
        raise RuntimeError(f"te_jax was imported from its source folder {package_dir}, which has no compiled "
                           f"extension ({self.extension_name}): run from another directory after `pip install .`, "
                           "or install in place with `pip install -e .`") from e
      raise RuntimeError(f"te_jax was built without its {self.platform} backend ({self.extension_name}): {e}. "
                         "Reinstall te_jax with `pip install .` on a machine that can build it.") from e

  def ensure_registered(self) -> None:
    """Registers every custom-call target of this backend with XLA, once per process."""
    if self.platform in _registered_platforms:
      return
    xla_platform = {"cpu": "cpu", "cuda": "CUDA"}[self.platform]
    for name, capsule in self.extension.ffi_registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform=xla_platform, api_version=1)
      _registered_targets.append(name)
    for name, capsule in self.extension.legacy_registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform=xla_platform, api_version=0)
      _registered_targets.append(name)
    _registered_platforms.add(self.platform)


def _cpu_flex_library(spec) -> str:
  return library_path(spec, _BACKENDS["cpu"].extension.cache_dir())


def _te_only(config) -> Choice:
  """A platform with te_jax's kernels alone (the CPU)."""
  if config.engine == "cudnn":
    raise EngineUnavailableError("engine='cudnn' needs an NVIDIA GPU; on the CPU te_jax runs its own kernels "
                                 "(engine='te' or 'auto')")
  return Choice("te", "the only engine of this platform")


_registered_platforms: set[str] = set()
_registered_targets: list[str] = []

_BACKENDS: dict[str, Backend] = {
    "cpu": Backend(platform="cpu", code=0, extension_name="_te_jax_cpu", legacy_api_version=3, serves_fp8=True,
                   flex_library=_cpu_flex_library),
}


def register_backend(backend: Backend) -> None:
  _BACKENDS[backend.platform] = backend


def register_available_targets() -> None:
  """Registers the targets of every backend whose extension loads, at import: a process that runs a function
  serialised with `jax.export` calls te_jax's targets without lowering a te_jax call first. A backend whose extension
  fails to load is left to its first lowering, which raises the reason (`Backend.extension`)."""
  for backend in _BACKENDS.values():
    try:
      backend.ensure_registered()
    except RuntimeError:
      pass


def registered_targets() -> list[str]:
  """The custom-call targets registered in this process (both directions and both paths of each backend)."""
  return list(_registered_targets)


def loaded_extensions() -> list[Any]:
  """The extension modules of the backends that have registered targets in this process."""
  return [_BACKENDS[p].extension for p in sorted(_registered_platforms)]


def backend_for(platform: str) -> Backend:
  try:
    return _BACKENDS[platform]
  except KeyError:
    raise NotImplementedError(f"te_jax has no backend for platform {platform!r}; "
                              f"available: {', '.join(sorted(_BACKENDS))}") from None

