"""Packed sequences on the CPU: one row of N documents (segment ids, causal) against the same documents as a batch of
N rows. Issue 11 asks packing to cost close to the documents alone (<= 1.3x for 8 documents of 2k, f32, d 64).

  python scripts/packed_bench.py [--docs 8] [--doc-len 2048] [--heads 4] [--dim 64] [--repeats 5] [--backward]

Prints the min and median wall time of each layout (forward, or forward + backward), measured in alternation, and
their ratios. Run it from outside the
source folder's parent so that the installed te_jax is imported."""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax.packing import positions_from_lengths, segment_ids_from_lengths


def interleaved_seconds(runs, repeats: int) -> list[list[float]]:
  """Wall times of each (fn, args) in `runs`, measured in alternation so that load from other processes on the
  machine hits both layouts alike."""
  for fn, args in runs:
    jax.block_until_ready(fn(*args))  # compile and warm up
  times = [[] for _ in runs]
  for _ in range(repeats):
    for (fn, args), t in zip(runs, times):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      t.append(time.perf_counter() - start)
  return times


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--docs", type=int, default=8)
  ap.add_argument("--doc-len", type=int, default=2048)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--backward", action="store_true", help="time forward + backward (jax.grad)")
  ap.add_argument("--positions", action="store_true", help="pass positions from the lengths too")
  args = ap.parse_args()
  n, length, h, d = args.docs, args.doc_len, args.heads, args.dim
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((n, length, h, d)), jnp.float32) for _ in range(3))
  packed = [x.reshape(1, n * length, h, d) for x in (q, k, v)]
  lengths = np.full((1, n), length)
  tokens = dict(q_segment_ids=segment_ids_from_lengths(lengths, n * length))
  if args.positions:
    pos = positions_from_lengths(lengths, n * length)
    tokens.update(q_positions=pos, kv_positions=pos)

  def run(tokens):
    attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", **tokens)
    if args.backward:
      return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v)), argnums=(0, 1, 2)))
    return jax.jit(attn)

  t_batch, t_packed = interleaved_seconds([(run({}), (q, k, v)), (run(tokens), packed)], args.repeats)
  what = "forward+backward" if args.backward else "forward"
  print(f"{what}, causal, f32, {n} documents of {length}, H={h}, d={d}, {args.repeats} repeats, "
        f"{'ids+positions' if args.positions else 'ids'}")
  print("                     min (ms)   median (ms)")
  for name, t in ((f"batch of {n} rows", t_batch), ("one packed row", t_packed)):
    print(f"  {name:17s}  {min(t) * 1e3:9.1f}   {np.median(t) * 1e3:9.1f}")
  print(f"  packed / batch     {min(t_packed) / min(t_batch):9.3f}   {np.median(t_packed) / np.median(t_batch):9.3f}")


if __name__ == "__main__":
  main()
