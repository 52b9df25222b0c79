"""The C++ of a mod's CPU library: the generated struct and, around it, the tile functions of cpp/core/flex_mods.h,
which fill the struct's members from the call's FlexCapture array once per tile and loop over the tile's key-major
elements, so the per-element Score / DScore / Mask call is inlined."""

from __future__ import annotations

from te_jax.flex import dtypes

_TILE = "int64_t ld, int64_t b, int64_t h, int64_t q0, int64_t rows, int64_t kv0, int64_t cols"
_INDICES = "static_cast<int>(b), static_cast<int>(h), static_cast<int>(q0 + r), static_cast<int>(kv0 + c)"


def _bind(spec) -> list[str]:
  """The struct with its members pointing at the captures."""
  return [f"const auto mod = te_jax::flex::{'ScoreMod' if spec.kind == 'score_mod' else 'MaskMod'}::Bind(captures);"]


def _function(name: str, parameters: str, bind: list[str], element: list[str]) -> list[str]:
  return [f'extern "C" void {name}(const te_jax::FlexCapture* captures, {parameters}) {{',
          *(f"  {line}" for line in bind),
          "  for (int64_t c = 0; c < cols; ++c) {", "    for (int64_t r = 0; r < rows; ++r) {",
          *(f"      {line}" for line in element), "    }", "  }", "}", ""]


def tile_source(spec) -> str:
  """spec: a te_jax.flex.ModSpec."""
  bind = _bind(spec)
  if spec.kind == "score_mod":
    functions = [
        *_function("te_jax_flex_score_tile", f"float unit, float* scores, {_TILE}", bind,
                   ["float& s = scores[c * ld + r];", f"s = unit * mod.Score(s / unit, {_INDICES});"]),
        *_function("te_jax_flex_dscore_tile", f"float unit, const float* scores, float* dscores, {_TILE}", bind,
                   ["float& ds = dscores[c * ld + r];",
                    f"if (ds != 0.0f) ds *= mod.DScore(scores[c * ld + r] / unit, {_INDICES});"])]
    if any(dtypes.is_float(c.dtype) for c in spec.capture_types):
      functions += _function(
          "te_jax_flex_dcaptures_tile",
          f"float unit, const float* scores, const float* dscores, float* const* grads, {_TILE}", bind,
          ["const float ds = dscores[c * ld + r];",
           f"if (ds != 0.0f) mod.DCaptures(ds, scores[c * ld + r] / unit, {_INDICES}, grads);"])
  else:
    functions = _function("te_jax_flex_mask_tile", f"float* scores, {_TILE}", bind,
                          [f"if (!mod.Mask({_INDICES})) scores[c * ld + r] = -INFINITY;"])
  return "\n".join([f"// te_jax's CPU library of a {spec.kind} (te_jax/flex/tile_source.py).",
                    '#include "cpp/core/flex_mods.h"', spec.source, *functions])
