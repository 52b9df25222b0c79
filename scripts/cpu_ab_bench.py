"""te_jax's CPU kernels alone, float32, milliseconds per call (median of 5 repeats of back-to-back calls): the causal
forward over K/V rows 2-8 KB apart, forward + backward, decode, and paged decode (shuffled pages of 16 and 64 keys)
against contiguous K/V. For a before/after, install the other build elsewhere (`pip install --no-deps --target DIR .`
from its checkout), run this with PYTHONPATH=DIR and without, alternating, and compare the best of the rounds.
Usage: python scripts/cpu_ab_bench.py > after-1.txt"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax.bench.paging import paged_layout


def timed(fn, *args, calls=3, repeats=5):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    outs = [fn(*args) for _ in range(calls)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - start) / calls)
  return sorted(times)[len(times) // 2] * 1e3


def normal(key, shape):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def main():
  # (seq, heads, kv heads, head dim): K/V rows kv_heads * d * 4 bytes apart.
  for s, h, hkv, d, grad in ((2048, 8, 8, 64, True), (2048, 16, 16, 64, False), (2048, 32, 32, 64, False),
                             (2048, 16, 4, 128, False), (2048, 32, 8, 128, True), (2048, 16, 16, 128, False),
                             (1024, 16, 2, 256, False), (1024, 8, 8, 256, False)):
    q, k, v = normal(0, (1, s, h, d)), normal(1, (1, s, hkv, d)), normal(2, (1, s, hkv, d))
    fwd = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal"))
    name = f"causal s {s} h {h}/{hkv} d {d} (rows {hkv * d * 4} B apart)"
    print(f"{name:48s} fwd {timed(fwd, q, k, v):9.3f}", flush=True)
    if grad:
      f_b = jax.jit(jax.grad(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal").sum(), argnums=(0, 1, 2)))
      print(f"{name:48s} f+b {timed(f_b, q, k, v):9.3f}", flush=True)
  for sq, skv in ((1, 1024), (1, 4096), (1, 16384), (16, 4096)):
    q, k, v = normal(0, (1, sq, 32, 128)), normal(1, (1, skv, 8, 128)), normal(2, (1, skv, 8, 128))
    contiguous = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal_bottom_right"))
    paged = jax.jit(lambda q, kp, vp, t, n: te_jax.paged_attention(q, kp, vp, t, n))
    row = f"decode h 32/8 d 128, {sq:2d} x {skv:5d} keys: contiguous {timed(contiguous, q, k, v, calls=20):8.3f}"
    for page in (16, 64):
      pages = paged_layout(np.asarray(k), np.asarray(v), page)
      args = [jax.device_put(x) for x in (pages.k_pages, pages.v_pages, pages.page_table, pages.kv_lengths)]
      row += f"  paged {page} {timed(paged, q, *args, calls=20):8.3f}"
    print(row, flush=True)


if __name__ == "__main__":
  main()
