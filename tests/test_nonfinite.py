"""NaN and inf inputs follow the formula in IEEE arithmetic over each row's visible keys (README "Semantics"): a NaN or
inf in a row's q, in a key it sees (k or v) or in an ALiBi slope reaches that row's outputs as the float64 reference
carries it; keys a row does not see never affect it; nothing non-finite is silently turned into a number."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import Case, assert_bitwise_equal, assert_close, make_inputs, reference, run_on_path, tolerance


def _poison(inputs, tensor: str, index: tuple, value: float) -> None:
  array = np.array(getattr(inputs, tensor))  # a writable copy
  array[index] = value
  setattr(inputs, tensor, array)


# (id, case, tensor, index, value): each places one non-finite value where it tests something.
FORWARD_CASES = [
    ("nan_q", Case(seqlen_q=40, seqlen_kv=40), "q", (0, 3, 1, 5), np.nan),
    ("inf_q", Case(seqlen_q=40, seqlen_kv=40), "q", (1, 7, 0, 2), np.inf),
    ("neg_inf_q_causal_first_row", Case(mask="causal"), "q", (0, 0, 0, 0), -np.inf),
    ("inf_k_visible", Case(), "k", (1, 7, 0, 2), np.inf),
    ("nan_k_causal", Case(mask="causal", seqlen_q=150, seqlen_kv=150), "k", (0, 100, 1, 3), np.nan),
    ("nan_v_causal", Case(mask="causal", seqlen_q=150, seqlen_kv=150), "v", (0, 100, 1, 4), np.nan),
    ("inf_v_causal", Case(mask="causal", seqlen_q=150, seqlen_kv=150), "v", (1, 70, 0, 0), np.inf),
    ("nan_v_window", Case(window=(10, 3), seqlen_q=150, seqlen_kv=150), "v", (0, 75, 1, 6), np.nan),
    ("nan_v_gqa_bottom_right", Case(mask="causal_bottom_right", seqlen_q=20, seqlen_kv=150, heads=4, kv_heads=2),
     "v", (0, 140, 1, 1), np.nan),
    # Past each batch entry's kv length: never visible, so no effect at all.
    ("nan_k_and_v_past_length", Case(mask="padding", q_seqlens=(37, 20), kv_seqlens=(30, 12)), "k", (1, 20, 0, 0),
     np.nan),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name,case,tensor,index,value", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_follows_the_formula(name, case, tensor, index, value, dtype):
  case = case.replace(dtype=dtype)
  inputs = make_inputs(case)
  _poison(inputs, tensor, index, value)
  if name == "nan_k_and_v_past_length":
    _poison(inputs, "v", (0, 35, 1, 0), np.nan)
  ref = reference(case, inputs)
  assert (~np.isfinite(ref["out"])).any() or name == "nan_k_and_v_past_length", "the case must poison some row"
  got = {path: run_on_path(case, inputs, path) for path in ("ffi", "legacy")}
  # (dq's last bits follow the CPU's thread scheduling past 128 keys unless deterministic=True: forward only here)
  assert_bitwise_equal({n: got["ffi"][n] for n in ("out", "lse")}, {n: got["legacy"][n] for n in ("out", "lse")})
  assert_close("out", got["ffi"]["out"], ref["out"], tolerance(dtype))
  assert_close("lse", got["ffi"]["lse"], ref["lse"], tolerance(dtype))
  # Where the formula gives NaN, the kernel gives NaN (an inf in v may give inf or NaN, as IEEE does).
  assert np.all(np.isnan(got["ffi"]["lse"][np.isnan(ref["lse"])]))


GRADIENT_CASES = [
    ("nan_q", Case(seqlen_q=40, seqlen_kv=40), "q", (0, 3, 1, 5), np.nan),
    ("inf_k", Case(seqlen_q=40, seqlen_kv=40, heads=4, kv_heads=2), "k", (1, 7, 0, 2), np.inf),
    ("nan_v", Case(seqlen_q=40, seqlen_kv=40), "v", (1, 9, 1, 1), np.nan),
]


@pytest.mark.parametrize("name,case,tensor,index,value", GRADIENT_CASES, ids=[c[0] for c in GRADIENT_CASES])
def test_gradients_follow_the_formula_where_every_key_is_visible(name, case, tensor, index, value):
  """With every key visible the formula's NaN pattern is exact for the gradients too."""
  del name
  inputs = make_inputs(case)
  _poison(inputs, tensor, index, value)
  ref = reference(case, inputs)
  got = run_on_path(case, inputs, "ffi")
  for n in ("dq", "dk", "dv"):
    assert_close(n, got[n], ref[n], tolerance(case.dtype, grad=True))
  assert any((~np.isfinite(ref[n])).any() for n in ("dq", "dk", "dv"))


@pytest.mark.parametrize("path", ["ffi", "legacy"])
def test_masked_gradients_are_never_less_poisoned_than_the_formula(path):
  """Under a mask, a gradient the formula makes NaN is NaN (never dropped); finite ones match. The backward may also
  poison gradients of pairs in the same tile as the non-finite input (docs/ARCHITECTURE.md says why)."""
  case = Case(mask="causal", seqlen_q=150, seqlen_kv=150)
  inputs = make_inputs(case)
  _poison(inputs, "q", (0, 60, 1, 3), np.nan)
  ref = reference(case, inputs)
  got = run_on_path(case, inputs, path)
  for n in ("dq", "dk", "dv"):
    bad = ~np.isfinite(ref[n])
    assert bad.any() or n == "dv"
    assert np.all(~np.isfinite(got[n][bad])), f"{n}: a gradient the formula makes non-finite came out finite"
    both = np.isfinite(ref[n]) & np.isfinite(got[n].astype(np.float64))
    tol = tolerance(case.dtype, grad=True)
    scale = max(float(np.abs(ref[n][np.isfinite(ref[n])]).max()), 0.1)
    assert np.all(np.abs(got[n][both] - ref[n][both]) <= tol * (np.abs(ref[n][both]) + scale)), n


@pytest.mark.parametrize("path", ["ffi", "legacy"])
def test_nan_alibi_slope_poisons_its_head_only(path):
  case = Case(alibi="h", mask="causal")
  inputs = make_inputs(case)
  _poison(inputs, "alibi", (1,), np.nan)
  got = run_on_path(case, inputs, path)
  assert np.all(np.isnan(got["out"][:, :, 1])) and np.all(np.isnan(got["lse"][:, 1]))
  assert np.all(np.isfinite(got["out"][:, :, 0])) and np.all(np.isfinite(got["lse"][:, 0]))
