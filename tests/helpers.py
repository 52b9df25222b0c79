"""Shared helpers for the attention tests: configurations, random inputs, running fused_attn forward + VJP on one
custom-call path, comparing against the float64 reference (te_jax/reference.py) with dtype-derived tolerances.

Importing this module imports jax but does not initialise a JAX backend, so a test module that must configure the
device count first (XLA_FLAGS / jax_num_cpu_devices for the sharding tests) still can, as long as no test has run
yet in the process. Nothing here creates an array at import or collection time.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import zlib

import jax
import jax.numpy as jnp
import numpy as np

import te_jax
from te_jax.reference import attention_reference, visible_mask

PATHS = ("ffi", "legacy")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# Tolerances, derived from each dtype's machine epsilon (spacing of 1.0):
#   float32  eps = 2^-23 ~ 1.19e-7.  The kernel computes in float32 over <= 70 keys and D <= 64, so errors are a
#            few tens of ulps of the tensor's scale; 96 eps ~ 1.1e-5 ("~1e-5 relative").
#   bfloat16 eps = 2^-7 ~ 7.8e-3.   The output is rounded to bf16 (0.5 eps) and so are the operands of the kernel's
#            second matmul / gradient matmuls (another ~eps each, partly cancelling): 2.5 eps ~ 2e-2.
#   float16  eps = 2^-10 ~ 9.8e-4.  Same reasoning; the rounding sources are the same count but f16 keeps 3 more
#            mantissa bits, so a slightly larger multiple of a much smaller eps: 5 eps ~ 4.9e-3.
# A comparison passes when |actual - ref| <= tol * (|ref| + max|ref|) elementwise, i.e. relative to the element and to
# the tensor's scale (gradients have elements near zero whose relative error is meaningless).
# Gradients go through one more rounded matmul chain than the forward output, hence GRAD_FACTOR.
EPS_MULTIPLE = {"float32": 96.0, "bfloat16": 2.5, "float16": 5.0}
GRAD_FACTOR = 2.0


def tolerance(dtype_name: str, grad: bool = False) -> float:
  tol = EPS_MULTIPLE[dtype_name] * float(jnp.finfo(DTYPES[dtype_name]).eps)
  return tol * (GRAD_FACTOR if grad else 1.0)


@dataclasses.dataclass(frozen=True)
class Case:
  """One fused_attn configuration. Sizes are small: CI has two cores."""
  batch: int = 2
  seqlen_q: int = 37
  seqlen_kv: int = 37
  heads: int = 2
  kv_heads: int = 2
  head_dim: int = 32
  head_dim_v: int | None = None
  mask: str = "no_mask"
  window: tuple[int, int] = (-1, -1)
  scale: float | None = None
  softcap: float = 0.0
  alibi: str | None = None  # None, "h" ([H]) or "bh" ([B, H])
  q_seqlens: tuple[int, ...] | None = None
  kv_seqlens: tuple[int, ...] | None = None
  return_lse: bool = True
  with_dlse: bool = False  # with return_lse: a random cotangent for lse too (else zeros, i.e. a loss of out only)
  deterministic: bool = False
  dtype: str = "float32"
  seed: int = 0

  @property
  def dv(self) -> int:
    return self.head_dim if self.head_dim_v is None else self.head_dim_v

  def id(self) -> str:
    short_dtype = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[self.dtype]
    parts = [short_dtype, f"b{self.batch}q{self.seqlen_q}k{self.seqlen_kv}h{self.heads}/{self.kv_heads}",
             f"d{self.head_dim}" + (f"v{self.dv}" if self.dv != self.head_dim else ""), self.mask]
    if self.window != (-1, -1):
      parts.append(f"w{self.window[0]}_{self.window[1]}")
    if self.scale is not None:
      parts.append(f"sc{self.scale}")
    if self.softcap:
      parts.append(f"cap{self.softcap}")
    if self.alibi:
      parts.append(f"alibi_{self.alibi}")
    if self.q_seqlens is not None:
      parts.append("sq" + "_".join(map(str, self.q_seqlens)))
    if self.kv_seqlens is not None:
      parts.append("skv" + "_".join(map(str, self.kv_seqlens)))
    if not self.return_lse:
      parts.append("nolse")
    elif self.with_dlse:
      parts.append("dlse")
    if self.deterministic:
      parts.append("det")
    return "-".join(parts)

  def replace(self, **kw) -> "Case":
    return dataclasses.replace(self, **kw)


@dataclasses.dataclass
class Inputs:
  q: np.ndarray
  k: np.ndarray
  v: np.ndarray
  dout: np.ndarray
  dlse: np.ndarray
  alibi: np.ndarray | None
  q_seqlens: np.ndarray | None
  kv_seqlens: np.ndarray | None
  # Packed sequences: fused_attn's q_segment_ids / kv_segment_ids / q_positions / kv_positions keyword arguments.
  tokens: dict | None = None


def make_inputs(case: Case) -> Inputs:
  """Fresh random data (never zeros), already rounded to the case's dtype (the reference sees the same values)."""
  rng = np.random.default_rng([zlib.crc32(case.id().encode()), case.seed])  # stable across processes
  dt = DTYPES[case.dtype]

  def normal(*shape):
    return np.asarray(jnp.asarray(rng.standard_normal(shape), dt))

  b, h = case.batch, case.heads
  q = normal(b, case.seqlen_q, h, case.head_dim)
  k = normal(b, case.seqlen_kv, case.kv_heads, case.head_dim)
  v = normal(b, case.seqlen_kv, case.kv_heads, case.dv)
  dout = normal(b, case.seqlen_q, h, case.dv)
  dlse = rng.standard_normal((b, h, case.seqlen_q)).astype(np.float32)
  if not case.with_dlse:
    dlse = np.zeros_like(dlse)
  alibi = None
  if case.alibi == "h":
    alibi = rng.uniform(-0.3, 0.3, (h,)).astype(np.float32)
  elif case.alibi == "bh":
    alibi = rng.uniform(-0.3, 0.3, (b, h)).astype(np.float32)
  qs = None if case.q_seqlens is None else np.asarray(case.q_seqlens, np.int32)
  kvs = None if case.kv_seqlens is None else np.asarray(case.kv_seqlens, np.int32)
  return Inputs(q, k, v, dout, dlse, alibi, qs, kvs)


def attn_kwargs(case: Case, inputs: Inputs) -> dict:
  kw = dict(mask_type=case.mask, window_size=case.window, softcap=case.softcap, return_lse=case.return_lse,
            deterministic=case.deterministic)
  if case.scale is not None:
    kw["scale"] = case.scale
  if inputs.alibi is not None:
    kw["alibi_slopes"] = inputs.alibi
  if inputs.q_seqlens is not None:
    kw["q_seqlens"] = inputs.q_seqlens
  if inputs.kv_seqlens is not None:
    kw["kv_seqlens"] = inputs.kv_seqlens
  kw.update(inputs.tokens or {})
  return kw


def forward_and_vjp_fn(case: Case, inputs: Inputs, **extra):
  """A function (q, k, v, dout, dlse) -> (out, lse or None, dq, dk, dv) computing fused_attn and its VJP; `extra`:
  more fused_attn arguments (dropout_rate, ...)."""
  kw = dict(attn_kwargs(case, inputs), **extra)

  def fn(q, k, v, dout, dlse):
    primal, vjp = jax.vjp(lambda q, k, v: te_jax.fused_attn(q, k, v, **kw), q, k, v)
    if case.return_lse:
      out, lse = primal
      dq, dk, dv = vjp((dout, dlse))
    else:
      out, lse = primal, None
      dq, dk, dv = vjp(dout)
    return out, lse, dq, dk, dv

  return fn


def run_on_path(case: Case, inputs: Inputs, path: str, **extra) -> dict:
  """Jits forward + VJP under `path`, checks the HLO really calls that path's targets, returns numpy results."""
  fn = jax.jit(forward_and_vjp_fn(case, inputs, **extra))
  args = (inputs.q, inputs.k, inputs.v, inputs.dout, inputs.dlse)
  with te_jax.custom_call_path(path):
    lowered = fn.lower(*args)
    hlo = lowered.as_text()
    for direction in ("forward", "backward"):
      assert f"te_jax_attention_{direction}_cpu_{path}" in hlo, f"{direction} does not lower to the {path} target"
    outs = lowered.compile()(*args)
  if path == "legacy":
    te_jax.raise_legacy_failures()  # a legacy call that failed at run time would otherwise only show up as NaN
  names = ("out", "lse", "dq", "dk", "dv")
  return {n: (None if x is None else np.asarray(x)) for n, x in zip(names, outs)}


def reference(case: Case, inputs: Inputs, **extra) -> dict:
  """`extra`: more attention_reference arguments (keep_mask, dropout_rate, ...)."""
  return attention_reference(inputs.q, inputs.k, inputs.v, mask_type=case.mask, q_seqlens=inputs.q_seqlens,
                             kv_seqlens=inputs.kv_seqlens, window_size=case.window, scale=case.scale,
                             softcap=case.softcap, alibi_slopes=inputs.alibi, dout=inputs.dout,
                             dlse=inputs.dlse if case.return_lse and case.with_dlse else None, **(inputs.tokens or {}),
                             **extra)


def visibility(case: Case, inputs: Inputs) -> np.ndarray:
  """bool [B, Sq, Skv]."""
  qs = np.full(case.batch, case.seqlen_q) if inputs.q_seqlens is None else inputs.q_seqlens
  kvs = np.full(case.batch, case.seqlen_kv) if inputs.kv_seqlens is None else inputs.kv_seqlens
  return visible_mask(case.mask, case.seqlen_q, case.seqlen_kv, qs, kvs, case.window, **(inputs.tokens or {}))


def assert_close(name: str, actual: np.ndarray, ref: np.ndarray, tol: float) -> None:
  actual = np.asarray(actual, np.float64)
  finite = np.isfinite(ref)
  assert np.array_equal(np.isfinite(actual), finite), f"{name}: non-finite entries differ from the reference"
  a, r = actual[finite], ref[finite]
  if r.size == 0:
    return
  # Cancellation noise scales with the terms that cancel (O(1) for unit-normal inputs), not with the result: a gradient
  # that is exactly 0 in float64 (e.g. window (0, 0), one visible key) comes out as rounding noise of that size.
  scale = max(float(np.abs(r).max()), 0.1)
  err = np.abs(a - r)
  bound = tol * (np.abs(r) + scale)
  worst = int(np.argmax(err - bound))
  assert np.all(err <= bound), (f"{name}: max |err| {err.max():.3g} (normalised {err.max() / max(scale, 1e-300):.3g}) "
                                f"exceeds tol {tol:.3g}; worst element actual {a[worst]!r} ref {r[worst]!r}")


def check_against_reference(case: Case, inputs: Inputs, got: dict, ref: dict) -> None:
  """Closeness to the reference with the dtype's tolerance, plus the exact guarantees of fully masked rows/keys."""
  for n, x in got.items():
    if x is None:
      continue
    assert not np.isnan(x.astype(np.float32)).any(), f"{n} has NaN"
  assert got["out"].dtype == np.dtype(DTYPES[case.dtype])
  assert got["out"].shape == (case.batch, case.seqlen_q, case.heads, case.dv)
  for n in ("dq", "dk", "dv"):
    assert got[n].dtype == np.dtype(DTYPES[case.dtype]), n
  assert got["dq"].shape == inputs.q.shape and got["dk"].shape == inputs.k.shape and got["dv"].shape == inputs.v.shape
  tol = tolerance(case.dtype)
  assert_close("out", got["out"], ref["out"], tol)
  if case.return_lse:
    assert got["lse"].dtype == np.float32 and got["lse"].shape == (case.batch, case.heads, case.seqlen_q)
    assert_close("lse", got["lse"], ref["lse"], tol)
  for n in ("dq", "dk", "dv"):
    assert_close(n, got[n], ref[n], tolerance(case.dtype, grad=True))
  check_masked_exact(case, inputs, got)


def check_masked_exact(case: Case, inputs: Inputs, got: dict) -> None:
  """Rows with no visible key: out exactly 0, lse -inf, dq 0. Keys no query sees: dk = dv = 0 exactly."""
  vis = visibility(case, inputs)  # [B, Sq, Skv]
  dead_rows = ~vis.any(axis=2)  # [B, Sq]
  unseen_keys = ~vis.any(axis=1)  # [B, Skv]
  out = got["out"].astype(np.float32)
  assert np.all(out[dead_rows] == 0.0), "out is not exactly 0 on rows with no visible key"
  assert np.all(got["dq"].astype(np.float32)[dead_rows] == 0.0), "dq is not 0 on rows with no visible key"
  for n in ("dk", "dv"):
    assert np.all(got[n].astype(np.float32)[unseen_keys] == 0.0), f"{n} is not 0 on keys no query sees"
  if got["lse"] is not None:
    lse = got["lse"].transpose(0, 2, 1)  # [B, Sq, H]
    assert np.all(lse[dead_rows] == -np.inf), "lse is not -inf on rows with no visible key"
    assert np.all(np.isfinite(lse[~dead_rows])), "lse is not finite on rows with visible keys"


def assert_bitwise_equal(a: dict, b: dict, what: str = "ffi vs legacy") -> None:
  for n in a:
    if a[n] is None:
      assert b[n] is None
      continue
    assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, n
    # Compare the bit patterns, so -0.0 vs 0.0 and NaN payloads count too.
    assert np.array_equal(a[n].view(np.uint8), b[n].view(np.uint8)), f"{what}: {n} differs bitwise"



def check_both_paths(case: Case, bitwise=("out", "lse", "dq", "dk", "dv")) -> None:
  """Runs `case` on both custom-call paths, checks each against the reference, and the results named in `bitwise`
  for bitwise equality between the paths."""
  inputs = make_inputs(case)
  ref = reference(case, inputs)
  results = {path: run_on_path(case, inputs, path) for path in PATHS}
  for path, got in results.items():
    try:
      check_against_reference(case, inputs, got, ref)
    except AssertionError as e:
      raise AssertionError(f"[{path} path] {e}") from None
  compared = {path: {n: got[n] for n in bitwise} for path, got in results.items()}
  assert_bitwise_equal(compared["ffi"], compared["legacy"])


# Runs the cases `module.cases_name` on the FFI path, whose pool XLA sizes by PJRT_NPROC, saves their bits and reports
# the size of XLA's intra-op pool (threads named "...XLAEigen"), so the caller can tell that the setting took.
_POOL_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from helpers import make_inputs, run_on_path
    cases = getattr(__import__(sys.argv[2]), sys.argv[3])
    results = {}
    for i, case in enumerate(cases):
      for name, x in run_on_path(case, make_inputs(case), "ffi").items():
        results[f"{i}_{name}"] = x.view(np.uint8)  # the bits: npz cannot hold bfloat16
    np.savez(sys.argv[4], **results)
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    print("POOL", sum("XLAEigen" in n for n in names))
""")


def assert_same_bits_with_pools_of(threads, module: str, cases_name: str, run_here, tmp_path) -> None:
  """Runs module.cases_name on the FFI path in subprocesses whose XLA pools have each of `threads` threads while
  run_here() -> {path: [results per case]} runs here (concurrently), and asserts every path here agrees bitwise with
  every pool."""
  procs = {}
  for n in threads:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC=str(n))
    procs[n] = subprocess.Popen([sys.executable, "-c", _POOL_SCRIPT, os.path.dirname(__file__), module, cases_name,
                                 str(tmp_path / f"{n}.npz")],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  here = run_here()
  cases = getattr(__import__(module), cases_name)
  for n, proc in procs.items():
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert f"POOL {n}" in out.splitlines(), f"PJRT_NPROC={n} did not set XLA's pool size: {out}"
    saved = np.load(tmp_path / f"{n}.npz")
    for i, case in enumerate(cases):
      other = {name: saved[f"{i}_{name}"].view(x.dtype) for name, x in here["ffi"][i].items()}
      for path, results in here.items():
        assert_bitwise_equal(results[i], other, what=f"{case.id()}: {path} here vs ffi with {n} threads")


def run_program_in_isa(isa: str, program: str) -> None:
  """Runs `program` (python -c, given isa as sys.argv[1]) in a process whose CPU kernels are capped at `isa`
  (TE_JAX_CPU_ISA), asserting it succeeds; skips an ISA this CPU does not have."""
  order = ("baseline", "avx2", "avx512")
  if order.index(isa) > order.index(te_jax.cpu_isa()):
    import pytest
    pytest.skip(f"this CPU has no {isa}")
  env = dict(os.environ, JAX_PLATFORMS="cpu", TE_JAX_CPU_ISA=isa)
  proc = subprocess.run([sys.executable, "-c", program, isa], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
