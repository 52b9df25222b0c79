"""Packed sequences: one row of N documents (segment ids, causal) against the same documents as a batch of N rows, on
the default JAX device. Issue 11 asks packing to cost close to the documents alone (<= 1.3x for 8 documents of 2k:
f32, d 64 on the CPU; bf16, d 128 on the H200).

  python scripts/packed_bench.py [--docs 8] [--doc-len 2048] [--heads 4] [--dim 64] [--dtype float32] [--repeats 5]
                                 [--backward] [--positions] [--cudnn]

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
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
  ap.add_argument("--cudnn", action="store_true", help="also time the batch on jax.nn's cuDNN attention (GPU)")
  args = ap.parse_args()
  n, length, h, d = args.docs, args.doc_len, args.heads, args.dim
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((n, length, h, d)), args.dtype) for _ in range(3))
  packed = [x.reshape(1, n * length, h, d) for x in (q, k, v)]
  lengths = np.full((1, n), length)
  tokens = dict(q_segment_ids=segment_ids_from_lengths(lengths, n * length))
  if args.positions:
    pos = positions_from_lengths(lengths, n * length)
    tokens.update(q_positions=pos, kv_positions=pos)

  def run(attn):
    if args.backward:
      return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    return jax.jit(attn)

  te = lambda tokens: run(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", engine="te", **tokens))
  runs = {f"batch of {n} rows": (te({}), (q, k, v)), "one packed row": (te(tokens), packed)}
  if args.cudnn:
    runs["batch, cuDNN"] = (run(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                              implementation="cudnn")), (q, k, v))
  times = dict(zip(runs, interleaved_seconds(list(runs.values()), args.repeats)))
  what = "forward+backward" if args.backward else "forward"
  print(f"{what}, causal, {args.dtype}, {n} documents of {length}, H={h}, d={d}, {args.repeats} repeats, "
        f"{'ids+positions' if args.positions else 'ids'}, {jax.devices()[0].device_kind}")
  print("                     min (ms)   median (ms)")
  for name, t in times.items():
    print(f"  {name:17s}  {min(t) * 1e3:9.2f}   {np.median(t) * 1e3:9.2f}")
  batch, packed_t = times[f"batch of {n} rows"], times["one packed row"]
  print(f"  packed / batch     {min(packed_t) / min(batch):9.3f}   {np.median(packed_t) / np.median(batch):9.3f}")
  if args.cudnn:
    print(f"  packed / cuDNN     {min(packed_t) / min(times['batch, cuDNN']):9.3f}")


if __name__ == "__main__":
  main()
