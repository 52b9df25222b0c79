"""CPU forward, float32, b 1, h 8, d 64, s 2048/4096, causal or not: te_jax against XLA's attention in the same process,
best of 3 repeats of 5 calls. For a before/after, install another build elsewhere (`pip install --no-deps --target
DIR .` from its checkout) and run this with PYTHONPATH=DIR, then without.
Usage: python scripts/cpu_bench.py"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import te_jax


def timed(fn, *args, calls=5, repeats=3):
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / calls)
  return best


def main():
  for s in (2048, 4096):
    for causal in (False, True):
      q, k, v = (jax.random.normal(jax.random.key(i), (1, s, 8, 64), jnp.float32) for i in range(3))
      te = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal" if causal else "no_mask"))
      xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"))
      flops = 4 * s * s * 8 * 64 * (0.5 if causal else 1.0)
      t_te, t_xla = timed(te, q, k, v), timed(xla, q, k, v)
      print(f"s={s} causal={int(causal)} te {flops / t_te / 1e9:6.1f} GFLOP/s  xla {flops / t_xla / 1e9:6.1f}  "
            f"ratio {t_xla / t_te:.2f}", flush=True)


if __name__ == "__main__":
  main()
