"""A fresh process's first jitted call with a score_mod or mask_mod whose library is already in the disk cache, against
the built-in mask (docs/BENCHMARKS.md, "Kernel compile times"): each kind runs once to fill the cache, then `runs`
times, each in a new process, alternating the kinds so a busy machine slows all of them alike.

    JAX_PLATFORMS=cpu python -m te_jax.bench.first_call [runs]     # per kind: the median and the range, in ms
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

KINDS = ("builtin", "score_mod", "mask_mod")


def first_call(kind: str) -> float:
  """The milliseconds of the first call of a jitted causal attention, b 1 s 256 h 4 d 64 float32, with `kind`."""
  import jax
  import jax.numpy as jnp

  import te_jax
  x = jnp.ones((1, 256, 4, 64))
  table = jnp.linspace(-1.0, 1.0, 4 * 511).reshape(4, 511)  # a relative-position table per head (not a splat)
  mods = {"builtin": dict(mask_type="causal"),
          "score_mod": dict(mask_type="causal", score_mod=lambda s, b, h, i, j: s + table[h, i - j + 255]),
          "mask_mod": dict(mask_mod=lambda b, h, i, j: j <= i)}[kind]
  f = jax.jit(lambda x: te_jax.fused_attn(x, x, x, **mods))
  start = time.perf_counter()
  f(x).block_until_ready()
  return 1e3 * (time.perf_counter() - start)


def main(runs: int) -> None:
  spawn = lambda kind: float(subprocess.run([sys.executable, "-m", "te_jax.bench.first_call", "--kind", kind],
                                            capture_output=True, text=True, check=True).stdout)
  for kind in KINDS:
    spawn(kind)
  times = {kind: [] for kind in KINDS}
  for _ in range(runs):
    for kind in KINDS:
      times[kind].append(spawn(kind))
  for kind, values in times.items():
    print(f"{kind}: median {statistics.median(values):.1f} ms, {min(values):.1f}-{max(values):.1f} ({runs} runs)")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--kind"]:
    print(first_call(sys.argv[2]))
  else:
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
