"""GPU tests of packed sequences (segment ids and positions; the CUDA kernels built with tokens): out, lse and every
gradient against the float64 reference for random packings (empty rows, all-id-0 rows), unsorted ids, random and
decode-style positions, with masks, windows, soft-cap, ALiBi, GQA/MQA, D != Dv, bf16 and fp16, both backwards; FFI and
legacy bitwise equal; a packed row equals its documents run alone; NaN in one document stays there. The sm90 document
reading (sorted ids, forward and backward) on short and long documents, and the ids it must leave to the token tables
(an id in two runs, positions with gaps); gpu_check.sh runs them with the token tables alone (TE_JAX_SM90_DOCUMENTS=0)
and with the forward's reading alone (=forward) too. Skipped without a GPU."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

# The CUDA tests' GPU list (importing it skips this module without a GPU), inputs, runner and reference check.
from test_cuda_attention import (_GPUS, TOL, _check_against_reference, _inputs, _rel, _run,  # noqa: E402
                                 _run_on_both_paths)
from test_packed_sequences import random_lengths  # noqa: E402

import te_jax  # noqa: E402
from te_jax._cuda_test_configs import PACKED_CASES  # noqa: E402
from te_jax.packing import positions_from_lengths, segment_ids_from_lengths  # noqa: E402


def _tokens(case, kind: str, rng) -> dict:
  b, sq, skv = case[2], case[3], case[4]
  if kind == "ids":
    ids = segment_ids_from_lengths(random_lengths(rng, b, sq), sq)
    return dict(q_segment_ids=ids) if sq == skv else dict(q_segment_ids=ids, kv_segment_ids=ids[:, :skv])
  if kind == "ids+positions":
    lengths = random_lengths(rng, b, sq)
    ids, pos = segment_ids_from_lengths(lengths, sq), positions_from_lengths(lengths, sq)
    return dict(q_segment_ids=ids, q_positions=pos, kv_positions=pos)
  if kind == "random_ids":  # unsorted, from a small set, with zeros: only the tables' conservative bounds hold
    return dict(q_segment_ids=jnp.asarray(rng.integers(0, 4, (b, sq)), jnp.int32),
                kv_segment_ids=jnp.asarray(rng.integers(0, 4, (b, skv)), jnp.int32))
  if kind == "random_positions":  # unsorted, repeated, some before every key
    return dict(q_positions=jnp.asarray(rng.integers(-20, sq + 20, (b, sq)), jnp.int32),
                kv_positions=jnp.asarray(rng.integers(0, skv, (b, skv)), jnp.int32))
  if kind == "repeated_id":  # runs 1, 2, 1: the two runs of id 1 see each other, so they are not two documents
    ids = np.ones((b, sq), np.int32)
    ids[:, sq // 3:2 * sq // 3] = 2
    return dict(q_segment_ids=jnp.asarray(ids))
  if kind == "repeated_across_chunks":  # runs 1, 2, 1, the second run of id 1 from token 2048: a table chunk's first
    ids = np.ones((b, sq), np.int32)
    ids[:, 1000:2048] = 2
    return dict(q_segment_ids=jnp.asarray(ids))
  if kind == "gapped_positions":  # sorted ids, positions stepping by 2: a window on them is not the one on indices
    lengths = random_lengths(rng, b, sq)
    return dict(q_segment_ids=segment_ids_from_lengths(lengths, sq),
                q_positions=2 * positions_from_lengths(lengths, sq), kv_positions=2 * positions_from_lengths(lengths, sq))
  if kind == "tiny_documents":  # documents of 1-3 tokens beside long ones, padding (id 0) runs between them
    ids = np.zeros((b, sq), np.int32)
    for row in range(b):
      at, doc = 0, 1
      while at < sq:
        n = int(rng.choice([1, 2, 3, 129, 250]))
        if rng.random() < 0.8:
          ids[row, at:at + n] = doc
          doc += 1
        at += n
    return dict(q_segment_ids=jnp.asarray(ids))
  if kind == "long_documents":  # 130-320 tokens each, then padding: within the backward's document grid
    lengths = []
    for _ in range(b):
      row = []
      while sum(row) < sq - 320:
        row.append(int(rng.integers(130, 321)))
      lengths.append(row + [0] * (sq // 130 - len(row)))
    return dict(q_segment_ids=segment_ids_from_lengths(np.array(lengths), sq))
  if kind == "decode":  # q_positions = cache length + i, keys by index
    return dict(q_positions=jnp.asarray(np.broadcast_to(skv - sq + np.arange(sq), (b, sq)), jnp.int32))
  raise ValueError(kind)


def _packed_inputs(case, kind):
  seed = zlib.crc32(case[0].encode())
  q, k, v, kwargs, dout, dlse = _inputs(case, seed)
  kwargs.update(_tokens(case, kind, np.random.default_rng(seed + 1)), engine="te")
  return q, k, v, kwargs, dout, dlse


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("case,kind", PACKED_CASES, ids=[c[0] for c, _ in PACKED_CASES])
def test_packed_matches_reference_and_paths_agree(case, kind, deterministic):
  q, k, v, kwargs, dout, dlse = _packed_inputs(case, kind)
  kwargs.update(deterministic=deterministic)
  ffi, _ = _run_on_both_paths(q, k, v, kwargs, dout, dlse)
  errors = _check_against_reference(case, ffi, q, k, v, kwargs, dout, dlse)
  print(f"{case[0]} {kind}: " + " ".join(f"{key}={val:.2e}" for key, val in errors.items()))


def test_all_padding_rows_give_zero_and_minus_inf():
  case = PACKED_CASES[0][0]
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=7)
  kwargs.update(q_segment_ids=jnp.zeros((case[2], case[3]), jnp.int32), engine="te")
  out, lse, dq, dk, dv = _run(q, k, v, kwargs, dout, dlse, _GPUS[0])
  assert np.all(out.astype(np.float32) == 0) and np.all(lse == -np.inf)
  for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.all(g.astype(np.float32) == 0), name


@pytest.mark.parametrize("mask,alibi", [("causal", False), ("no_mask", True)])
def test_packed_row_equals_documents_alone(mask, alibi):
  """A row of documents of 300, 200 and 150 tokens and padding: each document's outputs and gradients are those of the
  document run alone (the same kernels, so to bf16 rounding of different tilings)."""
  lengths, seqlen, heads, d = [300, 200, 150], 700, 4, 128
  rng = np.random.default_rng(11)
  q, k, v, dout = (jnp.asarray(rng.standard_normal((1, seqlen, heads, d)), jnp.bfloat16) for _ in range(4))
  slopes = jnp.asarray(rng.uniform(0.01, 0.3, heads), jnp.float32) if alibi else None
  ids = segment_ids_from_lengths(np.array([lengths]), seqlen)
  pos = positions_from_lengths(np.array([lengths]), seqlen)

  def out_and_grads(q, k, v, dout, **kw):
    out, vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=mask, alibi_slopes=slopes, engine="te",
                                                         **kw), q, k, v)
    return (out, *vjp(dout))

  packed = jax.jit(lambda q, k, v, dout: out_and_grads(q, k, v, dout, q_segment_ids=ids, q_positions=pos,
                                                       kv_positions=pos))(q, k, v, dout)
  packed = [np.asarray(x, np.float32) for x in packed]
  start = 0
  for n in lengths:
    part = slice(start, start + n)
    alone = [np.asarray(x, np.float32)
             for x in jax.jit(out_and_grads)(q[:, part], k[:, part], v[:, part], dout[:, part])]
    for name, got, want in zip(("out", "dq", "dk", "dv"), packed, alone):
      assert _rel(got[:, part], want) < TOL["bfloat16"]["grad" if name != "out" else "out"], (name, n)
    start += n
  for name, got in zip(("out", "dq", "dk", "dv"), packed):
    assert np.all(got[:, start:] == 0), name


def test_nonfinite_v_reaches_only_its_document():
  """A NaN in V of document 1 and an inf in V of document 2, in key tiles that straddle the documents' boundary: the
  other document's rows stay finite (keys a row does not see never affect it), the own document's rows that see the
  value are non-finite (the kernels make a non-finite v's columns NaN, not inf: tests/test_cuda_attention.py)."""
  rng = np.random.default_rng(5)
  q, k, v = (rng.standard_normal((1, 400, 2, 64)).astype(np.float32) for _ in range(3))
  v[0, 180, 1, 3] = np.nan
  v[0, 230, 0, 7] = np.inf
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  ids = segment_ids_from_lengths(np.array([[200, 200]]), 400)
  out = np.asarray(jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", q_segment_ids=ids,
                                                              engine="te"))(q, k, v), np.float32)
  assert np.isfinite(out[0, :200, 0]).all() and np.isfinite(out[0, 200:, 1]).all()
  assert np.isnan(out[0, 180:200, 1, 3]).all() and not np.isfinite(out[0, 230:, 0, 7]).any()
  assert np.isfinite(out[0, 200:230, 0, 7]).all()  # rows before the inf key do not see it
