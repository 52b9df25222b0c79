"""What a query block costs the sm90 forward besides its key tiles: the forward timed over key lengths of 1..N tiles
(the query side fixed), te_jax one CTA per block (TE_JAX_SM90_PERSISTENT=0), te_jax persistent (=1) and cuDNN in one
process, each fitted as time = fixed + per_tile x tiles by least squares. The fixed part is what overlapping a block's
first and last products with its neighbours' work could recover; its share at a given length says what that is worth.

Usage: python scripts/block_cost.py [--dim 128] [--heads 16] [--batch 8] [--seq-q 2048] [--tiles 1,2,4,8,16,32]
       [--json out.json]"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax._cuda  # noqa: F401
from cuda_bench import timed  # scripts/cuda_bench.py: calls back to back, best of repeats

KEYS_PER_TILE = 128  # the sm90 forward's key tile at d <= 128


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-q", type=int, default=2048)
  p.add_argument("--tiles", default="1,2,4,8,16,32")
  p.add_argument("--json", default="")
  a = p.parse_args()
  tiles = [int(t) for t in a.tiles.split(",")]
  key = jax.random.PRNGKey(0)
  shape_q = (a.batch, a.seq_q, a.heads, a.dim)
  q = jax.random.normal(key, shape_q, jnp.bfloat16)
  te = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, engine="te"))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  times = {"te one CTA per block": [], "te persistent": [], "cudnn": []}
  for t in tiles:
    kv_shape = (a.batch, t * KEYS_PER_TILE, a.heads, a.dim)
    k, v = (jax.random.normal(jax.random.fold_in(key, i), kv_shape, jnp.bfloat16) for i in (1, 2))
    for name, fn, mode in (("te one CTA per block", te, "0"), ("te persistent", te, "1"), ("cudnn", cudnn, None)):
      if mode is not None:
        os.environ["TE_JAX_SM90_PERSISTENT"] = mode  # read by the launcher at each call
      times[name].append(timed(fn, (q, k, v), repeats=5) * 1e6)
    print(f"{t:3d} key tiles: " + "  ".join(f"{name} {times[name][-1]:8.1f} us" for name in times), flush=True)
  os.environ.pop("TE_JAX_SM90_PERSISTENT", None)
  fits = {}
  for name, us in times.items():
    per_tile, fixed = np.polyfit(np.asarray(tiles, float), np.asarray(us), 1)
    fits[name] = dict(fixed_us=fixed, per_tile_us=per_tile)
    share = {t: fixed / (fixed + per_tile * t) for t in tiles}
    print(f"{name:22s} fixed {fixed:7.1f} us + {per_tile:6.1f} us per key tile; fixed share " +
          " ".join(f"{t}: {s:.0%}" for t, s in share.items()))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), args=vars(a),
                     tiles=tiles, times_us=times, fits=fits), f, indent=1)


if __name__ == "__main__":
  main()
