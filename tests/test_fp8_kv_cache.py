"""An FP8 KV cache reaches the kernels as it is (te_jax/fp8.py kv_descale_operand; cpp/core/kv_format.h): FP8 k and v
and one float32 [2, blocks, heads] descale operand on both custom-call paths, the CPU kernels dequantizing each key's
row as they read it. The results equal those of the dequantized cache (the float64 reference comparisons are in
tests/test_fp8.py), under jit, vmap (descales per head, per page and per folded batch entry) and grad (q's gradient)."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax import quantize_fp8

from helpers import PATHS, run_program_in_isa

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def normal(seed, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _pool(seed, granularity, fmt=E4M3, num_pages=9, page_size=8, hkv=2, d=16):
  k, v = (normal(seed + i, (num_pages, page_size, hkv, d)) * (1.0 + jnp.arange(num_pages))[:, None, None, None]
          for i in range(2))
  (k8, kd), (v8, vd) = (te_jax.quantize_kv_pages(x, dtype=fmt, granularity=granularity) for x in (k, v))
  return k8, kd, v8, vd


def _table(seed, batch=2, max_pages=4, num_pages=9):
  return jnp.asarray(np.random.default_rng(seed).permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages),
                     jnp.int32)


def _dequantized_pools(k8, kd, v8, vd):
  scale = lambda d: d[:, None, :, None] if d.ndim == 2 else d.reshape(1, 1, -1, 1) if d.ndim else d
  return k8.astype(jnp.float32) * scale(kd), v8.astype(jnp.float32) * scale(vd)


def _kernel_operands(fn, *args):
  """The operand types of the lowered program's forward custom call (the FFI path's)."""
  text = jax.jit(fn).lower(*args).as_text()
  call = next(line for line in text.splitlines() if "te_jax_attention_forward" in line)
  return call


@pytest.mark.parametrize("granularity, descale_type", [("tensor", "2x1x1xf32"), ("head", "2x1x2xf32"),
                                                       ("page", "2x9x2xf32")])
@pytest.mark.parametrize("fmt, pool_type", [(E4M3, "f8E4M3FN"), (E5M2, "f8E5M2")])
def test_the_kernels_read_the_fp8_pages_as_they_are(granularity, descale_type, fmt, pool_type):
  k8, kd, v8, vd = _pool(1, granularity, fmt)
  q = normal(3, (2, 1, 4, 16), jnp.bfloat16)
  call = _kernel_operands(lambda q: te_jax.paged_attention(q, k8, v8, _table(4), jnp.asarray([30, 9], jnp.int32),
                                                           k_descale=kd, v_descale=vd), q)
  assert f"tensor<9x8x2x16x{pool_type}>" in call and f"tensor<{descale_type}>" in call
  assert "tensor<2x1x4x16xbf16>" in call  # q as given, not widened


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("granularity", ["tensor", "head", "page"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_paged_fp8_equals_the_dequantized_cache(granularity, fmt, path):
  """The kernels' dequantization (each row times its page's and head's descale, in float32) is the XLA one: the same
  bits as attending over the dequantized pools in float32."""
  k8, kd, v8, vd = _pool(10, granularity, fmt)
  table, lengths = _table(11), jnp.asarray([32, 13], jnp.int32)
  q = normal(12, (2, 3, 4, 16), jnp.bfloat16)
  k32, v32 = _dequantized_pools(k8, kd, v8, vd)
  with te_jax.custom_call_path(path):
    out, lse = jax.jit(lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd,
                                                        return_lse=True))(q)
    want, want_lse = jax.jit(lambda q: te_jax.paged_attention(q.astype(jnp.float32), k32, v32, table, lengths,
                                                              return_lse=True))(q)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


@pytest.mark.parametrize("path", PATHS)
def test_contiguous_fp8_equals_the_dequantized_cache_with_its_gradient(path):
  q = normal(20, (2, 4, 8, 32), jnp.bfloat16)
  (k8, kd), (v8, vd) = (quantize_fp8(normal(21 + i, (2, 40, 2, 32)), per_head=True) for i in range(2))
  k32, v32 = (x8.astype(jnp.float32) * d.reshape(1, 1, -1, 1) for x8, d in ((k8, kd), (v8, vd)))
  kw = dict(mask_type="padding_causal_bottom_right", q_seqlens=jnp.asarray([4, 2], jnp.int32),
            kv_seqlens=jnp.asarray([40, 23], jnp.int32), softcap=3.0)
  with te_jax.custom_call_path(path):
    call = lambda q: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd, **kw)
    out, dq = jax.jit(jax.value_and_grad(lambda q: call(q).astype(jnp.float32).sum()))(q)
    want, want_dq = jax.jit(jax.value_and_grad(
        lambda q: te_jax.fused_attn(q.astype(jnp.float32), k32, v32, **kw).astype(jnp.bfloat16).astype(
            jnp.float32).sum()))(q)
  assert dq.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(jax.jit(call)(q), np.float32),
                                np.asarray(te_jax.fused_attn(q.astype(jnp.float32), k32, v32, **kw).astype(
                                    jnp.bfloat16), np.float32))
  np.testing.assert_allclose(float(out), float(want), rtol=1e-6)
  # The backward reads the forward's out in bfloat16 (D = rowsum(dout * out)), the float32 call's its float32 out.
  scale = float(jnp.abs(want_dq.astype(jnp.float32)).max())
  np.testing.assert_allclose(np.asarray(dq, np.float32), np.asarray(want_dq, np.float32), atol=2.0**-7 * scale)


@pytest.mark.parametrize("granularity", ["head", "page"])
def test_vmap_of_paged_fp8_with_per_example_pools_and_descales(granularity):
  """Mapped pools are stacked into one pool and a page descale operand follows them (_fold_kv_descale); each example
  reads only its own pages with its own descales."""
  pools = [_pool(30 + 10 * n, granularity) for n in range(3)]
  k8, kd, v8, vd = (jnp.stack([p[i] for p in pools]) for i in range(4))
  tables = jnp.stack([_table(40 + n) for n in range(3)])
  lengths = jnp.asarray([[32, 5], [17, 0], [1, 26]], jnp.int32)
  q = normal(50, (3, 2, 1, 4, 16), jnp.bfloat16)
  attend = lambda q, k8, kd, v8, vd, table, length: te_jax.paged_attention(q, k8, v8, table, length, k_descale=kd,
                                                                          v_descale=vd)
  out = jax.jit(jax.vmap(attend))(q, k8, kd, v8, vd, tables, lengths)
  for n in range(3):
    want = jax.jit(attend)(q[n], k8[n], kd[n], v8[n], vd[n], tables[n], lengths[n])
    np.testing.assert_array_equal(np.asarray(out[n], np.float32), np.asarray(want, np.float32))


def test_vmap_of_paged_fp8_over_queries_shares_the_pool_and_its_descales():
  k8, kd, v8, vd = _pool(60, "page")
  table, lengths = _table(61), jnp.asarray([20, 31], jnp.int32)
  q = normal(62, (3, 2, 1, 4, 16), jnp.bfloat16)
  attend = lambda q: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd)
  out = jax.jit(jax.vmap(attend))(q)
  for n in range(3):
    np.testing.assert_array_equal(np.asarray(out[n], np.float32), np.asarray(jax.jit(attend)(q[n]), np.float32))
  with pytest.raises(ValueError, match="the FP8 descales are mapped but the page pools are not"):
    jax.vmap(lambda q, kd: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd))(
        q, jnp.stack([kd] * 3))


def test_vmap_of_contiguous_fp8_with_per_example_descales():
  """Each example's per-head descales become the folded call's per-batch-entry descales (blocks = B * N)."""
  q = normal(70, (3, 2, 1, 8, 16), jnp.bfloat16)
  quantized = [[quantize_fp8(normal(71 + 2 * n + i, (2, 24, 2, 16)) * (n + 1), per_head=True) for i in range(2)]
               for n in range(3)]
  k8, kd, v8, vd = (jnp.stack([quantized[n][i][j] for n in range(3)]) for i in range(2) for j in range(2))
  attend = lambda q, k8, kd, v8, vd: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd)
  out = jax.jit(jax.vmap(attend))(q, k8, kd, v8, vd)
  shared = jax.jit(jax.vmap(attend, in_axes=(0, 0, None, 0, None)))(q, k8, kd[0], v8, vd[0])
  for n in range(3):
    np.testing.assert_array_equal(np.asarray(out[n], np.float32),
                                  np.asarray(jax.jit(attend)(q[n], k8[n], kd[n], v8[n], vd[n]), np.float32))
    np.testing.assert_array_equal(np.asarray(shared[n], np.float32),
                                  np.asarray(jax.jit(attend)(q[n], k8[n], kd[0], v8[n], vd[0]), np.float32))


def test_fp8_cache_gradients_are_refused_q_flows():
  k8, kd, v8, vd = _pool(80, "page")
  table, lengths = _table(81), jnp.asarray([9, 30], jnp.int32)
  q = normal(82, (2, 1, 4, 16), jnp.bfloat16)
  loss = lambda q, kd: te_jax.paged_attention(q, k8, v8, table, lengths, k_descale=kd, v_descale=vd).astype(
      jnp.float32).sum()
  dq = jax.grad(loss)(q, kd)
  assert dq.dtype == jnp.bfloat16 and np.isfinite(np.asarray(dq, np.float32)).all()
  with pytest.raises(ValueError, match="k_descale or v_descale is being differentiated"):
    jax.grad(loss, argnums=1)(q, kd)


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_every_fp8_value_is_read_exactly(fmt):
  """One key: out is its value row, so a v of all 256 bytes must come out as the format's 256 values (subnormals,
  NaN, e5m2's infinities) times the descale, exactly."""
  v8 = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8), fmt).reshape(1, 1, 1, 256)
  k8 = jnp.zeros((1, 1, 1, 16), fmt)
  q = jnp.ones((1, 1, 2, 16), jnp.float32)
  for descale in (1.0, 0.375):
    out = te_jax.fused_attn(q, k8, v8, k_descale=jnp.float32(1), v_descale=jnp.float32(descale))
    want = np.asarray(v8.astype(jnp.float32), np.float32).reshape(256) * np.float32(descale)
    for head in range(2):
      np.testing.assert_array_equal(np.asarray(out)[0, 0, head], want)


_EVERY_ISA = textwrap.dedent("""
    import sys
    import numpy as np, jax, jax.numpy as jnp, te_jax
    assert te_jax.cpu_isa() == sys.argv[1], te_jax.cpu_isa()
    # Every byte (a row of 256 lanes: the vector paths) and a row of 40 (their tails), one key each; a descale whose
    # product with e4m3's 2^8 is folded into one factor, and one too large for that (two products).
    for fmt in (jnp.float8_e4m3fn, jnp.float8_e5m2):
      for dv, descale in ((256, 0.375), (40, 0.375), (256, 2.0**110)):
        v8 = jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.uint8)[-dv:], fmt).reshape(1, 1, 1, dv)
        out = te_jax.fused_attn(jnp.ones((1, 1, 1, 16), jnp.float32), jnp.zeros((1, 1, 1, 16), fmt), v8,
                                k_descale=jnp.float32(1), v_descale=jnp.float32(descale))
        want = np.asarray(v8.astype(jnp.float32), np.float32).reshape(dv) * np.float32(descale)
        np.testing.assert_array_equal(np.asarray(out).reshape(dv), want, err_msg=str((fmt, dv, descale)))
""")


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_fp8_rows_are_read_exactly_in_every_isa(isa):
  run_program_in_isa(isa, _EVERY_ISA)


@pytest.mark.parametrize("path", PATHS)
def test_fp8_cache_composes_with_every_option(path):
  """Only the rows' reading changes: with segment ids, a bias, dropout, sinks, soft-cap, ALiBi, a score_mod and a
  mask_mod, the FP8 cache gives the dequantized cache's bits."""
  rng = np.random.default_rng(90)
  b, s, h, hkv, d = 2, 48, 4, 2, 32
  q = jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32)
  (k8, kd), (v8, vd) = (quantize_fp8(jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.float32), per_head=True)
                        for _ in range(2))
  k32, v32 = (x8.astype(jnp.float32) * dd.reshape(1, 1, -1, 1) for x8, dd in ((k8, kd), (v8, vd)))
  ids = jnp.asarray(np.repeat([[1, 1, 2], [1, 2, 2]], 16, axis=1), jnp.int32)
  table = jnp.asarray(rng.standard_normal((h, 2 * s)), jnp.float32)
  kw = dict(mask_type="causal", q_segment_ids=ids, kv_segment_ids=ids, softcap=5.0,
            bias=jnp.asarray(rng.standard_normal((1, h, s, s)), jnp.float32), dropout_rate=0.25,
            dropout_rng=jax.random.key(3), sink_logits=jnp.asarray(rng.standard_normal(h), jnp.float32),
            alibi_slopes=jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32),
            score_mod=lambda x, bb, hh, i, j: x + table[hh, i - j + s], mask_mod=lambda bb, hh, i, j: (i - j) % 5 != 3)
  with te_jax.custom_call_path(path):
    got = jax.jit(lambda q: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd, return_lse=True, **kw))(q)
    want = jax.jit(lambda q: te_jax.fused_attn(q, k32, v32, return_lse=True, **kw))(q)
  assert np.isfinite(np.asarray(got[0])).all() and float(np.abs(np.asarray(got[0])).max()) > 0.1
  for name, x, y in zip(("out", "lse"), got, want):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
