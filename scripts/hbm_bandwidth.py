"""The GPU's measured memory bandwidth, the ceiling a memory-bound kernel (decode attention) is held to: a device-to-
device copy of a large bf16 array through XLA (bytes read + bytes written per second) and a read of it (a max
reduction), best of several timed runs.

  python scripts/hbm_bandwidth.py [--gib 4]
"""
import argparse
import time

import jax
import jax.numpy as jnp


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gib", type=float, default=4.0, help="size of the copied array (GiB)")
  args = parser.parse_args()
  n = int(args.gib * 2**30) // 2
  x = jnp.ones((n,), jnp.bfloat16)
  kinds = {"copy (read + write)": (jax.jit(lambda x: x + jnp.bfloat16(1)), 2 * n * 2),
           "read (a max over it)": (jax.jit(jnp.max), n * 2)}
  for name, (f, moved) in kinds.items():
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
      start = time.perf_counter()
      f(x).block_until_ready()
      best = min(best, time.perf_counter() - start)
    print(f"{jax.devices()[0].device_kind}: {name} of {args.gib:g} GiB: {moved / best / 1e12:.2f} TB/s "
          f"(best of 10, {best * 1e3:.2f} ms)")


if __name__ == "__main__":
  main()
