"""A mod's CPU library: its tile source (tile_source.py) compiled into a shared library at lowering, cached on disk
beside the CUDA cubins (the CPU extension's cache_dir(): $TE_JAX_CACHE_DIR, ...) as flex-<kind>-<key>.so, the key a
sha256 of the source, the compiler's identity and the flags. A process finds a library another process compiled on
disk and compiles nothing; writers compile into a private temporary file and rename it into place (atomic on POSIX), so
concurrent compiles of one key are safe. The CPU kernels dlopen the library by its path (cpp/cpu/flex_tiles.h).

The compiler is the one CMake built the extension with (cpu_compiler.txt, installed beside it) if it still exists, else
$CXX, else c++ or g++ on PATH; its --version text, part of the key, is kept in the cache folder too. The headers the
source includes are installed in the package's flex_include folder, or read from the source checkout."""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
import time

from te_jax import _logging
from te_jax.flex.tile_source import tile_source

logger = _logging.logger.getChild("flex")

# No -march (the cache may be shared by machines of different CPUs) and no -ffast-math (the mods' NaN and infinity
# semantics, docs/flex_attention.md); -fno-math-errno lets sqrt inline.
FLAGS = ("-std=c++17", "-O2", "-fno-math-errno", "-fPIC", "-shared")
_PACKAGE = pathlib.Path(__file__).parent.parent  # where the extension is installed (links not followed)
_RECORDED = _PACKAGE / "cpu_compiler.txt"


def include_root() -> pathlib.Path:
  """The folder holding cpp/core/flex_mods.h and the headers it and the generated struct include: the package's
  flex_include, else the source checkout this file lies in."""
  roots = (_PACKAGE / "flex_include", pathlib.Path(__file__).resolve().parents[2])
  for root in roots:
    if (root / "cpp" / "core" / "flex_mods.h").is_file():
      return root
  raise RuntimeError(f"te_jax's score_mod/mask_mod headers are missing: neither of {', '.join(map(str, roots))} "
                     "holds cpp/core/flex_mods.h; reinstall te_jax")


@functools.lru_cache(maxsize=None)
def compiler(cache_dir: str) -> tuple[str, str]:
  """(the compiler's path, its --version text), or a RuntimeError naming every place tried."""
  tried = []
  candidates = []
  if _RECORDED.exists():
    candidates.append((f"the compiler CMake used ({_RECORDED})", _RECORDED.read_text().strip()))
  if os.environ.get("CXX"):
    candidates.append(("$CXX", os.environ["CXX"]))
  candidates += [("PATH", "c++"), ("PATH", "g++")]
  for where, name in candidates:
    path = shutil.which(name)
    if path is None:
      tried.append(f"{name} ({where})")
      continue
    return path, _version(path, pathlib.Path(cache_dir))
  raise RuntimeError("score_mod/mask_mod on the CPU are compiled at run time with a C++17 compiler, and none was "
                     f"found; tried: {', '.join(tried)}. Install one (g++ or clang++) or set CXX to its path")


def _version(path: str, cache_dir: pathlib.Path) -> str:
  """`path --version`, kept in the cache folder per binary (its real path, inode, size and modification time): running
  it took 2-7 ms of each process's first call with a mod, reading the record takes 0.1."""
  real = os.path.realpath(path)
  stat = os.stat(real)
  binary = "\0".join(map(str, (real, stat.st_ino, stat.st_size, stat.st_mtime_ns)))
  record = cache_dir / f"compiler-{hashlib.sha256(binary.encode()).hexdigest()[:32]}.txt"
  try:
    return record.read_text()
  except OSError:
    pass
  logger.debug("te_jax: running %s --version for the libraries' cache key", path)
  version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
  try:  # a private file renamed into place, as the libraries are; a folder we cannot write only costs the next run
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=cache_dir, prefix=".compiler-", delete=False) as file:
      file.write(version)
    os.replace(file.name, record)
  except OSError:
    pass
  return version


def library_key(source: str, compiler_identity: tuple[str, str]) -> str:
  return hashlib.sha256("\0".join([source, *compiler_identity, *FLAGS]).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def library_path(spec, cache_dir: str) -> str:
  """The path of spec's (a te_jax.flex.ModSpec) compiled library, compiling it on a disk-cache miss."""
  source = tile_source(spec)
  cxx = compiler(cache_dir)
  path = pathlib.Path(cache_dir) / f"flex-{spec.kind}-{library_key(source, cxx)[:32]}.so"
  if path.exists():
    logger.debug("te_jax: loaded the %s library %s from the disk cache", spec.kind, path)
    return str(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(dir=path.parent, prefix=".flex-") as work:
    source_file = pathlib.Path(work) / "mod.cc"
    source_file.write_text(source)
    built = pathlib.Path(work) / "mod.so"
    result = subprocess.run([cxx[0], *FLAGS, f"-I{include_root()}", "-o", str(built), str(source_file)],
                            capture_output=True, text=True)
    if result.returncode != 0:
      raise RuntimeError(f"compiling the {spec.kind} for the CPU with {cxx[0]} failed (a bug in te_jax.flex's code "
                         f"generation; please report it with the mod):\n{result.stderr[-4000:]}")
    os.replace(built, path)
  logger.info("te_jax: compiled the %s library %s in %.2f s", spec.kind, path, time.perf_counter() - start)
  return str(path)
