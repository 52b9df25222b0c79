"""Where the C++ headers compiled at run time live: te_jax/kernels in an installed package (CMake installs the CUDA
kernel tree and the headers the CPU's score_mod / mask_mod libraries include there), else the source checkout."""

from __future__ import annotations

import pathlib


def kernel_root() -> str:
  """The folder holding cpp/ (cpp/core, and cpp/cuda/kernels where the CUDA backend was built)."""
  here = pathlib.Path(__file__).resolve().parent
  for root in (here / "kernels", here.parent):
    if (root / "cpp" / "core").is_dir():
      return str(root)
  return str(here / "kernels")
