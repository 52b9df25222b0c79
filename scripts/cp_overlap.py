"""Whether context parallelism's ring hides its K/V permutes under the block computation (issue 14): on a 1-D mesh of N
devices, per sequence length, times in one process
  one  te_jax.fused_attn on one device over the whole sequence,
  ring the same call with context_parallel_strategy="ring" (load-balanced) over the N devices,
  perm the ring's communication alone: the N - 1 steps in which every device passes its K and V shard to the next
       (lax.ppermute under shard_map, nothing computed),
and reports the scaling efficiency one / (N ring) and the communication the ring leaves exposed, ring - one / N,
against perm: about 0 when the permutes hide under the blocks, about perm when they add to them. Forward only (the
backward's ring has the same shape, with the K/V gradients travelling too). The ring's output, put back in natural
order, is checked against the one-device output.

  python scripts/cp_overlap.py --devices 4 --seq 32768,131072 [--batch 1 --heads 32 --kv-heads 8 --dim 128]
On the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu (timings then say nothing about a
GPU's links; tests/test_cp_overlap_script.py runs it so for the numbers' plumbing)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import te_jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the scripts' helpers, also under PYTHONSAFEPATH
from call_timing import seconds_per_call  # noqa: E402


def ring_permutes(mesh: Mesh):
  """The ring's communication: N - 1 steps, each passing every device's K and V shard to the next device."""
  n = mesh.shape["cp"]
  perm = [(i, (i + 1) % n) for i in range(n)]
  spec = PartitionSpec(None, "cp")

  def body(k, v):
    for _ in range(n - 1):
      k, v = lax.ppermute(k, "cp", perm), lax.ppermute(v, "cp", perm)
    return k, v
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec)))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--devices", type=int, default=0, help="devices of the mesh (default: all)")
  p.add_argument("--seq", default="32768,131072", help="sequence lengths, comma-separated")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=32)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument("--calls", type=int, default=5, help="back-to-back calls a sample")
  p.add_argument("--samples", type=int, default=5)
  p.add_argument("--json", default="", help="also write the rows here")
  a = p.parse_args()
  devices = jax.devices()[:a.devices or None]
  n = len(devices)
  if n < 2:
    raise SystemExit(f"the ring needs 2 or more devices; {n} here (--devices; on the CPU, XLA_FLAGS="
                     "--xla_force_host_platform_device_count=N)")
  mesh = Mesh(np.asarray(devices), ("cp",))
  sharded = NamedSharding(mesh, PartitionSpec(None, "cp"))
  dtype = jnp.dtype(a.dtype)
  one = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal"))
  ring = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", context_parallel_axis="cp",
                                                   context_parallel_strategy="ring",
                                                   context_parallel_load_balanced=True))
  permutes = ring_permutes(mesh)
  print(f"cp_overlap: {n} x {devices[0].device_kind}, b {a.batch}, h {a.heads} / kv {a.kv_heads}, d {a.dim}, "
        f"{a.dtype}, causal, forward; ms per call")
  print(f"{'seq':>8} {'one':>9} {'ring':>9} {'perm':>9} {'efficiency':>10} {'exposed':>9} {'exposed/perm':>12}")
  rows = []
  rng = np.random.default_rng(0)
  for seq in map(int, a.seq.split(",")):
    if seq % (2 * n):
      raise SystemExit(f"--seq {seq}: a multiple of 2 x {n} devices (the load-balanced chunks)")
    q, k, v = (jnp.asarray(rng.standard_normal((a.batch, seq, h, a.dim)), dtype)
               for h in (a.heads, a.kv_heads, a.kv_heads))
    on_one = tuple(jax.device_put(x, devices[0]) for x in (q, k, v))
    on_ring = tuple(jax.device_put(te_jax.reorder_for_load_balancing(x, n, 1), sharded) for x in (q, k, v))
    t_one = seconds_per_call(one, on_one, a.calls, a.samples)
    t_ring = seconds_per_call(ring, on_ring, a.calls, a.samples)
    t_perm = seconds_per_call(permutes, on_ring[1:], a.calls, a.samples)
    reference = np.asarray(one(*on_one), np.float64)
    restored = np.asarray(te_jax.inverse_reorder_for_load_balancing(ring(*on_ring), n, 1), np.float64)
    rel_err = float(np.linalg.norm(restored - reference) / max(np.linalg.norm(reference), 1e-30))
    exposed = t_ring - t_one / n
    row = dict(devices=n, device_kind=devices[0].device_kind, seq=seq, batch=a.batch, heads=a.heads,
               kv_heads=a.kv_heads, dim=a.dim, dtype=a.dtype, one_ms=t_one * 1e3, ring_ms=t_ring * 1e3,
               perm_ms=t_perm * 1e3, efficiency=t_one / (n * t_ring), exposed_ms=exposed * 1e3,
               exposed_over_perm=exposed / t_perm, ring_rel_err=rel_err)
    rows.append(row)
    print(f"{seq:>8} {row['one_ms']:>9.3f} {row['ring_ms']:>9.3f} {row['perm_ms']:>9.3f} {row['efficiency']:>10.2f} "
          f"{row['exposed_ms']:>9.3f} {row['exposed_over_perm']:>12.2f}   (ring vs one: rel err {rel_err:.1e})")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
