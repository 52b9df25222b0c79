"""One forward (or forward + backward) step of te_jax's kernels or JAX's cuDNN attention, after three warm-up steps,
between cudaProfilerStart and cudaProfilerStop, so `ncu --profile-from-start off` profiles that step's kernels alone
(gpu_check.sh ncu). bf16, b s = 16k tokens, h 16, d 128; te-packed: te_jax's kernels on the batch packed into one row
of 16k tokens, its documents told apart by segment ids:

    python scripts/profile_step.py te|te-packed|cudnn causal|no_mask SEQ fwd|fwd+bwd
"""

import argparse
import ctypes
import glob
import os
import sys

import jax
import jax.numpy as jnp


def _cudart() -> ctypes.CDLL:
  """The CUDA runtime the profiler calls go to: the CUDA 13 wheel's, else the toolkit's."""
  candidates = glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu13", "lib",
                                      "libcudart.so*")) + glob.glob("/usr/local/cuda/lib64/libcudart.so*")
  for path in candidates:
    try:
      return ctypes.CDLL(path)
    except OSError:
      continue
  raise SystemExit(f"no loadable libcudart among {candidates}")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("engine", choices=["te", "te-packed", "cudnn"])
  p.add_argument("mask", choices=["causal", "no_mask"])
  p.add_argument("seq", type=int)
  p.add_argument("mode", choices=["fwd", "fwd+bwd"])
  a = p.parse_args()
  import te_jax
  batch, heads, d, causal = max(1, 16384 // a.seq), 16, 128, a.mask == "causal"
  q, k, v, dout = (jax.random.normal(key, (batch, a.seq, heads, d), jnp.bfloat16)
                   for key in jax.random.split(jax.random.key(0), 4))
  if a.engine == "te":
    attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=a.mask, engine="te")
  elif a.engine == "te-packed":
    ids = te_jax.segment_ids_from_lengths(jnp.full((1, batch), a.seq), batch * a.seq)
    q, k, v, dout = (x.reshape(1, batch * a.seq, heads, d) for x in (q, k, v, dout))
    attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=a.mask, q_segment_ids=ids, engine="te")
  else:
    attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  step = jax.jit(attn if a.mode == "fwd" else (lambda q, k, v: jax.vjp(attn, q, k, v)[1](dout)))
  for _ in range(3):
    jax.block_until_ready(step(q, k, v))
  cudart = _cudart()
  cudart.cudaProfilerStart()
  jax.block_until_ready(step(q, k, v))
  cudart.cudaProfilerStop()
  print(f"profiled {a.engine} {a.mask} s {a.seq} {a.mode}")


if __name__ == "__main__":
  main()
