"""te_jax's decode kernels (fused_attn, engine="te", and paged_attention) against jax.nn.dot_product_attention(
implementation="cudnn") in one process, for before/after comparisons of kernel trees: --kernel-root DIR compiles
te_jax's kernels from DIR/cpp (another tree's sources; the host code stays the installed one's). Run it once per tree,
alternating trees and rounds in separate processes (scripts/gpu_check.sh's decode_ab section does), since two
processes differ by more than most kernel changes.

Each case is BxSQxSKV (h 32 / kv 8, d 128, bf16, queries at the end of the keys); per backend the median of --samples
samples of --calls back-to-back calls, µs per call. One JSON line per run on stdout (and appended to --jsonl).
Usage: python scripts/decode_ab.py --label main [--kernel-root DIR] [--cases 64x1x4096,8x1x32768,8x16x8192]
       [--paged 64] [--jsonl out.jsonl]"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
import te_jax._cuda  # noqa: F401
from te_jax.bench.paging import paged_layout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the scripts' helpers, also under PYTHONSAFEPATH
from call_timing import seconds_per_call  # noqa: E402


def per_call_us(fn, args, calls: int, samples: int) -> float:
  return seconds_per_call(fn, args, calls, samples) * 1e6


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--label", required=True, help="the tree's name in the output")
  p.add_argument("--kernel-root", default="", help="compile te_jax's kernels from this tree instead")
  p.add_argument("--cases", default="64x1x4096,8x1x32768,8x1x8192,8x16x8192")
  p.add_argument("--paged", type=int, default=64, help="page size of the paged column; 0: no paged column")
  p.add_argument("--calls", type=int, default=100)
  p.add_argument("--samples", type=int, default=7)
  p.add_argument("--jsonl", default="")
  a = p.parse_args()
  if a.kernel_root:
    te_jax._cuda.ext.set_kernel_root(a.kernel_root)
  rng = np.random.default_rng(0)
  record = {"label": a.label, "kernel_root": a.kernel_root, "device": jax.devices()[0].device_kind, "cases": {}}
  for case in a.cases.split(","):
    batch, seq_q, seq_kv = map(int, case.split("x"))
    q = jnp.asarray(rng.standard_normal((batch, seq_q, 32, 128)), jnp.bfloat16)
    k, v = (np.asarray(rng.standard_normal((batch, seq_kv, 8, 128)), np.float32).astype(jnp.bfloat16)
            for _ in range(2))
    fns = {"te": (jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal_bottom_right", engine="te")),
                  (q, jnp.asarray(k), jnp.asarray(v))),
           # cuDNN has no bottom-right causal mask; one query sees every key either way, 16 see all but 15 keys.
           "cudnn": (jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
                     (q, jnp.asarray(k), jnp.asarray(v)))}
    if a.paged:
      pages = paged_layout(k, v, a.paged)
      fns[f"paged{a.paged}"] = (jax.jit(te_jax.paged_attention),
                                (q, *map(jnp.asarray, (pages.k_pages, pages.v_pages, pages.page_table,
                                                       pages.kv_lengths))))
    te_out = np.asarray(fns["te"][0](*fns["te"][1]), np.float32)
    result = {"te_vs_cudnn_max_err": float(np.abs(te_out - np.asarray(fns["cudnn"][0](*fns["cudnn"][1]),
                                                                       np.float32)).max()) if seq_q == 1 else None}
    if a.paged:
      paged = fns[f"paged{a.paged}"]
      result["paged_equals_te"] = bool(np.array_equal(np.asarray(paged[0](*paged[1]), np.float32), te_out))
    for name, (fn, args) in fns.items():
      result[name] = per_call_us(fn, args, a.calls, a.samples)
    record["cases"][case] = result
  line = json.dumps(record)
  print(line)
  if a.jsonl:
    with open(a.jsonl, "a") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
