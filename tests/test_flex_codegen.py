"""te_jax.flex's generated C++ against JAX: each mod is translated, compiled with g++ into a shared library whose
wrapper evaluates it over a (b, h, q, kv) grid, and compared with jax.vmap of the same Python function on the same
captured values: bitwise where XLA:CPU's arithmetic is IEEE's (integers, bools, +-*/ sqrt, conversions), within the
ulps of XLA:CPU's own approximations where a mod calls tanh, exp, erf, log or pow. Then the derivative method against
jax.grad, the errors, the cache key, and NVRTC compiling the source for compute_90."""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from te_jax import flex

ROOT = pathlib.Path(__file__).resolve().parent.parent
B, H, Q, K = 2, 3, 9, 11
RNG = np.random.default_rng(51)
# XLA:CPU contracts a * b + c into an FMA where the CPU has one; the host build does the same so products match.
FMA = ["-mfma"] if "fma" in open("/proc/cpuinfo").read().split() else []

REL_TABLE = jnp.asarray(RNG.standard_normal(Q + K - 1), jnp.float32)
TEMPERATURE = jnp.asarray(RNG.uniform(0.5, 2.0, H), jnp.float32)
SLOPES = jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)
PREFIX = jnp.asarray([3, 6], jnp.int32)
DOC_IDS = jnp.asarray(np.sort(RNG.integers(0, 3, (B, max(Q, K))), axis=1), jnp.int32)
RANDOM_MASK = jnp.asarray(RNG.random((Q, K)) < 0.5)
SMALL = jnp.asarray([1.5, -2.0, 4.0, 0.25, 8.0], jnp.float32)
HEAD_BIAS = jnp.asarray(RNG.standard_normal((H, Q)), jnp.bfloat16)
HEAD_LIMIT = jnp.asarray([[1, 5, 9], [0, 2, 11]], jnp.int32)
COMPLEX = jnp.ones(2, jnp.complex64)

# name -> (mod, ulps): 0 means bitwise; otherwise the mod calls libm-like functions where XLA:CPU's approximations
# (tanh, erf: ~4-5 ulp from the correctly rounded value) and glibc's differ, and the bound is in ulps of the result
# or, below 1, of 1 (a sum of such terms can cancel to a small result).
SCORE_MODS = {
    "relative_position_bias": (lambda s, b, h, q, kv: s + REL_TABLE[q - kv + K - 1], 0),
    "head_temperature": (lambda s, b, h, q, kv: s / TEMPERATURE[h], 0),
    "static_slices": (lambda s, b, h, q, kv: s * SMALL[1:4][h] + REL_TABLE[2:][q + kv], 0),
    "alibi": (lambda s, b, h, q, kv: s + SLOPES[h] * (kv - q), 0),
    "softcap": (lambda s, b, h, q, kv: 30.0 * jnp.tanh(s / 30.0), 8),
    "causal_minus_inf": (lambda s, b, h, q, kv: jnp.where(q >= kv, s, -jnp.inf), 0),
    "nan_propagation": (lambda s, b, h, q, kv: jnp.maximum(jnp.sqrt(s), jnp.where(kv % 3 == 0, jnp.nan, -1.0))
                        + jnp.minimum(s, 0.0 * s), 0),
    "integer_div_rem": (lambda s, b, h, q, kv: s + (lax.div(q - kv, 3) * 7 + lax.rem(q - kv, 4) + (q - kv) // 4
                                                    + (q - kv) % 3 + lax.div(q, kv - 4) + lax.rem(q, kv - 4)), 0),
    "out_of_bounds_indices": (lambda s, b, h, q, kv: s + SMALL[q + kv] + SMALL[h - 4]
                              + jnp.take(SMALL, q - 3, mode="fill", fill_value=-100.0)
                              + SMALL.at[kv - 2].get(mode="clip") + 10 * DOC_IDS[b + 1, kv], 0),
    "half_precision": (lambda s, b, h, q, kv: s + HEAD_BIAS[h, q].astype(jnp.float32)
                       + (s.astype(jnp.bfloat16) * 3).astype(jnp.float32)
                       + (s * 1000).astype(jnp.float16).astype(jnp.float32), 0),
    "bits_and_conversions": (lambda s, b, h, q, kv: s + (lax.shift_left(q + 1, kv * 4) ^ lax.shift_right_arithmetic(
        -q, kv * 4) | lax.shift_right_logical(-q, kv)).astype(jnp.float32) + (s * 1e9).astype(jnp.int32) * 1e-9
        + (s * 50).astype(jnp.int8) + jnp.abs(q - kv).astype(jnp.float32), 0),
    "rounding_and_signs": (lambda s, b, h, q, kv: jnp.round(s * 2) + jnp.floor(s) - jnp.ceil(s) + jnp.sign(s)
                           + jnp.clip(s, -1.0, 1.0) + lax.round(s, lax.RoundingMethod.AWAY_FROM_ZERO)
                           + jnp.maximum(s, -s) - jnp.minimum(s, 0.0), 0),
    "signed_zeros": (lambda s, b, h, q, kv: jnp.where(kv % 2 == 0, jnp.maximum(s * 0, -(s * 0)),
                                                      jnp.minimum(s * 0, -(s * 0))), 0),
    "powers": (lambda s, b, h, q, kv: s ** 3 + s ** -2 + jnp.abs(s) ** 1.5 + s * s, 16),
    # gelu's derivative takes 1 - tanh(x) near saturation, which magnifies the two tanh's difference.
    "activations": (lambda s, b, h, q, kv: jax.nn.gelu(s) + jax.nn.softplus(s) + jax.nn.relu(s - h)
                    + jax.nn.sigmoid(s), 32),
    "libm": (lambda s, b, h, q, kv: jax.scipy.special.erf(s) + jnp.log1p(jnp.abs(s)) + jnp.exp2(-s * s)
             + jnp.expm1(s / 8) + jnp.sin(s) * jnp.cos(s), 16),
}
MASK_MODS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "prefix_lm": lambda b, h, q, kv: (kv <= q) | (kv < PREFIX[b]),
    "chunked_local": lambda b, h, q, kv: (q // 4 == kv // 4) & (q >= kv),
    "document": lambda b, h, q, kv: DOC_IDS[b, q] == DOC_IDS[b, kv],
    "random_captured": lambda b, h, q, kv: RANDOM_MASK[q, kv],
    "batch_and_head": lambda b, h, q, kv: (kv < HEAD_LIMIT[b, h]) & ((b + h) % 2 == 0) | (q == kv),
}


def _grid():
  b, h, q, kv = np.meshgrid(np.arange(B), np.arange(H), np.arange(Q), np.arange(K), indexing="ij")
  return [x.astype(np.int32).ravel() for x in (b, h, q, kv)]


def _scores() -> np.ndarray:
  scores = (RNG.standard_normal(B * H * Q * K) * 4).astype(np.float32)
  scores[::29] = 0.0
  scores[5::31] = -0.0
  scores[7::37] = np.inf
  scores[11::41] = -np.inf
  scores[13::43] = np.nan
  return scores


def _wrapper(mod: flex.FlexMod) -> str:
  """The extern "C" evaluator: fills the struct from the capture pointers, shapes and strides (each capture's
  dimensions consecutively), then evaluates every grid point."""
  fill, dim = [], 0
  for i, capture in enumerate(mod.capture_types):
    fill.append(f"mod.capture{i} = static_cast<decltype(mod.capture{i})>(data[{i}]);")
    for d in range(len(capture.shape)):
      fill += [f"mod.capture{i}_shape[{d}] = shapes[{dim}];", f"mod.capture{i}_strides[{d}] = strides[{dim}];"]
      dim += 1
  if mod.kind == "score_mod":
    signature, point = "const float* scores, float* out, float* dout", (
        "out[i] = mod.Score(scores[i], b, h, q, kv); dout[i] = mod.DScore(scores[i], b, h, q, kv);")
  else:
    signature, point = "uint8_t* out", "out[i] = mod.Mask(b, h, q, kv);"
  return "\n".join([
      '#include "flex_mod.h"',
      f'extern "C" void Evaluate(const void* const* data, const int64_t* shapes, const int64_t* strides, '
      f'{signature}) {{',
      f"  te_jax::flex::{mod.struct} mod;", *(f"  {line}" for line in fill),
      f"  for (int b = 0, i = 0; b < {B}; ++b) for (int h = 0; h < {H}; ++h) for (int q = 0; q < {Q}; ++q)",
      f"    for (int kv = 0; kv < {K}; ++kv, ++i) {{ {point} }}", "}", ""])


def _evaluate_cpp(mod: flex.FlexMod, tmp_path, scores=None):
  (tmp_path / "flex_mod.h").write_text(mod.source)
  (tmp_path / "wrapper.cc").write_text(_wrapper(mod))
  library = tmp_path / "flex_mod.so"
  subprocess.run(["g++", "-std=c++17", "-O1", *FMA, "-Wall", "-Werror", "-Wno-unused-variable", "-shared", "-fPIC",
                  f"-I{ROOT}", "-o", str(library), str(tmp_path / "wrapper.cc")], check=True, capture_output=True,
                 text=True)
  arrays = [np.ascontiguousarray(np.asarray(c)) for c in mod.captures]
  data = (ctypes.c_void_p * max(len(arrays), 1))(*(a.ctypes.data for a in arrays))
  shapes = np.array([n for a in arrays for n in a.shape] or [0], np.int64)
  strides = np.array([s // a.itemsize for a in arrays for s in a.strides] or [0], np.int64)
  evaluate = ctypes.CDLL(str(library)).Evaluate
  pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)
  if mod.kind == "mask_mod":
    out = np.zeros(B * H * Q * K, np.uint8)
    evaluate(data, pointer(shapes), pointer(strides), pointer(out))
    return out.astype(bool)
  out, dout = np.zeros_like(scores), np.zeros_like(scores)
  evaluate(data, pointer(shapes), pointer(strides), pointer(scores), pointer(out), pointer(dout))
  return out, dout


def _assert_matches(actual: np.ndarray, expected: np.ndarray, ulps: int, what: str):
  expected = np.asarray(expected, np.float32)
  nan = np.isnan(expected)
  np.testing.assert_array_equal(np.isnan(actual), nan, err_msg=f"{what}: NaN positions")
  a, e = actual[~nan], expected[~nan]
  if ulps == 0:
    bad = a.view(np.uint32) != e.view(np.uint32)  # bitwise: the sign of zero too
  else:
    bad = (np.isinf(a) | np.isinf(e)) & (a != e)
    finite = np.isfinite(a) & np.isfinite(e)
    scale = np.maximum(np.maximum(np.abs(a[finite]), np.abs(e[finite])), np.float32(1))
    bad[finite] = np.abs(a[finite] - e[finite]) > ulps * np.spacing(scale)
  assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} differ, e.g. {a[bad][:5]} vs {e[bad][:5]}"


def _jax(fn, *args) -> np.ndarray:
  """jax.vmap(fn) on XLA:CPU, each bfloat16 / float16 result rounded as the jaxpr says: by default XLA may keep
  excess precision (bfloat16(x) * 3 converted to float32 unrounded), which the generated code does not."""
  vectorized = jax.jit(jax.vmap(fn))
  return np.asarray(vectorized.lower(*args).compile({"xla_allow_excess_precision": False})(*args))


@pytest.mark.parametrize("name", sorted(SCORE_MODS))
def test_score_mod_matches_jax(name, tmp_path):
  fn, ulps = SCORE_MODS[name]
  mod = flex.translate_score_mod(fn)
  scores = _scores()
  out, dout = _evaluate_cpp(mod, tmp_path, scores)
  grid = _grid()
  _assert_matches(out, _jax(fn, scores, *grid), ulps, f"{name} Score")
  _assert_matches(dout, _jax(jax.grad(fn), scores, *grid), ulps, f"{name} DScore")


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_mask_mod_matches_jax(name, tmp_path):
  fn = MASK_MODS[name]
  actual = _evaluate_cpp(flex.translate_mask_mod(fn), tmp_path)
  expected = _jax(fn, *_grid())
  np.testing.assert_array_equal(actual, expected)
  assert 0 < expected.sum() < expected.size  # the mask masks something and keeps something


GRADIENT_MODS = ("relative_position_bias", "head_temperature", "static_slices", "alibi", "out_of_bounds_indices",
                 "half_precision")


def _capture_gradients_cpp(mod: flex.FlexMod, tmp_path, scores, cts) -> list[np.ndarray]:
  """DCaptures over the grid: each floating-point capture's float32 gradient, summed over every grid point."""
  wrapper = _wrapper(mod).replace("const float* scores, float* out, float* dout",
                                  "const float* scores, const float* cts, float* const* grads")
  wrapper = wrapper.replace(
      "out[i] = mod.Score(scores[i], b, h, q, kv); dout[i] = mod.DScore(scores[i], b, h, q, kv);",
      "mod.DCaptures(cts[i], scores[i], b, h, q, kv, grads);")
  (tmp_path / "flex_mod.h").write_text(mod.source)
  (tmp_path / "wrapper.cc").write_text(wrapper)
  library = tmp_path / "flex_grad.so"
  subprocess.run(["g++", "-std=c++17", "-O1", *FMA, "-Wall", "-Werror", "-Wno-unused-variable", "-shared", "-fPIC",
                  f"-I{ROOT}", "-o", str(library), str(tmp_path / "wrapper.cc")], check=True, capture_output=True,
                 text=True)
  arrays = [np.ascontiguousarray(np.asarray(c)) for c in mod.captures]
  data = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))
  shapes = np.array([n for a in arrays for n in a.shape] or [0], np.int64)
  strides = np.array([s // a.itemsize for a in arrays for s in a.strides] or [0], np.int64)
  grads = [np.zeros(a.shape, np.float32) for a in arrays]
  pointers = (ctypes.c_void_p * len(arrays))(*(g.ctypes.data if jnp.issubdtype(a.dtype, jnp.floating) else None
                                               for g, a in zip(grads, arrays)))
  pointer = lambda a: a.ctypes.data_as(ctypes.c_void_p)
  ctypes.CDLL(str(library)).Evaluate(data, pointer(shapes), pointer(strides), pointer(scores), pointer(cts), pointers)
  return grads


@pytest.mark.parametrize("name", GRADIENT_MODS)
def test_capture_gradients_match_jax(name, tmp_path):
  """DCaptures summed over a grid against jax.vjp of the vmapped mod with respect to its captures: the gradient of
  sum(ct * score_mod) over the grid (float32 sums in another order: a relative bound)."""
  fn = SCORE_MODS[name][0]
  mod = flex.translate_score_mod(fn)
  scores = (RNG.standard_normal(B * H * Q * K) * 2).astype(np.float32)
  cts = RNG.standard_normal(B * H * Q * K).astype(np.float32)
  actual = _capture_gradients_cpp(mod, tmp_path, scores, cts)
  differentiable = [i for i, c in enumerate(mod.captures) if jnp.issubdtype(c.dtype, jnp.floating)]
  assert differentiable and f"void DCaptures(" in mod.source

  def total(*floats):
    # The mod with its floating-point captures swapped for `floats`, through its own jaxpr.
    closed = jax.make_jaxpr(fn)(jnp.float32(0), *(jnp.int32(0),) * 4)
    consts = list(closed.consts)
    for i, x in zip(differentiable, floats):
      consts[next(p for p, c in enumerate(closed.consts) if c is mod.captures[i])] = x
    point = lambda s, *idx: jax.core.eval_jaxpr(closed.jaxpr, consts, s, *idx)[0].astype(jnp.float32)
    return jnp.sum(jax.vmap(point)(scores, *_grid()) * cts)

  expected = jax.grad(total, argnums=tuple(range(len(differentiable))))(*(mod.captures[i] for i in differentiable))
  for i, e in zip(differentiable, expected):
    e = np.asarray(e, np.float64)
    assert np.abs(e).max() > 0, name
    if mod.captures[i].dtype == jnp.float32:
      np.testing.assert_allclose(actual[i], e, rtol=1e-4, atol=1e-5 * np.abs(e).max())
    else:  # each contribution rounded to the capture's half-precision dtype, as JAX's own cotangent is
      assert np.linalg.norm(actual[i] - e) / np.linalg.norm(e) < 2e-2, name


def test_mods_without_floating_point_captures_have_no_capture_gradient():
  for mod in (lambda s, b, h, q, kv: s + DOC_IDS[b, kv], lambda s, b, h, q, kv: s * 2):
    source = flex.translate_score_mod(mod).source
    assert "AddGradient" not in source and "Grads&& grads) const {}" in source  # DCaptures does nothing


def test_out_of_bounds_indices_clamp_wrap_and_fill(tmp_path):
  """Not only equal to JAX: the values JAX's rules give, written down (a negative index wraps once, then clamps)."""
  mod = flex.translate_score_mod(lambda s, b, h, q, kv: SMALL[q - kv] + jnp.take(SMALL, kv - 6, mode="fill",
                                                                                   fill_value=-100.0))
  out, _ = _evaluate_cpp(mod, tmp_path, np.zeros(B * H * Q * K, np.float32))
  _, _, q, kv = _grid()
  small = np.asarray(SMALL)
  wrap = lambda i: np.where(i < 0, i + 5, i)
  filled = np.where((wrap(kv - 6) >= 0) & (wrap(kv - 6) < 5), small[np.clip(wrap(kv - 6), 0, 4)], -100.0)
  np.testing.assert_array_equal(out, small[np.clip(wrap(q - kv), 0, 4)] + filled)
  assert (filled == -100.0).any() and (q - kv + 5 < 0).any()


def test_derivative_of_a_mod_constant_in_score_is_zero(tmp_path):
  _, dout = _evaluate_cpp(flex.translate_score_mod(lambda s, b, h, q, kv: SLOPES[h] * q), tmp_path, _scores())
  assert not dout.any()


def _softcap_30(s, b, h, q, kv):
  return 30.0 * jnp.tanh(s / 30.0)


def _softcap_30_again(score, b, h, q_idx, kv_idx):
  return 30.0 * jnp.tanh(score / 30.0)


def test_cache_key_follows_the_source_not_the_values():
  first, again = flex.translate_score_mod(_softcap_30), flex.translate_score_mod(_softcap_30_again)
  assert first.source == again.source and first.key == again.key
  assert flex.translate_score_mod(lambda s, b, h, q, kv: 20.0 * jnp.tanh(s / 20.0)).key != first.key
  table = lambda values: flex.translate_score_mod(lambda s, b, h, q, kv: s + values[h])
  assert table(TEMPERATURE).key == table(TEMPERATURE * 3).key
  assert table(TEMPERATURE).key != table(TEMPERATURE.astype(jnp.bfloat16)).key  # the dtype is in the source


def test_captures_of_an_enclosing_jit_are_its_tracers():
  concrete = flex.translate_score_mod(lambda s, b, h, q, kv: s * TEMPERATURE[h])
  seen = {}

  @jax.jit
  def step(temperature):
    seen["mod"] = flex.translate_score_mod(lambda s, b, h, q, kv: s * temperature[h])
    return temperature

  step(TEMPERATURE)
  assert isinstance(seen["mod"].captures[0], jax.core.Tracer)
  assert seen["mod"].key == concrete.key
  assert concrete.capture_types == (flex.CaptureType(np.dtype(np.float32), (H,)),)


def test_numpy_and_python_scalars_fold_into_the_code():
  mod = flex.translate_score_mod(lambda s, b, h, q, kv: s * np.float32(0.125) + 3)
  assert mod.captures == () and "0x1p-3f" in mod.source and "0x1.8p+1f" in mod.source


def test_unsupported_primitive_is_named():
  with pytest.raises(NotImplementedError, match=r"score_mod uses lax\.cumsum, .*supported primitives: .*tanh"):
    flex.translate_score_mod(lambda s, b, h, q, kv: s + jnp.cumsum(SMALL)[h])
  with pytest.raises(NotImplementedError, match=r"mask_mod uses lax\.reduce_or"):
    flex.translate_mask_mod(lambda b, h, q, kv: jnp.any(RANDOM_MASK))


def test_wrong_arity_names_the_arguments():
  with pytest.raises(TypeError, match=r"score_mod must take 5 positional arguments \(score, b, h, q_idx, kv_idx\)"):
    flex.translate_score_mod(lambda s, b, h: s)
  with pytest.raises(TypeError, match=r"mask_mod must take 4 positional arguments \(b, h, q_idx, kv_idx\)"):
    flex.translate_mask_mod(lambda s, b, h, q, kv: q >= kv)


@pytest.mark.parametrize("fn, message", [
    (lambda s, b, h, q, kv: s + SMALL, r"score_mod must return a scalar; it returned float32\[5\]"),
    (lambda s, b, h, q, kv: q - kv, r"score_mod must return a float32, bfloat16 or float16 scalar; .*int32\[\]"),
    (lambda s, b, h, q, kv: s + COMPLEX[h].real, r"captures an array of dtype complex64 and shape \(2,\)"),
])
def test_bad_score_mods(fn, message):
  with pytest.raises(TypeError, match=message):
    flex.translate_score_mod(fn)


def test_mask_mod_must_return_bool():
  with pytest.raises(TypeError, match=r"mask_mod must return a bool scalar; it returned int32\[\]"):
    flex.translate_mask_mod(lambda b, h, q, kv: q - kv)


def _nvrtc():
  try:
    import nvidia  # the pip wheel's namespace package (nvidia-cuda-nvrtc)
  except ImportError:
    return None
  for base in nvidia.__path__:
    for path in sorted(glob.glob(os.path.join(base, "cu*", "lib", "libnvrtc.so.*[0-9]"))):
      try:
        return ctypes.CDLL(path)
      except OSError:
        continue
  return None


@pytest.mark.parametrize("name", ["alibi", "half_precision", "out_of_bounds_indices", "bits_and_conversions",
                                  "activations", "libm", "mask:document"])
def test_source_compiles_with_nvrtc(name):
  nvrtc = _nvrtc()
  if nvrtc is None:
    pytest.skip("NVRTC (the nvidia-cuda-nvrtc wheel) is not loadable")
  if name.startswith("mask:"):
    mod = flex.translate_mask_mod(MASK_MODS[name[5:]])
    call = "out[threadIdx.x] = mod.Mask(0, 1, threadIdx.x, 2);"
  else:
    mod = flex.translate_score_mod(SCORE_MODS[name][0])
    call = "out[threadIdx.x] = mod.Score(1.5f, 0, 1, threadIdx.x, 2) + mod.DScore(-1.0f, 1, 2, 3, threadIdx.x);"
  kernel = (f"{mod.source}\nextern \"C\" __global__ void Probe(te_jax::flex::{mod.struct} mod, float* out) {{ "
            f"{call} }}\n")
  headers = ["cpp/core/host_device.h", "cpp/core/flex_math.h"]
  contents = [(ROOT / h).read_bytes() for h in headers]
  program = ctypes.c_void_p()
  as_array = lambda items: (ctypes.c_char_p * len(items))(*items)
  assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), kernel.encode(), b"flex.cu", len(headers),
                                  as_array(contents), as_array([h.encode() for h in headers])) == 0
  options = [b"--gpu-architecture=compute_90", b"--std=c++17", b"-default-device", b"-DNDEBUG"]
  result = nvrtc.nvrtcCompileProgram(program, len(options), as_array(options))
  size = ctypes.c_size_t()
  nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
  log = ctypes.create_string_buffer(size.value)
  nvrtc.nvrtcGetProgramLog(program, log)
  nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
  assert result == 0, log.value.decode()
  assert b"warning" not in log.value, log.value.decode()
