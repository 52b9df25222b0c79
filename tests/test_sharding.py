"""fused_attn under SPMD meshes of 8 CPU devices: batch/head partitioning, context parallelism (all-gather and ring,
every mask type, GQA, load balancing, windows, packed sequences, Sq != Skv with positions, dropout), shard_map and
vmap; results and gradients equal to the unsharded call, and the compiled HLO has exactly the collectives each layout
should have.

The module needs 8 CPU devices. It asks for them (jax_num_cpu_devices) when it is imported; if JAX was already
initialised with fewer (another test module ran first), the whole module re-runs itself in a subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

_NEEDED = 8
try:
  jax.config.update("jax_num_cpu_devices", _NEEDED)
except Exception:  # the backend is already initialised  # noqa: BLE001
  pass
_IN_PROCESS = jax.device_count() >= _NEEDED and jax.default_backend() == "cpu"

from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import te_jax  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402
from te_jax.sharding import ReshardWarning  # noqa: E402


in_process = pytest.mark.skipif(not _IN_PROCESS, reason="needs 8 CPU devices in this process (see test_subprocess)")

TOL = dict(rtol=2e-5, atol=2e-5)  # float32, against the unsharded te_jax call and the float64 reference
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def _outcomes(pytest_output: str) -> dict[str, int]:
  """pytest's summary line ("42 passed, 1 skipped, 2 warnings in 9.1s") as {"passed": 42, "skipped": 1, ...}."""
  lines = [l for l in pytest_output.splitlines() if re.search(r"\d+ \w+.* in [\d.]+s", l)]
  assert lines, "no pytest summary line in:\n" + pytest_output[-3000:]
  counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", lines[-1])}
  counts.pop("warning", None)
  counts.pop("warnings", None)
  return counts


def test_subprocess(request):
  """Runs the tests of this module that need 8 devices and that this session selected in a fresh interpreter, when this
  one could not get 8 devices. Every one of them must pass there: a skip would hide a test that never ran."""
  if _IN_PROCESS:
    pytest.skip("8 devices are available in-process")
  names = [item.nodeid.split("::", 1)[1] for item in request.session.items
           if item.path == request.node.path and in_process.mark in item.iter_markers("skipif")]
  if not names:
    pytest.skip("no test of this module that needs 8 devices is selected")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"] +
                          [f"{__file__}::{name}" for name in names], env=env, capture_output=True, text=True,
                          timeout=900)
  output = result.stdout[-5000:] + result.stderr[-3000:]
  assert result.returncode == 0, output
  assert _outcomes(result.stdout) == {"passed": len(names)}, output


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "README.md")

# Appended to the README's program: its result is sharded over the 8 devices and equals the unsharded call.
README_CHECK = """
import numpy as np
assert jax.device_count() == 8 and len(out.sharding.device_set) == 8, out.sharding
q, k, v = (np.asarray(te_jax.inverse_reorder_for_load_balancing(x, cp)) for x in (q, k, v))
want = te_jax.fused_attn(q, k, v, mask_type="causal")
np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
print("README example ok")
"""


def test_readme_example_runs_as_written():
  """The README's context-parallel program, as written, in a fresh interpreter (it sets up its own 8 CPU devices)."""
  with open(README) as f:
    programs = [block for block in re.findall(r"```python\n(.*?)```", f.read(), re.S) if "make_mesh" in block]
  assert len(programs) == 1, "expected one README program with a mesh"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  result = subprocess.run([sys.executable, "-c", programs[0] + README_CHECK], env=dict(env, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0 and "README example ok" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]


# --------------------------------------------------------------------------------------------------------------------
# Helpers.

def make_mesh(shape):
  return jax.make_mesh(shape, ("dp", "cp", "tp"), axis_types=(AxisType.Auto,) * 3)


def collectives(hlo_text: str) -> set[str]:
  return set(re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", hlo_text))


def inputs(batch=4, seqlen=32, heads=4, kv_heads=2, head_dim=8, seed=0, dtype=np.float32, seqlen_kv=None):
  """q, k, v, dout; k and v have seqlen_kv rows (default: seqlen)."""
  seqlen_kv = seqlen if seqlen_kv is None else seqlen_kv
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, seqlen, heads, head_dim)).astype(dtype)
  k = rng.standard_normal((batch, seqlen_kv, kv_heads, head_dim)).astype(dtype)
  v = rng.standard_normal((batch, seqlen_kv, kv_heads, head_dim)).astype(dtype)
  dout = rng.standard_normal((batch, seqlen, heads, head_dim)).astype(dtype)
  return q, k, v, dout


def lengths(mask, batch, seqlen):
  if not te_jax.MaskType.parse(mask).is_padding:
    return {}
  lens = np.array([seqlen, seqlen - 7, 9, 1, seqlen - 12, 0, seqlen, 5][:batch], np.int32)
  return dict(q_seqlens=lens, kv_seqlens=lens)


def attention_and_grads(q, k, v, dout, **kwargs):
  """(out, dq, dk, dv) through a VJP with a given cotangent: no reduction of its own, so the HLO holds only the
  attention's collectives."""
  out, vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, **kwargs), q, k, v)
  return (out,) + vjp(dout)


def run_sharded(mesh, spec, q, k, v, dout, kv_spec=None, **kwargs):
  """jit on `mesh` with q/dout sharded as `spec` and k/v as `kv_spec`; returns (results, compiled HLO text)."""
  kv_spec = spec if kv_spec is None else kv_spec
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (shard(q, spec), shard(k, kv_spec), shard(v, kv_spec), shard(dout, spec))
  with jax.set_mesh(mesh):
    fn = jax.jit(lambda q, k, v, d: attention_and_grads(q, k, v, d, **kwargs))
    compiled = fn.lower(*args).compile()
    results = compiled(*args)
  return [np.asarray(r) for r in results], compiled.as_text()


def unsharded(q, k, v, dout, **kwargs):
  return [np.asarray(r) for r in jax.jit(lambda *a: attention_and_grads(*a, **kwargs))(q, k, v, dout)]


def check_against_unsharded(results, q, k, v, dout, **kwargs):
  expected = unsharded(q, k, v, dout, **kwargs)
  for name, got, want in zip(("out", "dq", "dk", "dv"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)
  return expected


def check_against_reference(results, q, k, v, dout, **kwargs):
  ref = attention_reference(q, k, v, dout=dout, **kwargs)
  for name, got in zip(("out", "dq", "dk", "dv"), results):
    np.testing.assert_allclose(got, ref[name], err_msg=name, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# Batch and head sharding: local, no collectives.

@in_process
@pytest.mark.parametrize("mesh_shape,spec,kv_spec,heads,kv_heads,all_reduce", [
    ((8, 1, 1), P("dp"), P("dp"), 4, 2, False),  # data parallel
    ((2, 2, 2), P(("dp", "cp"), None, "tp"), P(("dp", "cp"), None, "tp"), 4, 2, False),  # data x tensor, GQA
    # 8 head shards, 4 k/v heads: k/v shard over cp, the 2 query heads of a group sit on the 2 tp devices.
    ((1, 4, 2), P(None, None, ("cp", "tp")), P(None, None, "cp"), 8, 4, True),
    ((2, 1, 2), P("dp", None, "tp"), P("dp"), 4, 1, True),  # MQA: the one k/v head replicated over tp
])
def test_batch_and_head_sharding_is_local(mesh_shape, spec, kv_spec, heads, kv_heads, all_reduce):
  """No collective at all, except the sum of dK/dV over devices that share one k/v head (backward only)."""
  q, k, v, dout = inputs(batch=8, heads=heads, kv_heads=kv_heads)
  mesh = make_mesh(mesh_shape)
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    results, hlo = run_sharded(mesh, spec, q, k, v, dout, kv_spec=kv_spec, mask_type="causal")
  check_against_unsharded(results, q, k, v, dout, mask_type="causal")
  assert collectives(hlo) == ({"all-reduce"} if all_reduce else set()), collectives(hlo)
  if all_reduce:  # and it is in the backward only
    _, fwd_hlo = run_forward(mesh, spec, kv_spec, q, k, v, mask_type="causal")
    assert collectives(fwd_hlo) == set()


@in_process
@pytest.mark.parametrize("with_positions", [False, True])
def test_packed_sequences_shard_with_their_batch(with_positions):
  """Segment ids and positions [B, S] sharded over the batch axes with q, k, v: local, no collective."""
  from te_jax.packing import positions_from_lengths, segment_ids_from_lengths
  q, k, v, dout = inputs(batch=8, seqlen=32)
  lens = np.random.default_rng(1).integers(1, 12, (8, 4))
  ids = np.asarray(segment_ids_from_lengths(lens, 32))
  pos = np.asarray(positions_from_lengths(lens, 32))
  mesh = make_mesh((2, 2, 2))
  spec = P(("dp", "cp"), None, "tp")
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))

  def fn(q, k, v, d, ids, pos):
    tokens = dict(q_segment_ids=ids)
    if with_positions:
      tokens.update(q_positions=pos, kv_positions=pos)
    return attention_and_grads(q, k, v, d, mask_type="causal", **tokens)

  args = (shard(q, spec), shard(k, spec), shard(v, spec), shard(dout, spec), shard(ids, P(("dp", "cp"))),
          shard(pos, P(("dp", "cp"))))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).lower(*args).compile()
      results = [np.asarray(r) for r in compiled(*args)]
  assert collectives(compiled.as_text()) == set(), collectives(compiled.as_text())
  expected = [np.asarray(r) for r in jax.jit(fn)(q, k, v, dout, ids, pos)]
  for name, got, want in zip(("out", "dq", "dk", "dv"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)
  tokens = dict(q_segment_ids=ids, **(dict(q_positions=pos, kv_positions=pos) if with_positions else {}))
  check_against_reference(results, q, k, v, dout, mask_type="causal", **tokens)


@in_process
@pytest.mark.parametrize("bias_shape,bias_spec,all_reduce", [
    ((8, 4, 32, 32), P(("dp", "cp"), "tp"), False),  # full: shards with batch and heads, local
    ((1, 4, 32, 32), P(None, "tp"), True),  # relative positions: dbias summed over the batch shards
    ((8, 1, 1, 32), P(("dp", "cp")), True),  # key mask: dbias summed over the head shards
])
def test_bias_shards_with_batch_and_heads(bias_shape, bias_spec, all_reduce):
  """bias sharded like q where it is full: results and every gradient (dbias too) equal the unsharded call's; the only
  collective is the sum of dbias over the shards of its broadcast dims."""
  q, k, v, dout = inputs(batch=8, seqlen=32)
  bias = np.random.default_rng(2).standard_normal(bias_shape).astype(np.float32)
  mesh = make_mesh((2, 2, 2))
  spec = P(("dp", "cp"), None, "tp")
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))

  def fn(q, k, v, d, bias):
    out, vjp = jax.vjp(lambda q, k, v, b: te_jax.fused_attn(q, k, v, mask_type="causal", bias=b), q, k, v, bias)
    return (out,) + vjp(d)

  args = (shard(q, spec), shard(k, spec), shard(v, spec), shard(dout, spec), shard(bias, bias_spec))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).lower(*args).compile()
      results = [np.asarray(r) for r in compiled(*args)]
  assert collectives(compiled.as_text()) == ({"all-reduce"} if all_reduce else set()), collectives(compiled.as_text())
  expected = [np.asarray(r) for r in jax.jit(fn)(q, k, v, dout, bias)]
  for name, got, want in zip(("out", "dq", "dk", "dv", "dbias"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)


@in_process
@pytest.mark.parametrize("spec", [P(("dp", "cp"), None, "tp"), P("tp", None, ("dp", "cp")), P(None, None, "dp")],
                         ids=["batch4_heads2", "batch2_heads4", "heads2"])
def test_dropout_shards_give_the_unsharded_mask(spec):
  """Each batch/head shard adds its global offsets to the dropout operand: the sharded call drops exactly what the
  unsharded call drops (out bitwise; gradients to float32 rounding), with no collective."""
  q, k, v, dout = inputs(batch=8, seqlen=32, kv_heads=4)
  kwargs = dict(mask_type="causal", dropout_rate=0.4, dropout_rng=jax.random.key(3))
  results, hlo = run_sharded(make_mesh((2, 2, 2)), spec, q, k, v, dout, **kwargs)
  assert collectives(hlo) == set(), collectives(hlo)
  expected = check_against_unsharded(results, q, k, v, dout, **kwargs)
  np.testing.assert_array_equal(results[0], expected[0])
  mask = te_jax.dropout_keep_mask(kwargs["dropout_rng"], (8, 4, 32, 32), 0.4)
  check_against_reference(results, q, k, v, dout, mask_type="causal", keep_mask=mask, dropout_rate=0.4)


@in_process
@pytest.mark.parametrize("spec", [P(("dp", "cp"), None, "tp"), P("tp", None, ("dp", "cp"))],
                         ids=["batch4_heads2", "batch2_heads4"])
@pytest.mark.parametrize("block_mask,path", [(False, "ffi"), (True, "ffi"), (True, "legacy")],
                         ids=["mask_mod", "block_mask", "block_mask_legacy"])
def test_mods_see_global_indices_on_every_shard(spec, block_mask, path):
  """score_mod / mask_mod on batch and head shards: each shard's mods see the global b and h (the dropout operand's
  offsets), its captures are whole, and the capture gradients are summed over the shards; results and every gradient
  (the captures' too) equal the unsharded call's. The one collective is that sum."""
  q, k, v, dout = inputs(batch=8, seqlen=32, kv_heads=4)
  rng = np.random.default_rng(4)
  table = rng.standard_normal((8, 4, 16)).astype(np.float32)  # per batch entry and head, by clipped distance
  ids = jnp.asarray(np.sort(rng.integers(0, 3, (8, 32)), axis=1).astype(np.int32))  # each row's documents

  def score_mod(table):
    return lambda s, b, h, qi, ki: s + table[b, h, jnp.clip(qi - ki, 0, 15)]

  def mask_mod(b, h, qi, ki):  # causal within documents, and head 3 of odd rows sees only its first 8 keys
    return (qi >= ki) & (ids[b, qi] == ids[b, ki]) & ((h != 3) | (b % 2 == 0) | (ki < 8))

  mesh = make_mesh((2, 2, 2))
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))

  def fn(q, k, v, d, table):
    kwargs = dict(mask_mod=mask_mod)
    if block_mask:
      kwargs = dict(block_mask=te_jax.create_block_mask(mask_mod, 8, 4, 32, 32, block=(8, 16)))
    out, vjp = jax.vjp(lambda q, k, v, t: te_jax.flex_attention(q, k, v, score_mod(t), **kwargs), q, k, v, table)
    return (out,) + vjp(d)

  args = (shard(q, spec), shard(k, spec), shard(v, spec), shard(dout, spec), shard(table, P()))
  with warnings.catch_warnings(), te_jax.custom_call_path(path):
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).lower(*args).compile()
      results = [np.asarray(r) for r in compiled(*args)]
    expected = [np.asarray(r) for r in jax.jit(fn)(q, k, v, dout, table)]
  hlo = compiled.as_text()
  assert "all-reduce" in collectives(hlo) and "all-gather" not in collectives(hlo), collectives(hlo)
  for name, got, want in zip(("out", "dq", "dk", "dv", "dtable"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)
  assert np.abs(expected[-1]).max() > 0  # the table's gradient is not trivially zero


@in_process
def test_sinks_shard_with_the_batch_and_heads():
  """The kernels merge each head's sink into its rows: the sinks operand ([B, H]) shards with the batch and the heads,
  no collective, and the sharded call equals the unsharded one."""
  q, k, v, dout = inputs(batch=8, seqlen=32, kv_heads=4)
  kwargs = dict(mask_type="causal", sink_logits=np.array([0.5, -1.0, 2.0, 0.0], np.float32))
  results, hlo = run_sharded(make_mesh((2, 2, 2)), P(("dp", "cp"), None, "tp"), q, k, v, dout, **kwargs)
  assert collectives(hlo) == set(), collectives(hlo)
  check_against_unsharded(results, q, k, v, dout, **kwargs)


@in_process
@pytest.mark.parametrize("mode", [True, "per_head"])
def test_fp8_training_entry_shards_with_the_batch_and_heads(mode):
  """fp8=: the quantization's amax is the whole tensor's (or head's) however it is sharded, so the sharded call equals
  the unsharded one (the amax's reduction is the one collective the forward adds)."""
  q, k, v, dout = inputs(batch=8, seqlen=32, kv_heads=2)
  kwargs = dict(mask_type="causal", fp8=mode)
  results, _ = run_sharded(make_mesh((2, 2, 2)), P(("dp", "cp"), None, "tp"), q, k, v, dout, **kwargs)
  check_against_unsharded(results, q, k, v, dout, **kwargs)


@in_process
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa2", "mqa"])
def test_paged_attention_shards_with_its_batch(kv_heads):
  """te_jax.paged_attention with q, the page table and the lengths sharded over the batch and the pools over the kv
  heads (replicated over the batch: every sequence may use any page): the in-place forward is local, no collective,
  and gives the unsharded call's bits; the gradients (through the gathered pages) equal the unsharded ones."""
  rng = np.random.default_rng(4)
  b, sq, heads, d, page_size, max_pages, num_pages = 8, 3, 4, 16, 8, 4, 40
  q = rng.standard_normal((b, sq, heads, d)).astype(np.float32)
  k_pages, v_pages = (rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np.float32) for _ in range(2))
  table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  table[1, 0] = table[0, 0]  # a shared page
  lens = rng.integers(0, max_pages * page_size + 1, b).astype(np.int32)
  dout = rng.standard_normal(q.shape).astype(np.float32)
  mesh = make_mesh((2, 2, 2))
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  batch = ("dp", "cp")
  pool_spec = P(None, None, "tp") if kv_heads > 1 else P()
  args = (shard(q, P(batch, None, "tp")), shard(k_pages, pool_spec), shard(v_pages, pool_spec),
          shard(table, P(batch)), shard(lens, P(batch)))
  forward = lambda q, kp, vp, t, n: te_jax.paged_attention(q, kp, vp, t, n, return_lse=True)

  def grads(q, kp, vp, t, n):
    _, vjp = jax.vjp(lambda q, kp, vp: te_jax.paged_attention(q, kp, vp, t, n), q, kp, vp)
    return vjp(dout)

  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(forward).lower(*args).compile()
      out, lse = (np.asarray(x) for x in compiled(*args))
      sharded_grads = [np.asarray(g) for g in jax.jit(grads)(*args)]
  assert collectives(compiled.as_text()) == set(), collectives(compiled.as_text())
  want_out, want_lse = (np.asarray(x) for x in jax.jit(forward)(q, k_pages, v_pages, table, lens))
  assert out.tobytes() == want_out.tobytes() and lse.tobytes() == want_lse.tobytes()
  for name, got, want in zip(("dq", "dk_pages", "dv_pages"), sharded_grads,
                             jax.jit(grads)(q, k_pages, v_pages, table, lens)):
    np.testing.assert_allclose(got, np.asarray(want), err_msg=name, **TOL)


@in_process
@pytest.mark.parametrize("granularity", ["head", "page"])
def test_fp8_paged_cache_shards_with_its_batch_and_kv_heads(granularity):
  """An FP8 page pool and its descales (the kv_descale operand): the descales' heads shard with the pools' kv heads,
  their pages stay whole with the pools; the in-place forward is local and gives the unsharded call's bits, and q's
  gradient equals the unsharded one."""
  rng = np.random.default_rng(5)
  b, sq, heads, kv_heads, d, page_size, max_pages, num_pages = 8, 2, 4, 2, 16, 8, 4, 40
  q = rng.standard_normal((b, sq, heads, d)).astype(np.float32)
  k8, kd, v8, vd = (x for pages in (rng.standard_normal((num_pages, page_size, kv_heads, d)).astype(np.float32)
                                    for _ in range(2))
                    for x in te_jax.quantize_kv_pages(pages, granularity=granularity))
  table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
  lens = rng.integers(0, max_pages * page_size + 1, b).astype(np.int32)
  dout = rng.standard_normal(q.shape).astype(np.float32)
  mesh = make_mesh((2, 2, 2))
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  batch = ("dp", "cp")
  descale_spec = P("tp") if granularity == "head" else P(None, "tp")
  args = (shard(q, P(batch, None, "tp")), shard(k8, P(None, None, "tp")), shard(kd, descale_spec),
          shard(v8, P(None, None, "tp")), shard(vd, descale_spec), shard(table, P(batch)), shard(lens, P(batch)))
  forward = lambda q, k8, kd, v8, vd, t, n: te_jax.paged_attention(q, k8, v8, t, n, k_descale=kd, v_descale=vd,
                                                                  return_lse=True)

  def dq(q, k8, kd, v8, vd, t, n):
    _, vjp = jax.vjp(lambda q: forward(q, k8, kd, v8, vd, t, n)[0], q)
    return vjp(dout)[0]

  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(forward).lower(*args).compile()
      out, lse = (np.asarray(x) for x in compiled(*args))
      sharded_dq = np.asarray(jax.jit(dq)(*args))
  assert collectives(compiled.as_text()) == set(), collectives(compiled.as_text())
  plain = (q, k8, kd, v8, vd, table, lens)
  want_out, want_lse = (np.asarray(x) for x in jax.jit(forward)(*plain))
  assert out.tobytes() == want_out.tobytes() and lse.tobytes() == want_lse.tobytes()
  np.testing.assert_allclose(sharded_dq, np.asarray(jax.jit(dq)(*plain)), **TOL)


@in_process
def test_fp8_contiguous_cache_shards_with_the_batch_and_heads():
  """fused_attn over an FP8 k and v with per-head descales, sharded over the batch and the heads: the sharded call
  gives the unsharded call's bits."""
  q, k, v, _ = inputs(batch=8, seqlen=32, kv_heads=2)
  (k8, kd), (v8, vd) = (te_jax.quantize_fp8(x, per_head=True) for x in (k, v))
  mesh = make_mesh((2, 2, 2))
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  batch = ("dp", "cp")
  args = (shard(q, P(batch, None, "tp")), shard(k8, P(batch, None, "tp")), shard(kd, P("tp")),
          shard(v8, P(batch, None, "tp")), shard(vd, P("tp")))
  forward = lambda q, k8, kd, v8, vd: te_jax.fused_attn(q, k8, v8, k_descale=kd, v_descale=vd, mask_type="causal")
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(forward).lower(*args).compile()
      out = np.asarray(compiled(*args))
  assert collectives(compiled.as_text()) == set(), collectives(compiled.as_text())
  assert out.tobytes() == np.asarray(jax.jit(forward)(q, k8, kd, v8, vd)).tobytes()


def run_forward(mesh, spec, kv_spec, q, k, v, **kwargs):
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = (shard(q, spec), shard(k, kv_spec), shard(v, kv_spec))
  with jax.set_mesh(mesh):
    compiled = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, **kwargs)).lower(*args).compile()
    return np.asarray(compiled(*args)), compiled.as_text()


@in_process
def test_mismatched_kv_sharding_is_resharded_with_a_warning():
  q, k, v, dout = inputs(batch=8)
  mesh = make_mesh((2, 2, 2))
  with pytest.warns(ReshardWarning, match=r"k \(8, 32, 2, 8\) is sharded along its batch dimension over mesh axes "
                                          r"\('cp',\).*bytes gathered per device"):
    results, _ = run_sharded(mesh, P("dp", None, "tp"), q, k, v, dout, kv_spec=P("cp", None, "tp"),
                             mask_type="causal")
  check_against_unsharded(results, q, k, v, dout, mask_type="causal")


@in_process
@pytest.mark.parametrize("spec,match", [
    (P(None, "cp"), r"sequence dimension over mesh axes \('cp',\).*pass context_parallel_axis="),
    (P(None, None, None, "tp"), r"head-dim dimension over mesh axes \('tp',\).*shard the heads, not the head dim"),
])
def test_unsupported_shardings_warn_and_stay_correct(spec, match):
  q, k, v, dout = inputs()
  with pytest.warns(ReshardWarning, match=match):
    results, _ = run_sharded(make_mesh((2, 2, 2)), spec, q, k, v, dout, mask_type="causal")
  check_against_unsharded(results, q, k, v, dout, mask_type="causal")


# --------------------------------------------------------------------------------------------------------------------
# Context parallelism.

MASKS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")
MESHES = ((2, 2, 2), (1, 4, 2), (1, 8, 1))
CP_CASES = []
for _i, (_strategy, _mask) in enumerate([(s, m) for s in ("all_gather", "ring") for m in MASKS]):
  _mesh = MESHES[_i % len(MESHES)]
  _lb = "causal" in _mask and _mesh != (1, 8, 1)  # load balancing at cp=8 compiles slowly: covered at 4
  CP_CASES.append(pytest.param(_strategy, _mask, _mesh, _lb, 2, id=f"{_strategy}-{_mask}-{_mesh}-lb{int(_lb)}"))
CP_CASES += [
    pytest.param("all_gather", "causal", (1, 8, 1), True, 1, id="all_gather-causal-mqa-lb1"),
    pytest.param("ring", "causal", (2, 2, 2), True, 4, id="ring-causal-mha-(2,2,2)-lb1"),
    pytest.param("ring", "padding_causal", (1, 4, 2), True, 1, id="ring-padding_causal-mqa-(1,4,2)-lb1"),
]


def cp_spec(mesh_shape):
  return P("dp" if mesh_shape[0] > 1 else None, "cp", "tp" if mesh_shape[2] > 1 else None)


def sharded_cp_call(strategy, mask, mesh_shape, load_balanced, kv_heads=2, seed=0, batch=4, **extra):
  q, k, v, dout = inputs(batch=batch, kv_heads=kv_heads, seed=seed)
  kwargs = dict(mask_type=mask, **lengths(mask, q.shape[0], q.shape[1]), **extra)
  mesh = make_mesh(mesh_shape)
  cp = mesh.shape["cp"]
  reorder = (lambda x: np.asarray(te_jax.reorder_for_load_balancing(x, cp))) if load_balanced else (lambda x: x)
  undo = (lambda x: np.asarray(te_jax.inverse_reorder_for_load_balancing(x, cp))) if load_balanced else (lambda x: x)
  spec = cp_spec(mesh_shape)
  kv_spec = spec if kv_heads >= mesh_shape[2] else P(spec[0], "cp")
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    results, hlo = run_sharded(mesh, spec, *(reorder(x) for x in (q, k, v, dout)), kv_spec=kv_spec,
                               context_parallel_axis="cp", context_parallel_strategy=strategy,
                               context_parallel_load_balanced=load_balanced, **kwargs)
  return [undo(r) for r in results], hlo, (q, k, v, dout), kwargs


def check_cp_collectives(hlo, strategy, mesh_shape, kv_heads):
  found = collectives(hlo)
  expected = {"all_gather": {"all-gather", "reduce-scatter"}, "ring": {"collective-permute"}}[strategy]
  if kv_heads < mesh_shape[2]:  # query heads of one k/v group on several devices: dK/dV summed over them
    expected = expected | {"all-reduce"}
  assert found == expected, (strategy, found)
  if strategy == "ring":  # K/V travel by collective-permute, never gathered
    assert "all-gather" not in hlo


@in_process
@pytest.mark.parametrize("strategy,mask,mesh_shape,load_balanced,kv_heads", CP_CASES)
def test_context_parallel(strategy, mask, mesh_shape, load_balanced, kv_heads):
  results, hlo, (q, k, v, dout), kwargs = sharded_cp_call(strategy, mask, mesh_shape, load_balanced, kv_heads)
  check_against_unsharded(results, q, k, v, dout, **kwargs)
  check_against_reference(results, q, k, v, dout, **kwargs)
  check_cp_collectives(hlo, strategy, mesh_shape, kv_heads)


@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_fp8_training_entry(strategy):
  results, _, (q, k, v, dout), kwargs = sharded_cp_call(strategy, "causal", (2, 2, 2), True, fp8="per_head")
  check_against_unsharded(results, q, k, v, dout, **kwargs)


@in_process
@pytest.mark.parametrize("mask,window,load_balanced", [("causal", (5, 0), True),
                                                       ("padding_causal_bottom_right", (3, 2), False)])
def test_context_parallel_sliding_window_all_gather(mask, window, load_balanced):
  results, hlo, (q, k, v, dout), kwargs = sharded_cp_call("all_gather", mask, (2, 4, 1), load_balanced,
                                                          window_size=window)
  check_against_unsharded(results, q, k, v, dout, **kwargs)
  check_cp_collectives(hlo, "all_gather", (2, 4, 1), 2)


@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_alibi_softcap(strategy):
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  results, _, (q, k, v, dout), kwargs = sharded_cp_call(strategy, "causal", (1, 4, 2), True, alibi_slopes=slopes,
                                                        softcap=5.0)
  check_against_unsharded(results, q, k, v, dout, **kwargs)


@in_process
@pytest.mark.parametrize("spec", [P(None, ("dp", "cp"), None, "tp"), P("dp", "cp", None, "tp")],
                         ids=["examples_whole", "examples_sharded"])
def test_mods_under_vmap_on_shards(spec):
  """vmap over a sharded call with mods (the examples folded into the batch, their axis sharded or not): the mods see
  each example's own global b and h, and the shared table's gradient sums over the examples and the shards."""
  rng = np.random.default_rng(7)
  q, k, v, dout = (rng.standard_normal((2, 8, 32, 4, 8)).astype(np.float32) for _ in range(4))  # [N, B, S, H, D]
  table = rng.standard_normal((8, 4, 16)).astype(np.float32)

  def attend(q, k, v, t):
    score_mod = lambda s, b, h, qi, ki: s + t[b, h, jnp.clip(qi - ki, 0, 15)]
    return te_jax.fused_attn(q, k, v, score_mod=score_mod, mask_mod=lambda b, h, qi, ki: (qi >= ki) | (h == b % 4))

  def fn(q, k, v, d, t):
    out, vjp = jax.vjp(lambda q, k, v, t: jax.vmap(attend, in_axes=(0, 0, 0, None))(q, k, v, t), q, k, v, t)
    return (out,) + vjp(d)

  mesh = make_mesh((2, 2, 2))
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  args = [shard(x, spec) for x in (q, k, v, dout)] + [shard(table, P())]
  with jax.set_mesh(mesh):
    results = [np.asarray(r) for r in jax.jit(fn)(*args)]
  expected = [np.asarray(r) for r in jax.jit(fn)(q, k, v, dout, table)]
  for name, got, want in zip(("out", "dq", "dk", "dv", "dtable"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)


@in_process
@pytest.mark.parametrize("block_mask,packed", [(False, False), (True, False), (False, True)],
                         ids=["mask_mod", "block_mask", "segment_ids"])
@pytest.mark.parametrize("load_balanced", [False, True], ids=["lb0", "lb1"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_mods_see_global_indices(strategy, load_balanced, block_mask, packed):
  """score_mod / mask_mod under context parallelism (with batch and head shards): each block pair's kernel call adds
  its first query's and key's global positions to the mods' indices, so the sharded call (load-balanced or not; with
  segment ids the packed path's pieces) equals the unsharded one in natural order, out and every gradient, the
  captured table's too."""
  q, k, v, dout = inputs(batch=4, seqlen=32, kv_heads=2)
  rng = np.random.default_rng(5)
  table = rng.standard_normal((4, 4, 16)).astype(np.float32)
  ids = jnp.asarray(np.sort(rng.integers(0, 3, (4, 32)), axis=1).astype(np.int32))

  def mask_mod(b, h, qi, ki):  # causal within documents; head 3 of odd rows sees only its first 8 keys
    return (qi >= ki) & (ids[b, qi] == ids[b, ki]) & ((h != 3) | (b % 2 == 0) | (ki < 8))

  def fn(q, k, v, d, table, **cp_kwargs):
    kwargs = dict(mask_mod=mask_mod)
    if block_mask:
      kwargs = dict(block_mask=te_jax.create_block_mask(mask_mod, 4, 4, 32, 32, block=(4, 8)))
    if packed:  # the same documents as segment ids too (in the order of q: the load-balanced one when sharded)
      kwargs.update(q_segment_ids=segment_ids[bool(cp_kwargs)])

    def attend(q, k, v, t):
      score_mod = lambda s, b, h, qi, ki: s + t[b, h, jnp.clip(qi - ki, 0, 15)]
      return te_jax.fused_attn(q, k, v, score_mod=score_mod, **kwargs, **cp_kwargs)

    out, vjp = jax.vjp(attend, q, k, v, table)
    return (out,) + vjp(d)

  mesh_shape = (2, 2, 2)
  mesh, cp = make_mesh(mesh_shape), mesh_shape[1]
  reorder = (lambda x: np.asarray(te_jax.reorder_for_load_balancing(x, cp))) if load_balanced else (lambda x: x)
  undo = (lambda x: np.asarray(te_jax.inverse_reorder_for_load_balancing(x, cp))) if load_balanced else (lambda x: x)
  segment_ids = (np.asarray(ids), reorder(np.asarray(ids)))  # unsharded, sharded
  shard = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  spec = cp_spec(mesh_shape)
  args = [shard(reorder(x), spec) for x in (q, k, v, dout)] + [shard(table, P())]
  sharded = jax.jit(lambda *a: fn(*a, context_parallel_axis="cp", context_parallel_strategy=strategy,
                                  context_parallel_load_balanced=load_balanced))
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      results = [np.asarray(r) for r in sharded(*args)]
  results = [undo(r) for r in results[:4]] + results[4:]
  expected = [np.asarray(r) for r in jax.jit(fn)(q, k, v, dout, table)]
  for name, got, want in zip(("out", "dq", "dk", "dv", "dtable"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)


@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_with_sinks(strategy):
  # The sinks apply to each shard's rows of the merged out and lse (te_jax/sinks.py), heads sharded over tp.
  sinks = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
  results, _, (q, k, v, dout), kwargs = sharded_cp_call(strategy, "causal", (1, 4, 2), True, sink_logits=sinks)
  check_against_unsharded(results, q, k, v, dout, **kwargs)


@in_process
def test_padding_with_unequal_lengths_all_gather():
  """padding_causal_bottom_right with q_seqlens != kv_seqlens is exact with the all-gather strategy."""
  q, k, v, dout = inputs()
  kwargs = dict(mask_type="padding_causal_bottom_right", q_seqlens=np.array([32, 10, 3, 20], np.int32),
                kv_seqlens=np.array([30, 25, 32, 20], np.int32))
  results, _ = run_sharded(make_mesh((1, 4, 2)), P(None, "cp", "tp"), q, k, v, dout, context_parallel_axis="cp",
                           **kwargs)
  check_against_unsharded(results, q, k, v, dout, **kwargs)


def packed_tokens(with_positions, batch=4, seqlen=32, seed=0):
  """Random packings, several documents per row and padding (id 0) after them; positions restart per document."""
  lens = np.random.default_rng(seed).integers(1, 8, (batch, 4))
  tokens = dict(q_segment_ids=np.asarray(te_jax.segment_ids_from_lengths(lens, seqlen)))
  if with_positions:
    pos = np.asarray(te_jax.positions_from_lengths(lens, seqlen))
    tokens.update(q_positions=pos, kv_positions=pos)
  return tokens


def check_packed_cp_call(strategy, mask, load_balanced, tokens, mesh_shape=(1, 4, 2), seqlens=(32, 32),
                         reference=False, **kwargs):
  """The ids and positions sharded over cp with q, k, v (reordered with them when load balanced, each by its own
  length): results equal the unsharded call's (and the float64 reference's if `reference`), with the collectives of
  the strategy. seqlens: (Sq, Skv)."""
  q, k, v, dout = inputs(seqlen=seqlens[0], seqlen_kv=seqlens[1])
  mesh = make_mesh(mesh_shape)
  cp = mesh.shape["cp"]
  reorder = (lambda x: np.asarray(te_jax.reorder_for_load_balancing(x, cp))) if load_balanced else (lambda x: x)
  undo = (lambda x: np.asarray(te_jax.inverse_reorder_for_load_balancing(x, cp))) if load_balanced else (lambda x: x)
  spec = cp_spec(mesh_shape)
  shard = lambda x, s: jax.device_put(reorder(x), NamedSharding(mesh, s))
  kwargs = dict(mask_type=mask, **kwargs)

  def fn(q, k, v, d, tokens):
    return attention_and_grads(q, k, v, d, context_parallel_axis="cp", context_parallel_strategy=strategy,
                               context_parallel_load_balanced=load_balanced, **tokens, **kwargs)

  args = (*(shard(x, spec) for x in (q, k, v, dout)), {n: shard(t, P(spec[0], "cp")) for n, t in tokens.items()})
  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh):
      compiled = jax.jit(fn).lower(*args).compile()
      results = [undo(np.asarray(r)) for r in compiled(*args)]
  check_against_unsharded(results, q, k, v, dout, **tokens, **kwargs)
  if reference:
    check_against_reference(results, q, k, v, dout, **tokens, **kwargs)
  check_cp_collectives(compiled.as_text(), strategy, mesh_shape, 2)


@in_process
@pytest.mark.parametrize("with_positions", [False, True], ids=["ids", "ids_positions"])
@pytest.mark.parametrize("load_balanced", [False, True], ids=["lb0", "lb1"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_packed_sequences(strategy, mask, load_balanced, with_positions):
  check_packed_cp_call(strategy, mask, load_balanced, packed_tokens(with_positions, seed=3))


@in_process
@pytest.mark.parametrize("strategy,mask,window,with_positions", [("ring", "causal", (5, 0), False),
                                                                 ("ring", "no_mask", (3, 2), True),
                                                                 ("all_gather", "no_mask", (4, 1), False)])
def test_context_parallel_packed_sequences_with_windows(strategy, mask, window, with_positions):
  """Windows compare positions (global indices without them): any mask type, either strategy; ALiBi too."""
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  check_packed_cp_call(strategy, mask, True, packed_tokens(with_positions, seed=4), window_size=window,
                       alibi_slopes=slopes)


def cross_tokens(kind, seqlen_q, seqlen_kv, batch=4, seed=0):
  """Tokens for Sq != Skv.
  "positions": decoding; K/V a cache at positions 0..Skv-1, q_positions = c + i with c per row (up to the cache
  length Skv - Sq when Sq < Skv, and a few more, so that some queries see the whole cache).
  "ids_positions": packed rows on both sides, document n with lq_n queries and lk_n keys, its queries placed at the
  end of its keys (decoding per document: q_positions = max(lk_n - lq_n, 0) + i); padding (id 0) after them.
  "ids": those ids, and the indices as positions."""
  rng = np.random.default_rng(seed)
  if kind == "positions":
    cache = rng.integers(0, max(seqlen_kv - seqlen_q, 0) + 9, (batch, 1))
    return dict(q_positions=(cache + np.arange(seqlen_q)).astype(np.int32),
                kv_positions=np.tile(np.arange(seqlen_kv, dtype=np.int32), (batch, 1)))
  lq, lk = (rng.integers(1, s // 4 + 1, (batch, 4)) for s in (seqlen_q, seqlen_kv))
  q_ids = np.asarray(te_jax.segment_ids_from_lengths(lq, seqlen_q))
  tokens = dict(q_segment_ids=q_ids, kv_segment_ids=np.asarray(te_jax.segment_ids_from_lengths(lk, seqlen_kv)))
  if kind == "ids_positions":
    shift = np.take_along_axis(np.maximum(lk - lq, 0), np.maximum(q_ids - 1, 0), axis=1)
    tokens.update(q_positions=np.asarray(te_jax.positions_from_lengths(lq, seqlen_q)) + shift.astype(np.int32),
                  kv_positions=np.asarray(te_jax.positions_from_lengths(lk, seqlen_kv)))
  return tokens


CROSS_SEQLENS = [(16, 32), (32, 16)]  # (Sq, Skv): fewer queries than keys (decoding) and more


@in_process
@pytest.mark.parametrize("kind", ["positions", "ids_positions"])
@pytest.mark.parametrize("mask", ["causal", "no_mask"])
@pytest.mark.parametrize("seqlens", CROSS_SEQLENS, ids=["sq16-skv32", "sq32-skv16"])
@pytest.mark.parametrize("load_balanced", [False, True], ids=["lb0", "lb1"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_unequal_lengths(strategy, load_balanced, seqlens, mask, kind):
  """Sq != Skv with positions (and segment ids): q sharded along Sq, K/V along Skv, each chunked (and load-balanced)
  by its own length; equal to the unsharded call and the float64 reference."""
  check_packed_cp_call(strategy, mask, load_balanced, cross_tokens(kind, *seqlens, seed=7), seqlens=seqlens,
                       reference=True)


@in_process
@pytest.mark.parametrize("strategy,mask,window,kind,seqlens,load_balanced", [
    ("ring", "causal", (5, 0), "positions", (16, 32), True),
    ("ring", "no_mask", (3, 2), "ids_positions", (32, 16), False),
    ("all_gather", "causal", (4, 0), "ids", (32, 16), True),
    ("all_gather", "no_mask", (4, 1), "positions", (16, 64), False),
])
def test_context_parallel_unequal_lengths_with_windows(strategy, mask, window, kind, seqlens, load_balanced):
  """Windows and ALiBi compare positions (the indices with ids alone) with Sq != Skv, either strategy."""
  slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
  check_packed_cp_call(strategy, mask, load_balanced, cross_tokens(kind, *seqlens, seed=8), seqlens=seqlens,
                       reference=True, window_size=window, alibi_slopes=slopes)


# --------------------------------------------------------------------------------------------------------------------
# Dropout under context parallelism: every block pair's kernel call gets the global (b, h, i, j) of its first element,
# so the sharded call drops exactly what the unsharded call drops.

DROPOUT_KEY = jax.random.key(21)
RESULTS = ("out", "lse", "dq", "dk", "dv")


def attention_lse_and_grads(q, k, v, dout, dlse, **kwargs):
  """(out, lse, dq, dk, dv) through a VJP with cotangents for both out and lse."""
  (out, lse), vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **kwargs), q, k, v)
  return (out, lse) + vjp((dout, dlse))


def cp_dropout_call(strategy, mask, mesh_shape, load_balanced, kv_heads, rate, tokens=None, path="ffi",
                    seqlens=(32, 32), **extra):
  """The sharded call with dropout (and the ids/positions in `tokens`, sharded with the sequence); returns its results
  in natural order, the inputs and the unsharded call's keyword arguments. seqlens: (Sq, Skv)."""
  q, k, v, dout = inputs(kv_heads=kv_heads, heads=max(4, kv_heads), seqlen=seqlens[0], seqlen_kv=seqlens[1])
  dlse = np.random.default_rng(1).standard_normal((q.shape[0], q.shape[2], q.shape[1])).astype(np.float32)
  tokens = tokens or {}
  kwargs = dict(mask_type=mask, dropout_rate=rate, dropout_rng=DROPOUT_KEY, **lengths(mask, *q.shape[:2]), **extra)
  mesh = make_mesh(mesh_shape)
  cp = mesh.shape["cp"]
  order = te_jax.reorder_for_load_balancing if load_balanced else (lambda x, cp, seq_axis=1: x)
  undo = te_jax.inverse_reorder_for_load_balancing if load_balanced else (lambda x, cp, seq_axis=1: x)
  spec = cp_spec(mesh_shape)
  kv_spec = spec if kv_heads >= mesh_shape[2] else P(spec[0], "cp")
  specs = (spec, kv_spec, kv_spec, spec, P(spec[0], spec[2], "cp"))
  shard = lambda x, s, axis=1: jax.device_put(np.asarray(order(x, cp, seq_axis=axis)), NamedSharding(mesh, s))
  args = [shard(x, s, 2 if i == 4 else 1) for i, (x, s) in enumerate(zip((q, k, v, dout, dlse), specs))]
  args.append({n: shard(t, P(spec[0], "cp")) for n, t in tokens.items()})

  def fn(q, k, v, dout, dlse, tokens):
    return attention_lse_and_grads(q, k, v, dout, dlse, context_parallel_axis="cp", context_parallel_strategy=strategy,
                                   context_parallel_load_balanced=load_balanced, **tokens, **kwargs)

  with warnings.catch_warnings():
    warnings.simplefilter("error", ReshardWarning)
    with jax.set_mesh(mesh), te_jax.custom_call_path(path):
      compiled = jax.jit(fn).lower(*args).compile()
      results = [np.asarray(undo(r, cp, seq_axis=2 if name == "lse" else 1))
                 for name, r in zip(RESULTS, compiled(*args))]
  if path == "legacy":
    te_jax.raise_legacy_failures()
  return results, compiled.as_text(), (q, k, v, dout, dlse), dict(kwargs, **tokens)


def check_cp_dropout(results, q, k, v, dout, dlse, bitwise=(), **kwargs):
  """Equal to the unsharded call (bitwise for the results named in `bitwise`) and to the float64 reference with
  dropout_keep_mask's mask."""
  expected = jax.jit(lambda *a: attention_lse_and_grads(*a, **kwargs))(q, k, v, dout, dlse)
  for name, got, want in zip(RESULTS, results, expected):
    np.testing.assert_allclose(got, np.asarray(want), err_msg=name, **TOL)
    if name in bitwise:
      np.testing.assert_array_equal(got, np.asarray(want), err_msg=name)
  kwargs = dict(kwargs)
  key, rate = kwargs.pop("dropout_rng"), kwargs.pop("dropout_rate")
  kwargs.pop("deterministic", None)
  mask = te_jax.dropout_keep_mask(key, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), rate)
  assert 0 < np.asarray(mask).mean() < 1
  ref = attention_reference(q, k, v, dout=dout, dlse=dlse, keep_mask=mask, dropout_rate=rate, **kwargs)
  for name, got in zip(RESULTS, results):
    np.testing.assert_allclose(got, ref[name], err_msg=name, rtol=1e-4, atol=1e-4)


CP_DROPOUT_CASES = [  # strategy, mask, mesh, load balanced, kv heads, rate
    ("all_gather", "causal", (2, 2, 2), True, 2, 0.1),
    ("ring", "causal", (1, 4, 2), True, 2, 0.5),
    ("all_gather", "no_mask", (1, 8, 1), False, 2, 0.5),
    ("ring", "no_mask", (2, 4, 1), False, 1, 0.1),
    ("ring", "padding_causal", (1, 4, 2), True, 2, 0.5),
    ("all_gather", "padding", (2, 2, 2), False, 2, 0.1),
    ("all_gather", "causal_bottom_right", (1, 4, 2), False, 1, 0.5),
    ("ring", "causal", (2, 2, 2), False, 4, 0.1),
]


@in_process
@pytest.mark.parametrize("strategy,mask,mesh_shape,load_balanced,kv_heads,rate", CP_DROPOUT_CASES,
                         ids=[f"{s}-{m}-{ms}-lb{int(lb)}-kv{kv}-{r}" for s, m, ms, lb, kv, r in CP_DROPOUT_CASES])
def test_context_parallel_dropout(strategy, mask, mesh_shape, load_balanced, kv_heads, rate):
  """out, lse and gradients equal the unsharded call's (out, lse and dq bitwise with all-gather: each query chunk is
  one kernel call over the whole sequence) and the float64 reference with dropout_keep_mask's mask; the strategy's
  collectives only."""
  results, hlo, inputs_, kwargs = cp_dropout_call(strategy, mask, mesh_shape, load_balanced, kv_heads, rate)
  check_cp_dropout(results, *inputs_, bitwise=("out", "lse", "dq") if strategy == "all_gather" else (), **kwargs)
  check_cp_collectives(hlo, strategy, mesh_shape, kv_heads)


@in_process
@pytest.mark.parametrize("with_positions", [False, True], ids=["ids", "ids_positions"])
@pytest.mark.parametrize("load_balanced", [False, True], ids=["lb0", "lb1"])
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_dropout_packed_sequences(strategy, load_balanced, with_positions):
  """With segment ids (and positions): a load-balanced shard is cut into its two contiguous chunks for dropout. out,
  lse and dq are bitwise the unsharded call's with all-gather here too."""
  tokens = packed_tokens(with_positions, seed=5)
  rate = 0.5 if load_balanced else 0.1
  results, hlo, inputs_, kwargs = cp_dropout_call(strategy, "causal", (1, 4, 2), load_balanced, 2, rate, tokens)
  check_cp_dropout(results, *inputs_, bitwise=("out", "lse", "dq") if strategy == "all_gather" else (), **kwargs)
  check_cp_collectives(hlo, strategy, (1, 4, 2), 2)


@in_process
@pytest.mark.parametrize("strategy,load_balanced,seqlens", [("all_gather", True, (16, 32)),
                                                             ("ring", False, (32, 16))])
def test_context_parallel_dropout_unequal_lengths(strategy, load_balanced, seqlens):
  """Sq != Skv with segment ids and positions: each block adds its own side's offsets (query rows of Sq, keys of
  Skv)."""
  tokens = cross_tokens("ids_positions", *seqlens, seed=9)
  results, hlo, inputs_, kwargs = cp_dropout_call(strategy, "causal", (1, 4, 2), load_balanced, 2, 0.5, tokens,
                                                  seqlens=seqlens)
  check_cp_dropout(results, *inputs_, bitwise=("out", "lse", "dq") if strategy == "all_gather" else (), **kwargs)
  check_cp_collectives(hlo, strategy, (1, 4, 2), 2)


@in_process
@pytest.mark.parametrize("tokens", ["plain", "packed", "unequal_lengths"])
def test_context_parallel_dropout_ffi_and_legacy_agree(tokens):
  """Bitwise, with the deterministic backward (the default one sums dq in an order that follows the threads)."""
  seqlens = (16, 32) if tokens == "unequal_lengths" else (32, 32)
  tokens = {"plain": None, "packed": packed_tokens(True, seed=6),
            "unequal_lengths": cross_tokens("ids_positions", *seqlens, seed=6)}[tokens]
  ffi, legacy = (cp_dropout_call("ring", "causal", (1, 4, 2), True, 2, 0.5, tokens, path=path, seqlens=seqlens,
                                 deterministic=True)
                 for path in ("ffi", "legacy"))
  for name, a, b in zip(RESULTS, ffi[0], legacy[0]):
    np.testing.assert_array_equal(a, b, err_msg=name)
  check_cp_dropout(ffi[0], *ffi[2], **ffi[3])


@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_dropout_inside_shard_map(strategy):
  """Inside shard_map, context parallelism adds the sequence offsets itself (the batch and heads are whole here)."""
  q, k, v, dout = inputs()
  dlse = np.random.default_rng(1).standard_normal((q.shape[0], q.shape[2], q.shape[1])).astype(np.float32)
  mesh = make_mesh((1, 8, 1))
  kwargs = dict(mask_type="causal", dropout_rate=0.5, dropout_rng=DROPOUT_KEY)
  reorder = lambda x, axis=1: te_jax.reorder_for_load_balancing(x, 8, seq_axis=axis)
  undo = lambda x, axis=1: np.asarray(te_jax.inverse_reorder_for_load_balancing(x, 8, seq_axis=axis))

  def local(q, k, v, d, dl):
    return attention_lse_and_grads(q, k, v, d, dl, context_parallel_axis="cp", context_parallel_strategy=strategy,
                                   context_parallel_load_balanced=True, **kwargs)

  seq, lse_seq = P(None, "cp"), P(None, None, "cp")
  specs = (seq, seq, seq, seq, lse_seq)
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(seq, lse_seq, seq, seq, seq)))
  results = fn(*(reorder(x) for x in (q, k, v, dout)), reorder(dlse, 2))
  results = [undo(r, 2 if name == "lse" else 1) for name, r in zip(RESULTS, results)]
  check_cp_dropout(results, q, k, v, dout, dlse, **kwargs)


@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_context_parallel_mods_inside_shard_map(strategy):
  """Inside shard_map (the sequence axis manual) the mods see global positions too, the block mask the call builds is
  the whole sequence's, and the captured table's gradient is summed over the sequence shards."""
  q, k, v, dout = inputs()
  table = np.random.default_rng(6).standard_normal((4, 16)).astype(np.float32)
  mesh = make_mesh((1, 8, 1))
  reorder = lambda x: te_jax.reorder_for_load_balancing(x, 8)
  undo = lambda x: np.asarray(te_jax.inverse_reorder_for_load_balancing(x, 8))
  mask_mod = lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 12)

  def attend(q, k, v, d, t, **cp_kwargs):
    score_mod = lambda s, b, h, qi, ki: s + t[h, jnp.clip(qi - ki, 0, 15)]
    out, vjp = jax.vjp(lambda q, k, v, t: te_jax.fused_attn(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                            **cp_kwargs), q, k, v, t)
    return (out,) + vjp(d)

  def local(q, k, v, d, t):
    return attend(q, k, v, d, t, context_parallel_axis="cp", context_parallel_strategy=strategy,
                  context_parallel_load_balanced=True)

  seq = P(None, "cp")
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(seq, seq, seq, seq, P()), out_specs=(seq,) * 4 + (P(),)))
  results = fn(*(reorder(x) for x in (q, k, v, dout)), table)
  results = [undo(r) for r in results[:4]] + [np.asarray(results[4])]
  expected = [np.asarray(r) for r in jax.jit(attend)(q, k, v, dout, table)]
  for name, got, want in zip(("out", "dq", "dk", "dv", "dtable"), results, expected):
    np.testing.assert_allclose(got, want, err_msg=name, **TOL)


# --------------------------------------------------------------------------------------------------------------------
# shard_map and vmap.

@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_inside_shard_map(strategy):
  """A user calling fused_attn on local shards inside shard_map (every mesh axis manual)."""
  q, k, v, dout = inputs(batch=4)
  mesh = make_mesh((2, 2, 2))
  spec = P("dp", "cp", "tp")
  kwargs = dict(mask_type="causal")

  def local(q, k, v, d):
    return attention_and_grads(q, k, v, d, context_parallel_axis="cp", context_parallel_strategy=strategy, **kwargs)

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4))
  results = [np.asarray(r) for r in fn(q, k, v, dout)]
  check_against_unsharded(results, q, k, v, dout, **kwargs)


@in_process
@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
def test_inside_shard_map_with_unequal_lengths(strategy):
  """Decoding positions (Sq < Skv) on local shards inside shard_map: fused_attn sees Sq/N queries and Skv/N keys
  (load balanced with the ring: each side reordered by its own length)."""
  q, k, v, dout = inputs(seqlen=16, seqlen_kv=32)
  tokens = cross_tokens("positions", 16, 32, seed=10)
  mesh = make_mesh((2, 2, 2))
  load_balanced = strategy == "ring"
  reorder = (lambda x: te_jax.reorder_for_load_balancing(x, 2)) if load_balanced else (lambda x: x)
  undo = (lambda x: te_jax.inverse_reorder_for_load_balancing(x, 2)) if load_balanced else (lambda x: x)
  kwargs = dict(mask_type="causal", **tokens)

  def local(q, k, v, d, tokens):
    return attention_and_grads(q, k, v, d, context_parallel_axis="cp", context_parallel_strategy=strategy,
                               context_parallel_load_balanced=load_balanced, mask_type="causal", **tokens)

  spec = P("dp", "cp", "tp")
  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 4 + ({n: P("dp", "cp") for n in tokens},),
                             out_specs=(spec,) * 4))
  results = fn(*(reorder(x) for x in (q, k, v, dout)), {n: reorder(t) for n, t in tokens.items()})
  check_against_unsharded([np.asarray(undo(r)) for r in results], q, k, v, dout, **kwargs)


@in_process
def test_batch_sharding_inside_shard_map_without_cp():
  q, k, v, dout = inputs(batch=8)
  mesh = make_mesh((8, 1, 1))
  fn = jax.jit(jax.shard_map(lambda *a: attention_and_grads(*a, mask_type="causal"), mesh=mesh,
                             in_specs=(P("dp"),) * 4, out_specs=(P("dp"),) * 4))
  check_against_unsharded([np.asarray(r) for r in fn(q, k, v, dout)], q, k, v, dout, mask_type="causal")


@in_process
def test_vmap_over_a_leading_axis_with_context_parallelism():
  q, k, v, dout = (np.stack([x, x[::-1]]) for x in inputs(batch=2))  # [2, B, S, H, D]
  mesh = make_mesh((2, 2, 2))
  spec = P(None, "dp", "cp", "tp")
  kwargs = dict(mask_type="causal")
  shard = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    fn = jax.jit(jax.vmap(lambda *a: attention_and_grads(*a, context_parallel_axis="cp",
                                                         context_parallel_strategy="ring", **kwargs)))
    compiled = fn.lower(*map(shard, (q, k, v, dout))).compile()
    results = [np.asarray(r) for r in compiled(*map(shard, (q, k, v, dout)))]
  expected = [np.asarray(r) for r in jax.jit(jax.vmap(lambda *a: attention_and_grads(*a, **kwargs)))(q, k, v, dout)]
  for got, want in zip(results, expected):
    np.testing.assert_allclose(got, want, **TOL)
  assert collectives(compiled.as_text()) == {"collective-permute"}


@in_process
@pytest.mark.parametrize("strategy", ("all_gather", "ring"))
def test_context_parallel_takes_the_mesh_from_the_inputs_sharding(strategy):
  """No mesh in context: the axis is found in q, k and v's NamedSharding (jitted and eager), and the call equals the
  one under `jax.set_mesh`, with the strategy's collective in the program; unsharded inputs are still refused."""
  mesh = make_mesh((2, 4, 1))
  q, k, v, dout = inputs(seqlen=32)
  kw = dict(mask_type="causal", context_parallel_axis="cp", context_parallel_strategy=strategy)
  in_context, _ = run_sharded(mesh, P("dp", "cp"), q, k, v, dout, **kw)
  args = [jax.device_put(x, NamedSharding(mesh, P("dp", "cp"))) for x in (q, k, v, dout)]
  fn = jax.jit(lambda q, k, v, d: attention_and_grads(q, k, v, d, **kw))
  compiled = fn.lower(*args).compile()
  for name, got, want in zip(("out", "dq", "dk", "dv"), compiled(*args), in_context):
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=name)
  assert ("collective-permute" if strategy == "ring" else "all-gather") in collectives(compiled.as_text())
  np.testing.assert_array_equal(np.asarray(te_jax.fused_attn(*args[:3], **kw)), in_context[0])  # eager
  with pytest.raises(ValueError, match="'cp' is not an axis of the mesh in context nor of q, k or v's sharding"):
    te_jax.fused_attn(q, k, v, **kw)


# --------------------------------------------------------------------------------------------------------------------
# Refusals, load-balancing helpers.

@in_process
@pytest.mark.parametrize("kwargs,error,match", [
    (dict(mask_type="no_mask", window_size=(4, 4)), NotImplementedError, "needs a causal mask type"),
    (dict(mask_type="causal", window_size=(4, 0), context_parallel_strategy="ring"), NotImplementedError,
     "all_gather' only"),
    (dict(mask_type="padding_causal", q_seqlens=np.array([9, 9, 9, 9], np.int32),
          kv_seqlens=np.array([9, 5, 9, 9], np.int32)), NotImplementedError, r"q_seqlens <= kv_seqlens.*\[1\]"),
    (dict(mask_type="padding_causal_bottom_right", q_seqlens=np.array([9, 9, 9, 9], np.int32),
          kv_seqlens=np.array([9, 12, 9, 9], np.int32), context_parallel_strategy="ring"), NotImplementedError,
     r"q_seqlens == kv_seqlens"),
    (dict(context_parallel_axis="sp"), ValueError, "'sp' is not an axis of the mesh in context nor of q, k or v's "
     "sharding"),
    (dict(context_parallel_strategy="tree"), ValueError, "context_parallel_strategy must be one of"),
    (dict(context_parallel_load_balanced=True, seqlen=24), ValueError,
     r"Sq \(q's sequence length\) = 24 must be a multiple of 16"),
    (dict(q_positions=np.zeros((4, 36), np.int32), seqlen=36, seqlen_kv=32), ValueError,
     r"Sq \(q's sequence length\) = 36 must be a multiple of 8"),
    (dict(kv_positions=np.zeros((4, 20), np.int32), seqlen_kv=20), ValueError,
     r"Skv \(k's and v's sequence length\) = 20 must be a multiple of 8"),
    (dict(mask_type="causal", seqlen_kv=16), NotImplementedError,
     r"Sq != Skv \(Sq=32, Skv=16\) needs token positions: pass q_positions and kv_positions"),
    (dict(mask_type="causal", bias=np.zeros((1, 1, 1, 32), np.float32)), ValueError,
     "bias is not supported with context parallelism"),
])
def test_context_parallel_refusals(kwargs, error, match):
  kwargs = dict(kwargs)
  q, k, v, _ = inputs(seqlen=kwargs.pop("seqlen", 32))
  seqlen_kv = kwargs.pop("seqlen_kv", k.shape[1])
  k, v = k[:, :seqlen_kv], v[:, :seqlen_kv]
  kwargs.setdefault("context_parallel_axis", "cp")
  with jax.set_mesh(make_mesh((1, 8, 1))):
    with pytest.raises(error, match=match):
      te_jax.fused_attn(q, k, v, **kwargs)


def test_context_parallel_refuses_paging_before_comparing_lengths():
  """A paged k is a pool [pages, page_size, Hkv, D]: its dim 1 is no sequence, so the paging refusal comes first."""
  from te_jax import context_parallel
  from te_jax.attention_config import AttentionConfig
  config = AttentionConfig(mask_type=te_jax.MaskType.PADDING, window_left=-1, window_right=-1, scale=0.25,
                           softcap=0.0, has_alibi=False, page_size=16)
  cp = context_parallel.ContextParallel(axis="cp", strategy="all_gather", load_balanced=False, size=2)
  with pytest.raises(ValueError, match=r"a paged KV cache \(page_size 16\) is not supported"):
    context_parallel.check_supported(config, cp, (2, 4, 4, 8), (10, 16, 2, 8))


def test_context_parallel_arguments_need_an_axis():
  q, k, v, _ = inputs(seqlen=16)
  with pytest.raises(ValueError, match="need context_parallel_axis"):
    te_jax.fused_attn(q, k, v, context_parallel_load_balanced=True)


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_load_balancing_round_trip_and_layout(cp_size):
  x = np.arange(2 * 8 * cp_size * 3).reshape(2, 8 * cp_size, 3)
  y = np.asarray(te_jax.reorder_for_load_balancing(x, cp_size))
  np.testing.assert_array_equal(np.asarray(te_jax.inverse_reorder_for_load_balancing(y, cp_size)), x)
  chunk = 4
  shard0 = y[:, : 8, 0] // 3  # shard 0 holds the first and the last chunk
  np.testing.assert_array_equal(shard0[0], np.r_[0:chunk, 8 * cp_size - chunk:8 * cp_size])
  with pytest.raises(ValueError, match="not a multiple of"):
    te_jax.reorder_for_load_balancing(x[:, :-1], cp_size)
  for bad in (0, True, 2.0):
    with pytest.raises(ValueError, match=f"cp_size must be a positive int, got {bad!r}"):
      te_jax.reorder_for_load_balancing(x, bad)


def test_fp8_attention_descales_shard_with_the_query_heads():
  # FP8 q, k and v (the CUDA FP8 kernel's call): the kv_descale operand is [3, 1, H], its heads the query heads, where an
  # FP8 KV cache's [2, blocks, Hkv] are k's.
  from jax._src.lib.mlir import ir
  from te_jax import sharding
  with ir.Context(), ir.Location.unknown():
    def tensor(shape, element):
      return ir.RankedTensorType.get(shape, element)
    f32, bf16, u32 = ir.F32Type.get(), ir.BF16Type.get(), ir.IntegerType.get_unsigned(32)
    i32 = ir.IntegerType.get_signless(32)
    options = [tensor([2], i32), tensor([2], i32), tensor([1, 1], f32), tensor([1, 1], f32)] + \
        [tensor([1, 1], i32)] * 4 + [tensor([1, 1], i32)]
    tail = [tensor([1, 1, 1, 1], f32), tensor([6], u32)]
    for element, descale, expected in ((ir.Float8E4M3FNType.get(), [3, 1, 8], "kvd opt9x1 (hk g)"),
                                       (bf16, [2, 2, 2], "kvd b hk")):
      q, kv = tensor([2, 64, 8, 128], element), tensor([2, 64, 2, 128], element)
      types = [q, kv, kv] + options + [tensor(descale, f32)] + tail
      h, _ = sharding._heads_rule(types)
      rule, _ = sharding._options_rule(types, h, "sq", "skv", False)
      assert rule.split(", ")[9] == expected, rule
