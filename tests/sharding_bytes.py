"""Bytes each context-parallel strategy moves per device per training step (forward + backward of one fused_attn),
read from the compiled HLO of a CPU mesh, next to the analytic figure.

  python tests/sharding_bytes.py            # prints a Markdown table (docs/BENCHMARKS.md, last section)

Counting, per device: all-gather receives (n-1)/n of its result; reduce-scatter sends and receives (n-1) results;
collective-permute receives its result once; all-reduce (ring algorithm) moves 2(n-1)/n of its operand.
"""

from __future__ import annotations

import re

import numpy as np

_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "pred": 1}
_OP = re.compile(r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\s(all-gather|reduce-scatter|collective-permute|all-reduce)"
                 r"(?:-start)?\(")


def hlo_bytes(hlo: str, n: int) -> dict[str, int]:
  totals: dict[str, int] = {}
  for dtype, dims, op in _OP.findall(hlo):
    size = int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * _DTYPE_BYTES[dtype]
    moved = {"all-gather": size * (n - 1) // n, "reduce-scatter": size * (n - 1),
             "collective-permute": size, "all-reduce": 2 * size * (n - 1) // n}[op]
    totals[op] = totals.get(op, 0) + moved
  return totals


def main() -> None:
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  import te_jax

  batch, seqlen, heads, kv_heads, head_dim = 2, 4096, 8, 2, 64
  dtype = jnp.float32  # XLA:CPU widens bf16 collectives to f32, so f32 keeps the comparison exact
  rows = []
  for cp in (2, 4, 8):
    mesh = jax.make_mesh((8 // cp, cp), ("dp", "cp"), axis_types=(AxisType.Auto,) * 2)
    spec = NamedSharding(mesh, P("dp", "cp"))
    q = jax.ShapeDtypeStruct((batch * (8 // cp), seqlen, heads, head_dim), dtype, sharding=spec)
    kv = jax.ShapeDtypeStruct((batch * (8 // cp), seqlen, kv_heads, head_dim), dtype, sharding=spec)
    for strategy in ("all_gather", "ring"):
      def step(q, k, v, d):
        out, vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(
            q, k, v, mask_type="causal", context_parallel_axis="cp", context_parallel_strategy=strategy,
            context_parallel_load_balanced=True), q, k, v)
        return (out,) + vjp(d)
      with jax.set_mesh(mesh):
        hlo = jax.jit(step).lower(q, kv, kv, q).compile().as_text()
      measured = hlo_bytes(hlo, cp)
      # Analytic, per device: local K+V block = batch * S/cp * Hkv * (D + Dv) * 4 bytes; dK/dV travel in f32.
      kv_block = batch * (seqlen // cp) * kv_heads * 2 * head_dim * 4
      dkv_block_f32 = kv_block
      if strategy == "all_gather":
        # K/V gathered in the forward and again in the backward; dK/dV reduce-scattered.
        analytic = {"all-gather": 2 * (cp - 1) * kv_block, "reduce-scatter": (cp - 1) * dkv_block_f32}
      else:
        # K/V: cp-1 hops in the forward and cp-1 in the backward; dK/dV accumulators: cp hops (home included).
        analytic = {"collective-permute": 2 * (cp - 1) * kv_block + cp * dkv_block_f32}
      rows.append((cp, strategy, measured, analytic))
  print(f"Causal, load balanced, float32; per device B={batch}, S={seqlen} (global), H={heads}, Hkv={kv_heads}, "
        f"D=Dv={head_dim}; mesh (dp=8/cp, cp); forward + backward of one fused_attn.\n")
  print("| cp | strategy | collective | HLO bytes/device | analytic bytes/device |")
  print("|---:|---|---|---:|---:|")
  for cp, strategy, measured, analytic in rows:
    for op in sorted(set(measured) | set(analytic)):
      print(f"| {cp} | {strategy} | {op} | {measured.get(op, 0):,} | {analytic.get(op, 0):,} |")


if __name__ == "__main__":
  main()
