"""A quick GPU check of te_jax's own forward kernels on long sequences (the tests' cases are short): out and lse against
a float32 reference computed by XLA on the same GPU, on fresh random data, with the outputs poisoned before each run.
Prints one line per case and exits non-zero on a mismatch. Run it under `timeout`: a pipeline deadlock hangs.
Usage: python scripts/gpu_smoke.py"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax

# name, b, sq, skv, h, hkv, d, dv, mask, window, softcap, alibi, ragged
CASES = [
    ("d128_s2048", 2, 2048, 2048, 4, 4, 128, 128, "no_mask", (-1, -1), 0.0, False, False),
    ("d128_causal_s3000", 1, 3000, 3000, 4, 2, 128, 128, "causal", (-1, -1), 0.0, False, False),
    ("d64_s4096", 1, 4096, 4096, 4, 1, 64, 64, "no_mask", (-1, -1), 0.0, False, False),
    ("d256_causal_s2000", 1, 2000, 2000, 2, 2, 256, 256, "causal", (-1, -1), 0.0, False, False),
    ("d192_dv128_s1500", 1, 1500, 1700, 4, 4, 192, 128, "causal_bottom_right", (-1, -1), 0.0, False, False),
    ("window_ragged", 3, 1800, 1900, 4, 2, 128, 128, "padding_causal", (300, 0), 0.0, False, True),
    ("softcap_alibi_fp16", 2, 1100, 1100, 4, 4, 64, 64, "causal", (-1, -1), 30.0, True, False),
    ("d96_fp16", 1, 700, 900, 2, 2, 96, 96, "no_mask", (-1, -1), 0.0, False, False),
]


def reference(q, k, v, mask, q_len, kv_len, window, scale, softcap, slopes):
  """float32 attention with the mask as a boolean matrix; rows without keys give 0 and lse -inf."""
  b, sq, h, d = q.shape
  skv, hkv = k.shape[1], k.shape[2]
  k = jnp.repeat(k.astype(jnp.float32), h // hkv, axis=2)
  v = jnp.repeat(v.astype(jnp.float32), h // hkv, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest") * scale
  if softcap > 0:
    s = softcap * jnp.tanh(s / softcap)
  i = jnp.arange(sq)[:, None]
  j = jnp.arange(skv)[None, :]
  bottom_right = mask.endswith("bottom_right")
  visible = []
  for bi in range(b):
    ql, kl = int(q_len[bi]), int(kv_len[bi])
    p = i + (kl - ql if bottom_right else 0)
    m = (i < ql) & (j < kl)
    if "causal" in mask:
      m &= j <= p
    if window[0] >= 0:
      m &= j >= p - window[0]
    if window[1] >= 0:
      m &= j <= p + window[1]
    visible.append(m)
    if slopes is not None:
      s = s.at[bi].add(slopes[:, None, None] * (j - p).astype(jnp.float32)[None])
  visible = jnp.stack(visible)[:, None]
  s = jnp.where(visible, s, -jnp.inf)
  lse = jax.nn.logsumexp(s, axis=-1)
  p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision="highest")
  return out, lse


def main():
  rng = np.random.default_rng()
  failed = 0
  for name, b, sq, skv, h, hkv, d, dv, mask, window, softcap, alibi, ragged in CASES:
    dtype = jnp.float16 if "fp16" in name else jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, skv, hkv, dv)), dtype)
    q_len = rng.integers(sq // 2, sq + 1, b).astype(np.int32) if ragged else np.full(b, sq, np.int32)
    kv_len = rng.integers(skv // 2, skv + 1, b).astype(np.int32) if ragged else np.full(b, skv, np.int32)
    slopes = jnp.asarray(rng.uniform(0.01, 0.2, h), jnp.float32) if alibi else None
    scale = 1.0 / np.sqrt(d)
    kwargs = dict(mask_type=mask, window_size=window, softcap=softcap, alibi_slopes=slopes, return_lse=True,
                  engine="te")
    if "padding" in mask:
      kwargs.update(q_seqlens=jnp.asarray(q_len), kv_seqlens=jnp.asarray(kv_len))
    out, lse = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, **kwargs))(q, k, v)
    ref_out, ref_lse = reference(q, k, v, mask, q_len, kv_len, window, scale, softcap, slopes)
    rows = np.arange(sq)[None, :] < q_len[:, None]  # rows past a batch's length are not compared
    o = np.asarray(out, np.float32)[rows]
    r = np.asarray(ref_out)[rows]
    err = np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)
    lse_rows = np.broadcast_to(rows[:, None, :], lse.shape)
    lse_a, lse_r = np.asarray(lse)[lse_rows], np.asarray(ref_lse)[lse_rows]
    both_inf = np.isneginf(lse_a) & np.isneginf(lse_r)
    with np.errstate(invalid="ignore"):  # -inf - -inf on the rows both give -inf, which both_inf then excludes
      lse_err = float(np.max(np.abs(np.where(both_inf, 0, lse_a - lse_r)))) if lse_a.size else 0.0
    ok = np.isfinite(o).all() and err < 2e-2 and lse_err < 2e-2
    failed += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name:22s} out rel err {err:.2e}  lse max err {lse_err:.2e}", flush=True)
  print(f"smoke: {len(CASES) - failed}/{len(CASES)} passed")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
