"""te_jax CUDA fused attention vs jax.nn.dot_product_attention(implementation="cudnn"), timed the same way: N calls
dispatched back to back, one block at the end, best of R repeats, all in one process (interleaved per shape).
bf16 (--dtype float16 for fp16), b * s = 16k tokens, hidden 2048 (h = 2048 / d; --heads to choose). FLOPs: forward 4 * b * h * s^2 * d (halved when causal);
fwd+bwd 3.5x forward (2 + 5 matrix products).

Each te_jax engine is a column: --engines te,cudnn,auto (fused_attn(engine=...)); --deterministic adds te_jax's
deterministic backward. --kernel-root DIR compiles te_jax's kernels from DIR/cpp/cuda/kernels (an older tree, for a
before/after figure in the same run conditions).
Usage: python scripts/cuda_bench.py [--seqs 512,2048,8192,16384] [--dims 64,128,256] [--engines te,cudnn,auto]
       [--modes fwd,fwd+bwd] [--json out.json]"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

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


def make_fns(impl, causal, window):
  mask = "causal" if causal else "no_mask"
  if impl == "jax-cudnn":
    local = None if window < 0 else (window, 0)
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, local_window_size=local,
                                                        implementation="cudnn")
  else:
    engine, _, det = impl.partition("-")
    attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=mask, window_size=(window, 0 if window >= 0 else -1),
                                             engine=engine, deterministic=det == "det")
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
  p.add_argument("--engines", default="te,cudnn,auto")
  p.add_argument("--modes", default="fwd,fwd+bwd")
  p.add_argument("--causal", default="0,1")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  p.add_argument("--heads", type=int, default=0, help="query heads; 0: 2048 / d (hidden 2048)")
  p.add_argument("--heads-kv", type=int, default=0, help="k/v heads (GQA); 0: as many as the query heads")
  p.add_argument("--window", type=int, default=-1, help="left window (causal only); -1: none")
  p.add_argument("--deterministic", action="store_true")
  p.add_argument("--kernel-root", default="", help="compile te_jax's kernels from this tree instead")
  p.add_argument("--json", default="")
  a = p.parse_args()
  if a.kernel_root:
    te_jax._cuda.ext.set_kernel_root(a.kernel_root)
  impls = ["jax-cudnn"] + a.engines.split(",") + (["te-det"] if a.deterministic else [])
  modes = a.modes.split(",")
  rows = []
  key = jax.random.PRNGKey(0)
  for d in map(int, a.dims.split(",")):
    for s in map(int, a.seqs.split(",")):
      b, h = max(1, 16384 // s), a.heads or 2048 // d
      hkv = a.heads_kv or h
      kq, kk, kv, kd = jax.random.split(jax.random.fold_in(key, s * d), 4)
      dtype = jnp.dtype(a.dtype)
      q, do = (jax.random.normal(x, (b, s, h, d), dtype) for x in (kq, kd))
      k, v = (jax.random.normal(x, (b, s, hkv, d), dtype) for x in (kk, kv))
      for causal in map(int, a.causal.split(",")):
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        row = dict(d=d, s=s, b=b, h=h, hkv=hkv, causal=bool(causal), window=a.window, dtype=a.dtype)
        for impl in impls:
          fwd, fwd_bwd = make_fns(impl, bool(causal), a.window)
          for mode in modes:
            if mode == "fwd" and impl.endswith("-det"):
              continue  # the deterministic flag changes only the backward
            try:
              t = timed(fwd, (q, k, v)) if mode == "fwd" else timed(fwd_bwd, (q, k, v, do))
              row[f"{impl}_{mode}"] = (flops if mode == "fwd" else 3.5 * flops) / t / 1e12
            except Exception as e:  # noqa: BLE001 - a column that cannot run says why and the sweep goes on
              print(f"{impl} {mode} d={d} s={s} causal={causal} failed: {type(e).__name__}: {str(e)[:300]}")
              row[f"{impl}_{mode}"] = float("nan")
        rows.append(row)
        cells = []
        for mode in modes:
          ref = row[f"jax-cudnn_{mode}"]
          cells.append(f"{mode} cudnn {ref:6.1f} " + " ".join(
              f"{impl} {row[f'{impl}_{mode}']:6.1f} ({row[f'{impl}_{mode}'] / ref:.2f}x)" for impl in impls[1:]
              if f"{impl}_{mode}" in row))
        print(f"d={d:3d} s={s:5d} c={causal} | " + " | ".join(cells) + "  (TFLOP/s)", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                     args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
