"""A mod's source for the CUDA kernels: the generated struct alone, which the kernel module renders into its
translation unit (cpp/cuda/kernel_module.cc) and NVRTC compiles with the kernels. It is written once into te_jax's
cache folder as flex-<kind>-<key>.cuh, the key the source's sha256, by which the module's name tells mods apart
(cpp/cuda/kernel_config.h), through a private temporary file renamed into place, as the CPU libraries are."""

from __future__ import annotations

import functools
import os
import pathlib
import tempfile


@functools.lru_cache(maxsize=None)
def source_path(spec, cache_dir: str) -> str:
  """The path of spec's (a te_jax.flex.ModSpec) source, written on a disk-cache miss."""
  path = pathlib.Path(cache_dir) / f"flex-{spec.kind}-{spec.key}.cuh"
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".flex-", suffix=".cuh", delete=False) as f:
      f.write(spec.source)
    os.chmod(f.name, 0o644)  # as readable as the cubins beside it
    os.replace(f.name, path)
  return str(path)
