"""te_jax CUDA fused attention vs jax.nn.dot_product_attention(implementation="cudnn"), timed the same way: N calls
dispatched back to back, one block at the end, best of R repeats. bf16, b * s = 16k tokens, hidden 2048 (h = 2048 / d).
FLOPs: forward 4 * b * h * s^2 * d (halved when causal); fwd+bwd 3.5x forward (2 + 5 matrix products).
te_jax's backward is the default one (dq summed with float atomics); --deterministic also times fused_attn(...,
deterministic=True) forward+backward.
Usage: python scripts/cuda_bench.py [--seqs 512,2048,8192,16384] [--dims 64,128,256] [--deterministic] [--json out.json]"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax._cuda  # noqa: F401


def timed(fn, args, n=30, repeats=3):
  out = fn(*args)
  jax.block_until_ready(out)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(n):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - start) / n)
  return best


def make_fns(impl, causal):
  if impl.startswith("te_jax"):
    attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal" if causal else "no_mask",
                                             deterministic=impl == "te_jax_det")
  else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  fwd = jax.jit(attn)

  @jax.jit
  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)

  return fwd, fwd_bwd


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--seqs", default="512,1024,2048,4096,8192,16384")
  p.add_argument("--dims", default="64,128,256")
  p.add_argument("--deterministic", action="store_true")
  p.add_argument("--json", default="")
  a = p.parse_args()
  rows = []
  key = jax.random.PRNGKey(0)
  for d in map(int, a.dims.split(",")):
    for s in map(int, a.seqs.split(",")):
      b, h = 16384 // s, 2048 // d
      kq, kk, kv, kd = jax.random.split(jax.random.fold_in(key, s * d), 4)
      q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.bfloat16) for x in (kq, kk, kv, kd))
      for causal in (False, True):
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        res = {}
        for impl in ("te_jax", "cudnn") + (("te_jax_det",) if a.deterministic else ()):
          fwd, fwd_bwd = make_fns(impl, causal)
          try:
            # The deterministic flag changes only the backward.
            res[impl] = (float("nan") if impl == "te_jax_det" else timed(fwd, (q, k, v)), timed(fwd_bwd, (q, k, v, do)))
          except Exception as e:  # noqa: BLE001
            print(f"{impl} d={d} s={s} causal={causal} failed: {type(e).__name__}: {str(e)[:200]}")
            res[impl] = (float("nan"), float("nan"))
        row = dict(d=d, s=s, b=b, h=h, causal=causal,
                   te_fwd=flops / res["te_jax"][0] / 1e12, cudnn_fwd=flops / res["cudnn"][0] / 1e12,
                   te_fb=3.5 * flops / res["te_jax"][1] / 1e12, cudnn_fb=3.5 * flops / res["cudnn"][1] / 1e12)
        row["ratio_fwd"] = row["te_fwd"] / row["cudnn_fwd"]
        row["ratio_fb"] = row["te_fb"] / row["cudnn_fb"]
        det = ""
        if a.deterministic:
          row["te_det_fb"] = 3.5 * flops / res["te_jax_det"][1] / 1e12
          row["ratio_det_fb"] = row["te_det_fb"] / row["cudnn_fb"]
          det = f" | deterministic fwd+bwd {row['te_det_fb']:6.1f} ratio {row['ratio_det_fb']:.2f}"
        rows.append(row)
        print(f"d={d:3d} s={s:5d} causal={int(causal)}  fwd te {row['te_fwd']:6.1f} cudnn {row['cudnn_fwd']:6.1f} "
              f"ratio {row['ratio_fwd']:.2f} | fwd+bwd te {row['te_fb']:6.1f} cudnn {row['cudnn_fb']:6.1f} "
              f"ratio {row['ratio_fb']:.2f}{det}  (TFLOP/s)", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
