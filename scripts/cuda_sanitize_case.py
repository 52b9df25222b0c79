"""Tiny te_jax calls for compute-sanitizer (memcheck / racecheck), in sections a sanitizer can be pointed at one by
one (`--sections decode,paged`; all by default):
  variants    forward + both backwards (atomic dq and deterministic) over ragged padding + causal + window + GQA +
              softcap + ALiBi (at d 64, and at d 192 / dv 128, where the sm90 backward splits columns), a D != Dv causal
              case and the plain product at d 64 (the sm90 forward's three consumer warpgroups);
  nonfinite   causal forwards whose v holds a NaN at a key the first rows do not see (the forward's rare path for
              non-finite values in a straddling tile; 160 rows take the persistent kernel, 1100 the three-consumer one);
  persistent  a forward whose CTAs each take several query blocks (the persistent kernel's loop);
  decode      contiguous decodes (K/V stages by TMA on sm_90a) whose cache rows past the lengths hold NaN and inf;
  paged       paged decodes (the one-row and four-row tile kernels) with a page id outside the pool;
  bias        an additive bias whose rows start off 16-byte boundaries (its last chunk reaches past the operand) and one
              whose rows TMA copies, in full shape (dbias written directly) and broadcast (the float accumulator), with
              -inf rows;
  packed      packed rows (segment ids) of uneven documents and padding, forward + backward: ids that rise (the sm90
              document table and kernels) and ids that do not (the token tables), causal and not;
  fp8         paged and contiguous decodes over an FP8 KV cache (e4m3 descales per page, e5m2 per head) with a page id
              outside the pool and lengths ending mid-page;
  fp8attn     FP8 q, k and v in the sm90 FP8 forward (TE_JAX_CUDA_FP8_ATTENTION=1): causal over keys ending inside a
              tile, padding lengths, and a NaN in v at a key the first rows do not see (its careful pass).
Exit status 1 on unexpected results."""
import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax  # registers the CUDA backend where the package was built with it


def variants():
  """Forward + both backwards over ragged padding, windows, GQA, soft-cap, ALiBi, D != Dv."""
  ok = True
  for (d, dv, mask, extra), deterministic in ((case, det) for case in ((64, 64, "padding_causal", True),
                                                                     (192, 128, "padding_causal", True),
                                                                     (40, 72, "causal_bottom_right", False),
                                                                     (64, 64, "no_mask", False))
                                              for det in (False, True)):
    rng = np.random.default_rng(0)
    b, sq, skv, h, hkv = 2, 70, 90, 4, 2
    q = jnp.asarray(rng.standard_normal((b, sq, h, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, skv, hkv, dv)), jnp.bfloat16)
    kw = dict(mask_type=mask, deterministic=deterministic, engine="te")
    if extra:
      kw.update(q_seqlens=jnp.asarray([70, 33], jnp.int32), kv_seqlens=jnp.asarray([90, 41], jnp.int32),
                window_size=(20, 5), softcap=15.0, alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.2, (h,)), jnp.float32))
    f = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, **kw), q, k, v)[1](
        jnp.ones((b, sq, h, dv), jnp.bfloat16)))
    grads = jax.block_until_ready(f(q, k, v))
    ok &= all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  return ok


def nonfinite():
  """The forward's rare path for a NaN in v at a key the first rows do not see."""
  ok = True
  # The NaN sits at key 100 of kv head 1 (query heads 2 and 3): their rows 100.. are NaN in column 3, every other
  # output stays finite.
  for seqlen in (160, 1100):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, seqlen, 4, 64)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((1, seqlen, 2, 64)), jnp.bfloat16) for _ in range(2))
    v = v.at[0, 100, 1, 3].set(jnp.nan)
    out = np.asarray(jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", engine="te"))(q, k, v),
                     np.float32)
    expected = np.zeros(out.shape, bool)
    expected[0, 100:, 2:, 3] = True
    ok &= bool(np.array_equal(~np.isfinite(out), expected))
  return ok


def persistent():
  """The persistent sm90 forward taking several query blocks per CTA, with a NaN in v."""
  ok = True
  # 640 query blocks of 128 rows over the GPU's multiprocessors (the persistent kernel: several per CTA, d 128, GQA 5);
  # the NaN at key 100 of batch 0's kv head 1 reaches that batch's rows 100.. of query heads 5-9 in column 3.
  rng = np.random.default_rng(4)
  q = jnp.asarray(rng.standard_normal((4, 512, 40, 128)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((4, 512, 8, 128)), jnp.bfloat16) for _ in range(2))
  v = v.at[0, 100, 1, 3].set(jnp.nan)
  out = np.asarray(jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", engine="te"))(q, k, v),
                   np.float32)
  expected = np.zeros(out.shape, bool)
  expected[0, 100:, 5:10, 3] = True
  ok &= bool(np.array_equal(~np.isfinite(out), expected))
  return ok


def contiguous_decode():
  """Contiguous decodes (K/V stages by TMA on sm_90a): the one-row tile (1 query, GQA 4, split-KV over 2000 keys, not a
  whole number of 64-key boxes) and the four-row tile (16 queries); ragged lengths, one of them 0, and cache rows past
  each length holding NaN and inf (read with their tile, seen by no row): every output finite, the empty row 0."""
  ok = True
  rng = np.random.default_rng(6)
  for sq in (1, 16):
    q = jnp.asarray(rng.standard_normal((3, sq, 8, 128)), jnp.bfloat16)
    k, v = (rng.standard_normal((3, 2000, 2, 128)).astype(np.float32) for _ in range(2))
    lengths = [2000, 1001, 0]
    for i, n in enumerate(lengths):
      k[i, n:] = np.nan
      v[i, n:] = np.inf
    f = jax.jit(lambda q, k, v, ks: te_jax.fused_attn(q, k, v, mask_type="padding_causal_bottom_right", kv_seqlens=ks,
                                                      q_seqlens=jnp.full((3,), sq, jnp.int32), engine="te"))
    out = np.asarray(f(q, jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), jnp.asarray(lengths, jnp.int32)),
                     np.float32)
    ok &= bool(np.isfinite(out).all() and not out[2].any())
  return ok


def paged():
  """Paged decodes with a page id outside the pool."""
  ok = True
  # Split-KV calls over a shuffled page pool with ragged lengths and a traced page id outside the pool in the last
  # sequence (clamped in the kernel: nothing is read outside the pool; that entry is NaN, the others finite). Sq 2 over
  # pages of 16 (GQA 4); Sq 16 x GQA 4 over pages of 64 (the four-row-tile kernel, 2k keys: several splits); Sq 1 over
  # pages of 16 (the one-row tile, 2k keys).
  for sq, page_size, max_pages in ((2, 16, 16), (16, 64, 32), (1, 16, 128)):
    rng = np.random.default_rng(2)
    pages = 3 * max_pages
    q = jnp.asarray(rng.standard_normal((3, sq, 8, 128)), jnp.bfloat16)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((pages, page_size, 2, 128)), jnp.bfloat16) for _ in range(2))
    table = rng.permutation(pages).reshape(3, max_pages).astype(np.int32)
    table[2, 1] = pages + 7  # inside every call's 100 keys of that sequence
    lengths = np.asarray([max_pages * page_size, 37, 100], np.int32)
    out = np.asarray(jax.jit(te_jax.paged_attention)(q, k_pages, v_pages, jnp.asarray(table), jnp.asarray(lengths)),
                     np.float32)
    ok &= bool(np.isfinite(out[:2]).all() and np.isnan(out[2]).all())
  return ok


def bias():
  """An additive bias on the sm80 and sm90 kernels, both backwards, -inf entries."""
  ok = True
  # Skv = 77 keys (rows off 16-byte boundaries: the sm80 kernels) and 80 (rows TMA copies: the sm90 kernels on
  # sm_90a): bf16 [B, H, Sq, Skv] with both backwards, float32 [1, H, 1, Skv] (summed dbias) with the atomic one, GQA,
  # causal; -inf entries (a whole row, a key).
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 70, 4, 64)), jnp.bfloat16)
  for skv in (77, 80):
    k, v = (jnp.asarray(rng.standard_normal((2, skv, 2, 64)), jnp.bfloat16) for _ in range(2))
    for shape, dtype, deterministic in (((2, 4, 70, skv), jnp.bfloat16, False), ((2, 4, 70, skv), jnp.bfloat16, True),
                                        ((1, 4, 1, skv), jnp.float32, False)):
      bias = np.asarray(rng.standard_normal(shape), np.float32)
      if shape[2] == 1:
        bias[..., 5] = -np.inf  # key 5 hidden from every row
      else:
        bias[:, :, 9, :] = -np.inf  # row 9 sees nothing
      bias = jnp.asarray(bias, dtype)
      kw = dict(mask_type="causal", deterministic=deterministic, engine="te")
      f = jax.jit(lambda q, k, v, b: jax.vjp(lambda q, k, v, b: te_jax.fused_attn(q, k, v, bias=b, **kw),
                                             q, k, v, b)[1](jnp.ones((2, 70, 4, 64), jnp.bfloat16)))
      grads = jax.block_until_ready(f(q, k, v, bias))
      ok &= all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  return ok


def packed():
  """Packed rows read as documents (rising ids) and through the token tables (ids that fall), both directions."""
  ok = True
  # Documents of 70, 130, 1 and 200 rows, padding (id 0) between and after, at d 128 (the plain product, whose module
  # has the document kernels); the same ids reversed are not a reading the table allows.
  rng = np.random.default_rng(6)
  lengths = (70, 130, 1, 0, 200)  # the 0: a padding run of 20 rows between two documents
  ids = np.concatenate([np.full(n if n else 20, i + 1 if n else 0, np.int32) for i, n in enumerate(lengths)])
  ids = np.concatenate([ids, np.zeros(512 - ids.size, np.int32)])
  q, k, v = (jnp.asarray(rng.standard_normal((2, 512, 4, 128)), jnp.bfloat16) for _ in range(3))
  for row in (ids, ids[::-1]):
    seg = jnp.asarray(np.stack([row, row]))
    for mask in ("causal", "no_mask"):
      kw = dict(mask_type=mask, q_segment_ids=seg, kv_segment_ids=seg, engine="te")
      f = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, **kw), q, k, v)[1](
          jnp.ones((2, 512, 4, 128), jnp.bfloat16)))
      grads = jax.block_until_ready(f(q, k, v))
      ok &= all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in grads)
  return ok


def fp8():
  """Decodes over an FP8 KV cache: paged (one- and four-row tiles, page descales, a page id outside the pool) and
  contiguous (per-head descales, lengths ending inside a stage)."""
  ok = True
  for sq, page_size, max_pages, fmt, granularity in ((1, 16, 64, jnp.float8_e4m3fn, "page"),
                                                     (16, 64, 16, jnp.float8_e5m2, "head")):
    rng = np.random.default_rng(7)
    pages = 3 * max_pages
    q = jnp.asarray(rng.standard_normal((3, sq, 8, 128)), jnp.bfloat16)
    (k8, kd), (v8, vd) = (te_jax.quantize_kv_pages(jnp.asarray(rng.standard_normal((pages, page_size, 2, 128)),
                                                               jnp.float32), dtype=fmt, granularity=granularity)
                          for _ in range(2))
    table = rng.permutation(pages).reshape(3, max_pages).astype(np.int32)
    table[2, 1] = pages + 7
    lengths = jnp.asarray([max_pages * page_size, 37, 100], jnp.int32)
    out = np.asarray(jax.jit(lambda q: te_jax.paged_attention(q, k8, v8, jnp.asarray(table), lengths, k_descale=kd,
                                                              v_descale=vd))(q), np.float32)
    ok &= bool(np.isfinite(out[:2]).all() and np.isnan(out[2]).all())
  q = jnp.asarray(np.random.default_rng(8).standard_normal((2, 1, 8, 128)), jnp.bfloat16)
  (k8, kd), (v8, vd) = (te_jax.quantize_fp8(jnp.asarray(np.random.default_rng(9 + i).standard_normal((2, 1000, 2, 128)),
                                                        jnp.float32), per_head=True) for i in range(2))
  out = te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd, mask_type="padding_causal_bottom_right",
                          q_seqlens=jnp.ones(2, jnp.int32), kv_seqlens=jnp.asarray([1000, 333], jnp.int32))
  return ok and bool(jnp.isfinite(out.astype(jnp.float32)).all())


def fp8attn():
  """FP8 q, k and v: causal over 400 keys (the last tile partly past them), padding lengths, and a NaN in v at key
  300, which only the rows from 300 on see."""
  import os
  os.environ["TE_JAX_CUDA_FP8_ATTENTION"] = "1"
  rng = np.random.default_rng(10)
  (q8, qd), (k8, kd), (v8, vd) = (te_jax.quantize_fp8(jnp.asarray(rng.standard_normal((2, 400, h, 128)), jnp.float32),
                                                      per_head=True) for h in (4, 2, 2))
  v8 = v8.at[0, 300, 0, :].set(jnp.asarray(np.nan, v8.dtype))
  descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
  out = np.asarray(te_jax.fused_attn(q8, k8, v8, mask_type="causal", **descales), np.float32)
  ok = bool(np.isfinite(out[0, :300]).all() and np.isnan(out[0, 300:, :2]).all() and np.isfinite(out[1]).all())
  out = te_jax.fused_attn(q8, k8, v8, mask_type="padding", q_seqlens=jnp.asarray([400, 123], jnp.int32),
                          kv_seqlens=jnp.asarray([256, 77], jnp.int32), **descales)
  return ok and bool(np.isfinite(np.asarray(out[1], np.float32)).all())


SECTIONS = {"variants": variants, "nonfinite": nonfinite, "persistent": persistent, "decode": contiguous_decode,
            "paged": paged, "bias": bias, "packed": packed, "fp8": fp8, "fp8attn": fp8attn}

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)")
names = parser.parse_args().sections.split(",")
unknown = [n for n in names if n not in SECTIONS]
if unknown:
  parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
results = {n: SECTIONS[n]() for n in names}
print("sanitize cases as expected:", all(results.values()), results)
sys.exit(0 if all(results.values()) else 1)
