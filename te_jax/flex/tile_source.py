"""The C++ of a mod's CPU library: the generated struct and, around it, the tile functions of cpp/core/flex_mods.h,
which fill the struct's members from the call's FlexCapture array once per tile and loop over the tile's key-major
elements, so the per-element Score / DScore / Mask call is inlined. A mask_mod's library also exports
te_jax_flex_mask_blocks (te_jax/flex/mask_blocks.py), its block mask computed on the host by the same Mask."""

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


def _mask_blocks(bind: list[str]) -> list[str]:
  """blocks[batch][heads][ceil(sq / block_q)][ceil(skv / block_kv)] = each block's state (kBlockHidden, kBlockPartial,
  kBlockVisible) over its pairs inside sq x skv; a block's scan stops once it has seen a pair kept and one hidden."""
  return ['extern "C" void te_jax_flex_mask_blocks(const te_jax::FlexCapture* captures, int8_t* blocks, '
          "int64_t batch, int64_t heads, int64_t sq, int64_t skv, int64_t block_q, int64_t block_kv) {",
          *(f"  {line}" for line in bind),
          "  for (int64_t b = 0; b < batch; ++b) {", "  for (int64_t h = 0; h < heads; ++h) {",
          "  for (int64_t q0 = 0; q0 < sq; q0 += block_q) {", "  for (int64_t kv0 = 0; kv0 < skv; kv0 += block_kv) {",
          "    bool some = false, every = true;",
          "    for (int64_t q = q0; q < q0 + block_q && q < sq && (every || !some); ++q) {",
          "      for (int64_t kv = kv0; kv < kv0 + block_kv && kv < skv && (every || !some); ++kv) {",
          "        const bool keep = mod.Mask(static_cast<int>(b), static_cast<int>(h), static_cast<int>(q), "
          "static_cast<int>(kv));",
          "        some |= keep;", "        every &= keep;", "      }", "    }",
          "    *blocks++ = every ? te_jax::kBlockVisible : some ? te_jax::kBlockPartial : te_jax::kBlockHidden;",
          "  }", "  }", "  }", "  }", "}", ""]


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
    functions = [*_function("te_jax_flex_mask_tile", f"float* scores, {_TILE}", bind,
                            [f"if (!mod.Mask({_INDICES})) scores[c * ld + r] = -INFINITY;"]),
                 *_mask_blocks(bind)]
  return "\n".join([f"// te_jax's CPU library of a {spec.kind} (te_jax/flex/tile_source.py).",
                    '#include "cpp/core/flex_mods.h"', spec.source, *functions])
