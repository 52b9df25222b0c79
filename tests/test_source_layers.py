"""The include graph of the C++ sources follows the layers docs/ARCHITECTURE.md draws ("Source layout"): the core
includes nothing but itself; the CPU backend the core; the CUDA kernels' primitives (copies, barriers, matrix
products, shared-memory tiles) the core; their common attention pieces the primitives; each kernel family (sm80, sm90,
decode) the common pieces, the primitives and itself, never another family; host code reaches into the kernel tree
only for the host-device tuning tables (tile_size.h). And every header a kernel includes ships for NVRTC (the
extension's list and the install list agree)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = "cpp/cuda/kernels/"
FAMILIES = ("sm80", "sm90", "decode")
INCLUDE = re.compile(r'^\s*#include "((?:cpp|ffi|legacy|bindings)/[^"]+)"', re.M)
# The part of a header NVRTC never sees (host-only includes).
HOST_ONLY = re.compile(r"^#if !defined\(__CUDACC_RTC__\)\n.*?^#endif", re.M | re.S)


def _sources() -> list[str]:
  return sorted(str(p.relative_to(ROOT)) for folder in ("cpp", "ffi", "legacy", "bindings")
                for p in (ROOT / folder).rglob("*") if p.suffix in (".h", ".cc", ".cuh"))


def _includes(path: str, device: bool = False) -> list[str]:
  """The project headers `path` includes; with device, those NVRTC compiles."""
  text = (ROOT / path).read_text()
  return INCLUDE.findall(HOST_ONLY.sub("", text) if device else text)


def _layer(path: str) -> str:
  if path.startswith("cpp/core/"):
    return "core"
  if path.startswith("cpp/cpu/"):
    return "cpu"
  if path == "cpp/cuda/kernel_args.h":
    return "kernel_args"  # the arguments host launchers pass and kernels read
  if path.startswith(KERNELS):
    return path[len(KERNELS):].split("/")[0]  # primitives, common, or a family
  return "host"  # the CUDA host code, the handlers and the bindings


# What each layer may include besides itself.
ALLOWED = {
    "core": set(),
    "cpu": {"core"},
    "kernel_args": {"core"},
    "primitives": {"core"},
    "common": {"core", "kernel_args", "primitives"},
    **{family: {"core", "kernel_args", "primitives", "common"} for family in FAMILIES},
}


@pytest.mark.parametrize("path", _sources())
def test_includes_follow_the_layers(path):
  layer = _layer(path)
  for included in _includes(path):
    assert (ROOT / included).is_file(), f"{path} includes {included}, which does not exist"
    target = _layer(included)
    if layer == "host":
      # Host code compiles with the host compiler: of the kernel tree only the host-device tables.
      assert not included.startswith(KERNELS) or included.endswith("/tile_size.h") or \
          included.endswith("/padded_tile_size.h"), f"{path} (host code) includes the device header {included}"
      continue
    assert target == layer or target in ALLOWED[layer], \
        f"{path} ({layer}) includes {included} ({target}); {layer} may include {sorted(ALLOWED[layer])} and itself"


def _reachable_from_kernels() -> set[str]:
  seen, todo = set(), [p for p in _sources() if p.startswith(KERNELS)]
  while todo:
    path = todo.pop()
    if path in seen:
      continue
    seen.add(path)
    todo += _includes(path, device=True)
  return seen


def test_every_header_a_kernel_includes_ships_for_nvrtc():
  compiler = (ROOT / "cpp/cuda/nvrtc_compiler.cc").read_text()
  listed = re.search(r"kSharedHeaders\[\] = \{(.*?)\};", compiler, re.S).group(1)
  shipped = set(re.findall(r'"([^"]+)"', listed))
  cmake = (ROOT / "CMakeLists.txt").read_text()
  installed = set()
  for files, destination in re.findall(r"install\(FILES ([^)]*?) DESTINATION te_jax/kernels/(\S+)\)", cmake):
    installed |= {f for f in files.split() if pathlib.PurePosixPath(f).parent.as_posix() == destination}
  assert installed == shipped, "CMakeLists.txt installs other shared headers than the NVRTC compiler lists"
  outside = {p for p in _reachable_from_kernels() if not p.startswith(KERNELS)}
  assert outside <= shipped, f"kernels include headers that do not ship for NVRTC: {sorted(outside - shipped)}"
