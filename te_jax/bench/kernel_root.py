"""--kernel-root DIR: te_jax's CUDA kernels compiled from another tree's sources (DIR/cpp: the kernel tree and the
headers it shares), the host code staying this installation's, which renders the translation units: the other tree
must have this one's source layout and kernel templates (a kernel change, not a move). A before/after of a kernel change runs the harness once
per tree, alternating processes, since two processes differ by more than most kernel changes. The disk cache keys each
kernel by a digest of its sources, so two trees never share a compiled kernel."""

from __future__ import annotations

import os

ENV = "TE_JAX_BENCH_KERNEL_ROOT"  # set by --kernel-root; an environment variable, so --isolate workers see it too


def choose(root: str) -> str:
  """Checks that `root` holds a kernel tree and passes its absolute path on to this process and its workers."""
  path = os.path.abspath(root)
  if not os.path.isdir(os.path.join(path, "cpp", "cuda", "kernels")):
    raise SystemExit(f"--kernel-root {root}: no cpp/cuda/kernels under it (give the folder that holds a tree's cpp/, "
                     "e.g. one made by `git archive <commit> cpp | tar -x -C DIR`)")
  os.environ[ENV] = path
  return path


def apply() -> None:
  """Compiles te_jax's kernels from the tree that ENV names, if it names one (te_jax's CUDA backend needed)."""
  root = os.environ.get(ENV)
  if not root:
    return
  try:
    from te_jax._cuda import ext  # the harness is part of te_jax; no public call chooses the kernel tree
  except ImportError as e:
    raise SystemExit(f"--kernel-root {root}: te_jax was built without its CUDA backend ({e})") from None
  ext.set_kernel_root(root)
