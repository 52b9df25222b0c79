"""GPU tests of the CUDA backend, on each engine (te_jax's kernels and cuDNN): forward, lse and every gradient against
the float64 reference (te_jax/reference.py) for every mask, window, softcap, ALiBi, GQA/MQA, D != Dv, ragged lengths,
bf16 and fp16; FFI and legacy bitwise equal; CPU and GPU backends agree; NaN/inf inputs follow the formula; invalid
run-time lengths give NaN, never out-of-bounds reads; the configurations cuDNN refuses are listed with their reasons.
Skipped without a GPU."""

from __future__ import annotations

import zlib
from functools import partial

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

try:
  _GPUS = jax.devices("gpu")
except RuntimeError:
  _GPUS = []
if not _GPUS:
  pytest.skip("no GPU: the CUDA backend tests need one", allow_module_level=True)
try:
  import te_jax._cuda  # noqa: F401,E402  (registers the cuda backend)
except ImportError as e:
  pytest.skip(f"te_jax was built without its CUDA backend: {e}", allow_module_level=True)

import te_jax  # noqa: E402
from te_jax._cuda import ext  # noqa: E402
from te_jax._cuda_test_configs import CASES  # noqa: E402
from te_jax.reference import attention_reference  # noqa: E402

# Relative Frobenius error bounds: bf16 has 8 mantissa bits, fp16 11; P and dS are rounded to the input dtype before
# their matrix products (as in FlashAttention), so gradients get a looser bound than the output.
TOL = {"bfloat16": dict(out=2e-2, grad=4e-2, lse=2e-2), "float16": dict(out=4e-3, grad=1e-2, lse=5e-3)}


def _inputs(case, seed):
  name, dtype, b, sq, skv, h, hkv, d, dv, mask, window, softcap, alibi, ragged = case
  rng = np.random.default_rng(seed)
  dt = jnp.dtype(dtype)
  q = jnp.asarray(rng.standard_normal((b, sq, h, d)), dt)
  k = jnp.asarray(rng.standard_normal((b, skv, hkv, d)), dt)
  v = jnp.asarray(rng.standard_normal((b, skv, hkv, dv)), dt)
  kwargs = dict(mask_type=mask, window_size=window, softcap=softcap)
  if ragged:
    qs = rng.integers(0, sq + 1, size=b).astype(np.int32)
    qs[0] = sq
    ks = rng.integers(1, skv + 1, size=b).astype(np.int32)
    if b > 2:
      qs[2] = 0  # an empty batch
    kwargs.update(q_seqlens=jnp.asarray(qs), kv_seqlens=jnp.asarray(ks))
  if alibi:
    kwargs["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.3, size=(b, h)), jnp.float32)
  dout = jnp.asarray(rng.standard_normal((b, sq, h, dv)), dt)
  dlse = jnp.asarray(rng.standard_normal((b, h, sq)), jnp.float32)
  return q, k, v, kwargs, dout, dlse


def _run(q, k, v, kwargs, dout, dlse, device, lse_grad=True):
  """out, lse, dq, dk, dv. lse_grad=False: the gradients are those of a loss of out alone (the only backward cuDNN
  serves), and lse comes from the same forward."""
  args = jax.device_put((q, k, v, dout, dlse), device)
  kw = {key: (jax.device_put(val, device) if hasattr(val, "shape") else val) for key, val in kwargs.items()}

  @jax.jit
  def f(q, k, v, dout, dlse):
    if lse_grad:
      (out, lse), vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, return_lse=True, **kw), q, k, v)
      return (out, lse, *vjp((dout, dlse)))
    out, vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, **kw), q, k, v)
    _, lse = te_jax.fused_attn(q, k, v, return_lse=True, **kw)
    return (out, lse, *vjp(dout))

  return [np.asarray(x) for x in f(*args)]


def _run_on_both_paths(q, k, v, kwargs, dout, dlse, lse_grad=True):
  """_run's results on the FFI and on the legacy path, checked bitwise equal: all of them with
  kwargs["deterministic"], else all but dq (an atomic dq's float additions land in any order)."""
  results = []
  for path in ("ffi", "legacy"):
    with te_jax.custom_call_path(path):
      results.append(_run(q, k, v, kwargs, dout, dlse, _GPUS[0], lse_grad))
  te_jax.raise_legacy_failures()
  ffi, legacy = results
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), ffi, legacy):
    if kwargs.get("deterministic") or name != "dq":
      assert a.tobytes() == b.tobytes(), f"FFI and legacy {name} differ"
  return ffi, legacy


def _rel(x, ref):
  x = np.asarray(x, np.float64)
  num = np.linalg.norm(x - ref)
  den = max(np.linalg.norm(ref), 1e-6)
  return num / den


def _check_against_reference(case, results, q, k, v, kwargs, dout, dlse, lse_grad=True):
  dtype = case[1]
  out, lse, dq, dk, dv = results
  for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.isfinite(np.asarray(x, np.float64)).all(), f"{name} has non-finite values"
  ref_kwargs = {key: (np.asarray(val) if hasattr(val, "shape") else val) for key, val in kwargs.items()
                if key not in ("deterministic", "engine")}
  ref = attention_reference(np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(v, np.float64),
                            dout=np.asarray(dout, np.float64), dlse=np.asarray(dlse, np.float64) if lse_grad else None,
                            **ref_kwargs)
  tol = TOL[dtype]
  finite = np.isfinite(ref["lse"])
  assert np.array_equal(np.isfinite(lse), finite), "lse is -inf exactly on the rows that see no key"
  assert (lse[~finite] == -np.inf).all(), "empty rows have lse = -inf"
  if finite.any():
    assert np.max(np.abs(lse[finite] - ref["lse"][finite])) < tol["lse"] * max(1.0, np.abs(ref["lse"][finite]).max())
  errors = {"out": _rel(out, ref["out"]), "dq": _rel(dq, ref["dq"]), "dk": _rel(dk, ref["dk"]), "dv": _rel(dv, ref["dv"])}
  assert errors["out"] < tol["out"], errors
  for g in ("dq", "dk", "dv"):
    assert errors[g] < tol["grad"], errors
  return errors


# The cases cuDNN does not serve, with a pattern of the reason engine="cudnn" must give (engine="auto" then runs
# te_jax's kernels). Every other case must run on cuDNN and match the reference.
CUDNN_REFUSES = {
    "causal_br_sq_gt_skv": "no visible key",
    "softcap_d128": "soft-cap",
    "alibi_d64": "ALiBi",
    "softcap_alibi_window": "soft-cap|ALiBi",
    "d192_softcap_alibi_win": "soft-cap|ALiBi",
}


def test_cudnn_engine_is_available():
  available, reason = ext.cudnn_available()
  assert available, reason
  assert ext.cudnn_version().startswith("9.")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("engine", ["te", "cudnn"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_and_paths_agree(case, engine, deterministic):
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=zlib.crc32(case[0].encode()))
  kwargs.update(deterministic=deterministic, engine=engine)
  gpu = _GPUS[0]
  lse_grad = engine == "te"  # cuDNN's backward takes no gradient through lse (tested in test_cudnn_refusals)
  if engine == "cudnn" and case[0] in CUDNN_REFUSES:
    with pytest.raises(te_jax.EngineUnavailableError, match=CUDNN_REFUSES[case[0]]):
      _run(q, k, v, kwargs, dout, dlse, gpu, lse_grad)
    return
  ffi, legacy = _run_on_both_paths(q, k, v, kwargs, dout, dlse, lse_grad)
  errors = _check_against_reference(case, ffi, q, k, v, kwargs, dout, dlse, lse_grad)
  _check_against_reference(case, legacy, q, k, v, kwargs, dout, dlse, lse_grad)
  print(f"{case[0]} {engine} deterministic={deterministic}: " +
        " ".join(f"{key}={val:.2e}" for key, val in errors.items()))


def test_cudnn_refusals_and_auto():
  """engine="cudnn" raises, naming the reason, where cuDNN cannot meet te_jax's contract; "auto" runs te_jax's kernels
  there, and so does a backward whose lse has a gradient."""
  case = CASES[1]
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=5)
  for extra, reason in ((dict(softcap=10.0), "soft-cap"),
                        (dict(alibi_slopes=jnp.full((q.shape[2],), 0.1, jnp.float32)), "ALiBi")):
    with pytest.raises(te_jax.EngineUnavailableError, match=reason):
      jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, engine="cudnn", **dict(kwargs, **extra)))(q, k, v)
  with pytest.raises(te_jax.EngineUnavailableError, match="gradient through lse"):
    _run(q, k, v, dict(kwargs, engine="cudnn"), dout, dlse, _GPUS[0], lse_grad=True)
  auto = _run(q, k, v, dict(kwargs, engine="auto"), dout, dlse, _GPUS[0], lse_grad=True)
  te = _run(q, k, v, dict(kwargs, engine="te"), dout, dlse, _GPUS[0], lse_grad=True)
  for name, a, b in zip(("dq", "dk", "dv"), auto[2:], te[2:]):
    assert _rel(np.asarray(a, np.float64), np.asarray(b, np.float64)) < 1e-2, name


@pytest.mark.parametrize("case", [CASES[5], CASES[15]], ids=[CASES[i][0] for i in (5, 15)])
def test_deterministic_backward_is_reproducible_and_agrees_with_atomic(case):
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=11)
  kwargs = dict(kwargs, engine="te")  # te_jax's two backward schemes; "auto" could time another engine in per call
  first = _run(q, k, v, dict(kwargs, deterministic=True), dout, dlse, _GPUS[0])
  second = _run(q, k, v, dict(kwargs, deterministic=True), dout, dlse, _GPUS[0])
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
    assert a.tobytes() == b.tobytes(), f"deterministic {name} differs between two runs"
  atomic = _run(q, k, v, dict(kwargs, deterministic=False), dout, dlse, _GPUS[0])
  for name, a, b in zip(("out", "lse"), first[:2], atomic[:2]):
    assert a.tobytes() == b.tobytes(), f"{name} depends on the backward's scheme"
  # The same rounded products summed in another order (dq) or over other tile shapes (dk, dv): within a few ulps of
  # the element type, far below the error against the float64 reference.
  for name, a, b in zip(("dq", "dk", "dv"), first[2:], atomic[2:]):
    assert _rel(np.asarray(b, np.float64), np.asarray(a, np.float64)) < 1e-2, name


# Long enough that a CTA's key tiles wrap its pipeline's rings several times (the cases above have at most three).
LONG_CASES = [
    ("long_causal_gqa_d128", "bfloat16", 1, 1100, 1100, 4, 2, 128, 128, "causal", (-1, -1), 0.0, False, False),
    ("long_window_ragged_d64", "float16", 3, 900, 1000, 2, 1, 64, 64, "padding_causal", (200, 0), 0.0, False, True),
    ("long_d256", "bfloat16", 1, 700, 800, 2, 2, 256, 256, "no_mask", (-1, -1), 0.0, False, False),
]


@pytest.mark.parametrize("case", LONG_CASES, ids=[c[0] for c in LONG_CASES])
def test_long_sequences_match_reference(case):
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=zlib.crc32(case[0].encode()))
  results = _run(q, k, v, dict(kwargs, engine="te"), dout, dlse, _GPUS[0])
  _check_against_reference(case, results, q, k, v, kwargs, dout, dlse)


def test_forward_is_bitwise_reproducible():
  """20 back-to-back forwards give the same bits: a race in the pipeline (a stage read before its copy landed, or
  overwritten before its products finished) would show as run-to-run differences."""
  case = ("repro", "bfloat16", 2, 2048, 2048, 8, 2, 128, 128, "causal", (-1, -1), 0.0, False, False)
  q, k, v, _, _, _ = _inputs(case, seed=7)
  f = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", return_lse=True, engine="te"))
  runs = [f(q, k, v) for _ in range(20)]
  first = [np.asarray(x) for x in runs[0]]
  assert np.isfinite(first[0].astype(np.float32)).all()
  for run in runs[1:]:
    for a, b in zip(first, run):
      assert np.array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))


PERSISTENT_CASES = [CASES[i] for i in (1, 2, 3, 5, 7, 8, 12, 16)] + [
    # More query blocks than the H200 has multiprocessors (several per CTA); ragged, so some CTAs' blocks are empty.
    ("many_blocks_ragged", "bfloat16", 5, 700, 700, 24, 8, 64, 64, "padding_causal", (-1, -1), 0.0, False, True),
    ("many_blocks_d128", "float16", 3, 1000, 1200, 32, 32, 128, 128, "causal_bottom_right", (-1, -1), 0.0, False, False),
]


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=[c[0] for c in PERSISTENT_CASES])
def test_persistent_forward_is_bitwise_equal_to_one_cta_per_block(case, monkeypatch):
  """The persistent sm90 forward (TE_JAX_SM90_PERSISTENT=1) computes each query block as one CTA per block does (=0):
  the same bits, out and lse, and the reference's values."""
  if getattr(_GPUS[0], "compute_capability", "") != "9.0":
    pytest.skip("the persistent forward is an sm90 kernel")
  q, k, v, kwargs, _, _ = _inputs(case, seed=zlib.crc32(case[0].encode()))
  f = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, **kwargs, return_lse=True, engine="te"))
  results = {}
  for mode in ("0", "1"):
    monkeypatch.setenv("TE_JAX_SM90_PERSISTENT", mode)
    results[mode] = [np.asarray(x) for x in f(q, k, v)]
  for one_per_block, persistent in zip(results["0"], results["1"]):
    assert np.array_equal(one_per_block.view(np.uint8), persistent.view(np.uint8))
  ref = attention_reference(*(np.asarray(x, np.float64) for x in (q, k, v)),
                            **{key: np.asarray(val) if hasattr(val, "shape") else val for key, val in kwargs.items()})
  out = results["1"][0].astype(np.float64)
  assert np.isfinite(out).all()
  assert _rel(out, ref["out"]) < TOL[case[1]]["out"]


@pytest.mark.parametrize("case", [CASES[1], CASES[5], CASES[11]], ids=[CASES[i][0] for i in (1, 5, 11)])
def test_gpu_and_cpu_backends_agree(case):
  try:
    import te_jax._te_jax_cpu  # noqa: F401
  except ImportError as e:
    pytest.skip(f"the CPU backend extension does not import in this build: {e}")
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=7)
  gpu_res = _run(q, k, v, kwargs, dout, dlse, _GPUS[0])
  cpu_res = _run(q, k, v, kwargs, dout, dlse, jax.devices("cpu")[0])
  _check_against_reference(case, cpu_res, q, k, v, kwargs, dout, dlse)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), gpu_res, cpu_res):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    fin = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), fin), name
    assert _rel(a[fin], b[fin]) < 5e-2, name


@pytest.mark.parametrize("engine", ["te", "cudnn"])
def test_sinks_on_the_gpu_agree_with_the_cpu_backend(engine):
  """Attention sinks (te_jax/sinks.py, checked against the float64 definition on the CPU in tests/test_sinks.py): out,
  lse and every gradient, dsink included, on either engine (the loss uses out alone, the backward cuDNN serves)."""
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.standard_normal((2, 300, 4, 128)), jnp.bfloat16)
  k, v = (jnp.asarray(rng.standard_normal((2, 300, 2, 128)), jnp.bfloat16) for _ in range(2))
  dout = jnp.asarray(rng.standard_normal((2, 300, 4, 128)), jnp.bfloat16)
  sinks = jnp.asarray(rng.uniform(-1.0, 4.0, 4), jnp.float32)

  def run(device, engine):
    attention = partial(te_jax.fused_attn, mask_type="causal", engine=engine)
    loss = lambda q, k, v, sinks: jnp.sum(attention(q, k, v, sink_logits=sinks).astype(jnp.float32) *
                                          dout.astype(jnp.float32))
    args = jax.device_put((q, k, v, sinks), device)
    out, lse = jax.jit(lambda q, k, v, sinks: attention(q, k, v, sink_logits=sinks, return_lse=True))(*args)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    return [np.asarray(x, np.float64) for x in (out, lse, *grads)]

  gpu = run(_GPUS[0], engine)
  cpu = run(jax.devices("cpu")[0], "te")
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsink"), gpu, cpu):
    assert np.isfinite(a).all(), name
    assert _rel(a, b) < 2e-2, name


@pytest.mark.parametrize("engine", ["te", "cudnn"])
def test_invalid_runtime_seqlens_give_nan(engine):
  """Lengths outside [0, S] that reach the engine (traced values) are clamped for memory safety and flagged: every
  output of that batch, forward and backward, is NaN; the other batches are unaffected."""
  case = CASES[4]
  q, k, v, kwargs, dout, dlse = _inputs(case, seed=3)
  qs = jnp.asarray([q.shape[1], q.shape[1] + 50, 5], jnp.int32)
  ks = jnp.asarray([k.shape[1], 7, -3], jnp.int32)

  @jax.jit
  def f(q, k, v, qs, ks, dout):
    attn = lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="padding", q_seqlens=qs, kv_seqlens=ks,
                                             engine=engine)
    out, vjp = jax.vjp(attn, q, k, v)
    _, lse = te_jax.fused_attn(q, k, v, mask_type="padding", q_seqlens=qs, kv_seqlens=ks, return_lse=True,
                               engine=engine)
    return (out, lse, *vjp(dout))

  out, lse, dq, dk, dv = (np.asarray(x, np.float32) for x in f(q, k, v, qs, ks, dout))
  for name, x in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
    assert np.isnan(x[1]).all() and np.isnan(x[2]).all(), f"{name} of the invalid batches is not all NaN"
    assert not np.isnan(x[0]).any(), f"{name} of the valid batch has NaN"


# One non-finite value, placed where it tests something: (id, tensor, index). Causal, s = 200 (so the straddling
# tiles of the diagonal hold keys some rows do not see), bf16, d = 128, GQA 4/2.
NONFINITE = [
    ("nan_q", "q", (0, 3, 1, 5), np.nan),
    ("inf_k_visible", "k", (1, 7, 0, 2), np.inf),
    ("nan_v_seen_by_later_rows", "v", (0, 130, 1, 4), np.nan),
    ("inf_v_seen_by_later_rows", "v", (1, 100, 0, 0), np.inf),
    ("nan_k_seen_by_later_rows", "k", (0, 150, 1, 3), np.nan),
]


def _run_with_one_nonfinite(shapes, tensor, index, value, mask_type, engine, seed):
  """Fresh bf16 q, k, v of `shapes` with x[tensor][index] = value: the float32 inputs, and out and lse (float32) of a
  forward with return_lse, checked bitwise equal on the FFI and legacy paths."""
  rng = np.random.default_rng(seed)
  x = {n: np.asarray(jnp.asarray(rng.standard_normal(s), jnp.bfloat16)).astype(np.float32) for n, s in shapes.items()}
  x[tensor][index] = value
  q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
  f = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type=mask_type, return_lse=True, engine=engine))
  with te_jax.custom_call_path("ffi"):
    out, lse = (np.asarray(t, np.float32) for t in f(q, k, v))
  with te_jax.custom_call_path("legacy"):
    out_l, lse_l = (np.asarray(t, np.float32) for t in f(q, k, v))
  te_jax.raise_legacy_failures()
  assert out.tobytes() == out_l.tobytes() and lse.tobytes() == lse_l.tobytes()
  return x, out, lse


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("engine", ["te", "cudnn"])
@pytest.mark.parametrize("name,tensor,index,value", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_nonfinite_inputs_follow_the_formula(name, tensor, index, value, engine, d):
  """IEEE arithmetic over each row's visible keys: the rows that see the value are non-finite where the float64
  reference is, every other row is exact; FFI and legacy agree bitwise. cuDNN's one deviation (README): a non-finite v
  at a key a row does not see may make that row NaN too (it multiplies the masked probabilities, 0, by v); it never
  leaves a row finite that the formula makes non-finite."""
  x, out, lse = _run_with_one_nonfinite(dict(q=(2, 200, 4, d), k=(2, 200, 2, d), v=(2, 200, 2, d)), tensor, index,
                                        value, "causal", engine, seed=1)
  ref = attention_reference(x["q"], x["k"], x["v"], mask_type="causal")
  bad = ~np.isfinite(ref["out"])
  assert bad.any()
  assert np.array_equal(np.isnan(lse), np.isnan(ref["lse"]))
  if engine == "cudnn" and tensor == "v":
    assert np.all(~np.isfinite(out[bad])), "a row the formula makes non-finite came out finite"
    bad = ~np.isfinite(out)
  assert np.array_equal(~np.isfinite(out), bad), "non-finite outputs differ from the formula's"
  fin = ~bad
  assert _rel(out[fin], ref["out"][fin]) < TOL["bfloat16"]["out"]


@pytest.mark.parametrize("nan_block", ["last", "one_of_first_four"])
def test_nan_reruns_over_many_items_per_cta(nan_block):
  """Thousands of query blocks, with a NaN in v at the last key of one query block per (batch, head): the rows of that
  block before it do not see it, but a tensor-core p v gives them 0 * NaN, so those blocks must run their careful
  pass. "last": the last block of each (batch, head); "one_of_first_four": an early one, so most blocks hold real NaN
  and a few spurious ones hide among them."""
  b, s, h, d = 4, 2048, 64, 64
  rng = np.random.default_rng(11)
  x = {n: np.asarray(jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16)).astype(np.float64)
       for n in ("q", "k", "v")}
  pair = np.arange(b * h).reshape(b, h)
  nan_key = 128 * (np.full_like(pair, 15) if nan_block == "last" else pair % 4) + 127
  for bi in range(b):
    for hi in range(h):
      x["v"][bi, nan_key[bi, hi], hi, 0] = np.nan
  q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
  f = jax.jit(lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", return_lse=True, engine="te"))
  out, lse = (np.asarray(t, np.float64) for t in f(q, k, v))
  sees_nan = np.arange(s)[None, :, None] >= nan_key[:, None, :]  # [b, s, h]
  assert np.array_equal(np.isnan(out[..., 0]), sees_nan), "NaN exactly on the rows that see the NaN key"
  assert np.isfinite(out[..., 1:]).all() and np.isfinite(lse).all()
  # The rows of each NaN key's own block that precede it, against float64.
  worst = 0.0
  for bi in range(b):
    for hi in range(h):
      first = nan_key[bi, hi] - 127
      rows = np.arange(first, first + 127)
      scores = x["q"][bi, rows, hi] @ x["k"][bi, : first + 127, hi].T / np.sqrt(d)
      scores[rows[:, None] < np.arange(first + 127)[None, :]] = -np.inf
      p = np.exp(scores - scores.max(axis=1, keepdims=True))
      ref = p @ x["v"][bi, : first + 127, hi] / p.sum(axis=1, keepdims=True)
      worst = max(worst, _rel(out[bi, rows, hi], ref))
  assert worst < TOL["bfloat16"]["out"], worst


def test_compile_is_cached_in_process():
  from te_jax import _te_jax_cuda as ext
  from te_jax.attention_config import AttentionConfig
  from te_jax.mask_type import MaskType
  params = AttentionConfig(MaskType.CAUSAL, -1, -1, 0.125, 0.0, False).core_params(
      (1, 64, 2, 64), (1, 64, 2, 64), (1, 64, 2, 64), jnp.bfloat16)
  ext.prepare(params, "forward")
  assert ext.prepare(params, "forward")["origin"] == "memory"


def test_auto_engine_measures_once_and_remembers_on_disk(tmp_path):
  """engine="auto" times both engines at the first lowering of a configuration and stores the choice; a fresh process
  reads it back instead of measuring. The log lines say which engine runs and why."""
  import os
  import subprocess
  import sys
  code = ("import time, jax, jax.numpy as jnp, te_jax\n"
          "q = jnp.ones((2, 1024, 8, 128), jnp.bfloat16)\n"
          "t = time.perf_counter()\n"
          "jax.jit(lambda q: te_jax.fused_attn(q, q, q, mask_type='causal')).lower(q)\n"
          "print(f'lowering took {time.perf_counter() - t:.2f} s')\n")
  env = dict(os.environ, TE_JAX_CACHE_DIR=str(tmp_path / "cubin"), TE_JAX_LOG_LEVEL="DEBUG")
  first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "measured the engines" in first.stderr, first.stderr[-3000:]
  assert list((tmp_path / "autotune").glob("*.json")), "no measurement was stored"
  second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "measured the engines" not in second.stderr and "measured earlier" in second.stderr, second.stderr[-3000:]
  print("first process:", first.stdout.strip(), "| second process:", second.stdout.strip())
