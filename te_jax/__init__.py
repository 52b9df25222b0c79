"""te_jax: fused attention for JAX, one C++ core behind XLA FFI and legacy custom calls."""

from te_jax.attention import fused_attn
from te_jax.block_mask import BlockMask, create_block_mask
from te_jax.cpu_isa import cpu_isa
from te_jax.custom_call_path import current_custom_call_path, custom_call_path
from te_jax.drop_in import dot_product_attention
from te_jax.dropout import dropout_keep_mask
from te_jax.packing import (positions_from_cu_seqlens, positions_from_lengths, segment_ids_from_cu_seqlens,
                            segment_ids_from_lengths)
from te_jax.engine import EngineUnavailableError
from te_jax.flex_attention import flex_attention
from te_jax.fp8 import append_kv_pages, dequantize_fp8, quantize_fp8, quantize_kv_pages
from te_jax.export_checks import disabled_export_checks
from te_jax.legacy_failures import raise_legacy_failures
from te_jax.load_balancing import inverse_reorder_for_load_balancing, reorder_for_load_balancing
from te_jax.mask_type import MaskType
from te_jax.merge_states import merge_states
from te_jax.paged_attention import paged_attention

try:
  import te_jax._cuda  # noqa: F401  registers the CUDA backend when the _te_jax_cuda extension was built
except ImportError as error:
  from te_jax import _primitives
  _primitives.register_unavailable("cuda", (
      "te_jax was installed without its CUDA backend: no cuda.h was found when it was built (a CUDA toolkit, or "
      "pip's nvidia-cuda-runtime headers); reinstall with one present (README, Quick start)"
      if isinstance(error, ModuleNotFoundError) and error.name == "te_jax._te_jax_cuda" else
      f"te_jax's CUDA backend failed to load: {error}"))

from te_jax import _backends  # noqa: E402  after the CUDA backend's registration
_backends.register_available_targets()

__all__ = ["fused_attn", "flex_attention", "merge_states", "paged_attention", "segment_ids_from_lengths",
           "positions_from_lengths", "segment_ids_from_cu_seqlens", "positions_from_cu_seqlens",
           "dot_product_attention", "dropout_keep_mask", "MaskType", "EngineUnavailableError", "custom_call_path",
           "current_custom_call_path", "raise_legacy_failures", "reorder_for_load_balancing",
           "inverse_reorder_for_load_balancing", "cpu_isa", "disabled_export_checks", "quantize_fp8", "dequantize_fp8",
           "quantize_kv_pages", "append_kv_pages", "BlockMask", "create_block_mask"]
__version__ = "0.1.0"


def __getattr__(name):
  # te_jax.flax (Flax's attention_fn contract) is loaded on first use, so `import te_jax` stays as it was.
  if name == "flax":
    import importlib
    return importlib.import_module("te_jax.flax")
  raise AttributeError(f"module 'te_jax' has no attribute {name!r}")
