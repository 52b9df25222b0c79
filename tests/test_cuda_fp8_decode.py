"""GPU tests of an FP8 KV cache in the CUDA decode kernels (cpp/cuda/kernels/decode/ with an E4M3/E5M2 KvElement):
out and lse of te_jax.paged_attention over FP8 pools and of fused_attn with FP8 k and v, against the float64 reference
over the dequantized cache (the kernels compute on exactly those values, so the error is the products' and out's
rounding: bf16-level): e4m3 and e5m2, descales per tensor, head and page, page sizes 16/64/256, 1 and 16 queries,
GQA 32/8, causal and windows, soft-cap, ALiBi, lengths with a partial last page, a NaN in one key. Skipped without a
GPU, and (with its reason) on a GPU whose decode kernels do not read FP8 (before sm_89)."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from test_cuda_attention import _rel  # noqa: E402  (skips this module where that one skips: no GPU or CUDA backend)

import te_jax  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
# Relative Frobenius error of out (and lse) against the float64 reference: q rounded to f16 (exact for bf16 q, whose
# largest value the kernel scales by a power of two), P rounded to f16 (11 bits), out rounded to q's dtype.
TOL = {"bfloat16": dict(out=1e-2, lse=1e-3), "float16": dict(out=2e-3, lse=1e-3)}


@pytest.fixture(scope="module", autouse=True)
def _fp8_reaches_the_kernels():
  """Skips (naming why) where the lowering refuses FP8 KV calls on this GPU (cpp/cuda/kernel_config.cc Fp8Refusal)."""
  _check_fp8_reaches_the_kernels()


def _check_fp8_reaches_the_kernels():
  q = jnp.zeros((1, 1, 8, 128), jnp.bfloat16)
  pages = jnp.zeros((2, 16, 1, 128), jnp.float8_e4m3fn)
  try:
    jax.block_until_ready(te_jax.paged_attention(q, pages, pages, jnp.zeros((1, 2), jnp.int32),
                                                 jnp.ones((1,), jnp.int32), k_descale=jnp.float32(1.0),
                                                 v_descale=jnp.float32(1.0), engine="te"))
  except ValueError as e:
    if "this FP8 KV cache call has no cuda kernel" in str(e):
      pytest.skip(f"this GPU's decode kernels do not read an FP8 KV cache: {e}")
    raise


def _pools(rng, *, b, h, hkv, d, page_size, max_pages, fmt, granularity, dv=None):
  """FP8 pools quantized with te_jax.quantize_kv_pages, a table of shuffled pages (two sequences share their first
  page), lengths with a partial last page, and the float64 dequantized pools the reference reads."""
  num_pages = b * max_pages + 3
  spread = rng.uniform(0.5, 4.0, (num_pages, 1, 1, 1))  # pages of different magnitudes: descales per page differ
  k = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32) * spread
  v = rng.standard_normal((num_pages, page_size, hkv, dv or d)).astype(np.float32)
  k8, k_descale = te_jax.quantize_kv_pages(jnp.asarray(k), dtype=FORMATS[fmt], granularity=granularity)
  v8, v_descale = te_jax.quantize_kv_pages(jnp.asarray(v), dtype=FORMATS[fmt], granularity=granularity)
  table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  if b > 1:
    table[1, 0] = table[0, 0]
  lengths = rng.integers(1, max_pages * page_size + 1, size=b).astype(np.int32)
  lengths[0] = max_pages * page_size - page_size // 2  # a partial last page
  dequantized = [te_jax.dequantize_fp8(x8, s, jnp.float32) for x8, s in ((k8, k_descale), (v8, v_descale))]
  k64, v64 = (np.asarray(x, np.float64) for x in dequantized)
  return k8, v8, k_descale, v_descale, table, lengths, k64, v64


def _reference(q, k64, v64, table, lengths, mask_type, **kwargs):
  b, capacity = table.shape[0], table.shape[1] * k64.shape[1]
  k = k64[table].reshape(b, capacity, *k64.shape[2:])
  v = v64[table].reshape(b, capacity, *v64.shape[2:])
  masks = {"causal_bottom_right": "padding_causal_bottom_right", "no_mask": "padding"}
  return attention_reference(np.asarray(q, np.float64), k, v, mask_type=masks[mask_type],
                             q_seqlens=np.full(b, q.shape[1]), kv_seqlens=lengths, **kwargs)


# (id, q dtype, format, descale granularity, page size, Sq, H, Hkv, d, mask, window, softcap, alibi)
PAGED_CASES = [
    ("e4m3_head_p16_decode", "bfloat16", "e4m3", "head", 16, 1, 32, 8, 128, "causal_bottom_right", (-1, -1), 0.0, False),
    ("e4m3_page_p64_decode", "bfloat16", "e4m3", "page", 64, 1, 32, 8, 128, "causal_bottom_right", (-1, -1), 0.0, False),
    ("e5m2_tensor_p256", "bfloat16", "e5m2", "tensor", 256, 1, 32, 8, 128, "no_mask", (-1, -1), 0.0, False),
    ("e4m3_page_p16_sq16", "bfloat16", "e4m3", "page", 16, 16, 32, 8, 128, "causal_bottom_right", (-1, -1), 0.0, False),
    ("e5m2_page_p64_sq16_window", "float16", "e5m2", "page", 64, 16, 32, 8, 128, "causal_bottom_right", (100, 0), 0.0,
     False),
    ("e4m3_head_p64_softcap", "bfloat16", "e4m3", "head", 64, 4, 32, 8, 128, "causal_bottom_right", (-1, -1), 30.0,
     False),
    ("e4m3_page_p16_alibi_d64", "float16", "e4m3", "page", 16, 1, 32, 8, 64, "causal_bottom_right", (-1, -1), 0.0, True),
    ("e5m2_head_p256_d256", "bfloat16", "e5m2", "head", 256, 1, 32, 8, 256, "causal_bottom_right", (-1, -1), 0.0, False),
    ("e4m3_page_p64_d256_sq16", "bfloat16", "e4m3", "page", 64, 16, 32, 8, 256, "causal_bottom_right", (-1, -1), 0.0,
     False),
    ("e4m3_mqa_p16_d96", "bfloat16", "e4m3", "page", 16, 2, 8, 1, 96, "causal_bottom_right", (-1, -1), 0.0, False),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_fp8_decode_matches_the_dequantized_reference(case):
  name, dtype, fmt, granularity, page_size, sq, h, hkv, d, mask, window, softcap, alibi = case
  rng = np.random.default_rng(abs(hash(name)) % 2**32)
  b, max_pages = 4, max(2, 2048 // page_size)
  k8, v8, k_descale, v_descale, table, lengths, k64, v64 = _pools(rng, b=b, h=h, hkv=hkv, d=d, page_size=page_size,
                                                                  max_pages=max_pages, fmt=fmt,
                                                                  granularity=granularity)
  q = jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype)
  kwargs = dict(mask_type=mask, window_size=window, softcap=softcap)
  if alibi:
    kwargs["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.3, size=(b, h)), jnp.float32)
  out, lse = jax.jit(lambda q, k8, v8, t, n, ks, vs: te_jax.paged_attention(
      q, k8, v8, t, n, k_descale=ks, v_descale=vs, return_lse=True, engine="te", **kwargs))(
          q, k8, v8, table, lengths, k_descale, v_descale)
  ref = _reference(q, k64, v64, table, lengths, mask, window_size=window, softcap=softcap,
                   alibi_slopes=kwargs.get("alibi_slopes"))
  assert out.dtype == q.dtype
  assert _rel(out, ref["out"]) < TOL[dtype]["out"], name
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
  assert _rel(np.asarray(lse)[finite], ref["lse"][finite]) < TOL[dtype]["lse"], name


@pytest.mark.parametrize("d, dv", [(112, 112), (64, 128), (128, 256), (256, 64)])
def test_paged_fp8_decode_head_dims(d, dv):
  """d 112 (56 byte pairs in a 64-column swizzled stage: TMA's boxes reach past the row, zero-filled) and dv above or
  below d (the epilogue outgrows the half-size rings and the q tile at dv above d), descales per page, 1 query."""
  rng = np.random.default_rng(d * 1000 + dv)
  k8, v8, k_descale, v_descale, table, lengths, k64, v64 = _pools(rng, b=3, h=16, hkv=4, d=d, dv=dv, page_size=32,
                                                                  max_pages=40, fmt="e4m3", granularity="page")
  q = jnp.asarray(rng.standard_normal((3, 1, 16, d)), jnp.bfloat16)
  out, lse = jax.jit(lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=k_descale,
                                                      v_descale=v_descale, return_lse=True, engine="te"))(q)
  ref = _reference(q, k64, v64, table, lengths, "causal_bottom_right")
  assert out.shape == (3, 1, 16, dv) and _rel(out, ref["out"]) < TOL["bfloat16"]["out"]
  assert _rel(lse, ref["lse"]) < TOL["bfloat16"]["lse"]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("per_head", [False, True])
def test_contiguous_fp8_kv_matches_the_dequantized_reference(fmt, per_head):
  """fused_attn with a bf16 q and FP8 k, v (a contiguous KV cache; descales per tensor or head), 1 and 16 queries."""
  rng = np.random.default_rng(7)
  for sq in (1, 16):
    q = jnp.asarray(rng.standard_normal((3, sq, 32, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((3, 3000, 8, 128)) * 3.0, jnp.float32) for _ in range(2))
    k8, k_descale = te_jax.quantize_fp8(k, dtype=FORMATS[fmt], per_head=per_head)
    v8, v_descale = te_jax.quantize_fp8(v, dtype=FORMATS[fmt], per_head=per_head)
    kv_seqlens = jnp.asarray([3000, 1000, 65], jnp.int32)
    out, lse = jax.jit(lambda q, k8, v8, ks, vs, n: te_jax.fused_attn(
        q, k8, v8, k_descale=ks, v_descale=vs, mask_type="padding_causal_bottom_right",
        q_seqlens=jnp.full((3,), sq, jnp.int32), kv_seqlens=n, return_lse=True, engine="te"))(
            q, k8, v8, k_descale, v_descale, kv_seqlens)
    k64, v64 = (np.asarray(te_jax.dequantize_fp8(x8, s, jnp.float32), np.float64)
                for x8, s in ((k8, k_descale), (v8, v_descale)))
    ref = attention_reference(np.asarray(q, np.float64), k64, v64, mask_type="padding_causal_bottom_right",
                              q_seqlens=np.full(3, sq), kv_seqlens=np.asarray(kv_seqlens))
    assert _rel(out, ref["out"]) < TOL["bfloat16"]["out"], (fmt, per_head, sq)
    assert _rel(lse, ref["lse"]) < TOL["bfloat16"]["lse"], (fmt, per_head, sq)


def test_large_bf16_queries_keep_their_precision():
  """A bf16 q beyond f16's range (the kernel scales q by a power of two) and one far below it give the reference's
  output: the scale is folded into the logits, so no value is lost to f16's range."""
  rng = np.random.default_rng(11)
  k8, v8, k_descale, v_descale, table, lengths, k64, v64 = _pools(rng, b=2, h=8, hkv=2, d=128, page_size=64,
                                                                  max_pages=8, fmt="e4m3", granularity="head")
  for magnitude in (1e6, 1e-7):
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 128)) * magnitude, jnp.bfloat16)
    scale = 1.0 / magnitude / np.sqrt(128)  # logits of order 1
    out = te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=k_descale, v_descale=v_descale, scale=scale,
                                 engine="te")
    ref = _reference(q, k64, v64, table, lengths, "causal_bottom_right", scale=scale)
    assert _rel(out, ref["out"]) < TOL["bfloat16"]["out"], magnitude


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_a_nan_key_reaches_only_the_rows_that_see_it(fmt):
  """A NaN in k of one key: NaN in the rows (queries) that see it, and nowhere else (the careful pass for the rows of a
  16-query tile whose causal ranges end before it)."""
  rng = np.random.default_rng(5)
  page_size, max_pages = 16, 8
  k8, v8, k_descale, v_descale, table, lengths, k64, v64 = _pools(rng, b=2, h=8, hkv=2, d=128, page_size=page_size,
                                                                  max_pages=max_pages, fmt=fmt, granularity="page")
  lengths = np.asarray([100, 128], np.int32)
  key = 95  # seen by the last 6 of 16 queries of sequence 0
  page = int(table[0, key // page_size])
  k8 = k8.at[page, key % page_size, 1, 3].set(jnp.asarray(np.nan, FORMATS[fmt]))
  k64 = k64.copy()
  k64[page, key % page_size, 1, 3] = np.nan
  q = jnp.asarray(rng.standard_normal((2, 16, 8, 128)), jnp.bfloat16)
  out, lse = te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=k_descale, v_descale=v_descale,
                                    return_lse=True, engine="te")
  ref = _reference(q, k64, v64, table, lengths, "causal_bottom_right")
  bad = ~np.isfinite(ref["out"])
  assert bad.any() and not bad.all()
  assert np.array_equal(~np.isfinite(np.asarray(out, np.float32)), bad)
  assert np.array_equal(np.isnan(np.asarray(lse)), np.isnan(ref["lse"]))
  assert _rel(np.asarray(out, np.float32)[~bad], ref["out"][~bad]) < TOL["bfloat16"]["out"]
