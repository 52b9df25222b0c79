"""GPU: te_jax.dot_product_attention against jax.nn.dot_product_attention on the same GPU, bf16 at head dims 64 and
128, forward and gradients: against cuDNN (implementation="cudnn") where cuDNN serves the arguments (causal or not,
MHA/GQA/MQA, T != S), against XLA's attention with lengths, windows, a bias and a boolean mask (te_jax's bias kernels;
a mask becomes a 0/-inf bias). Skipped without a GPU."""

from __future__ import annotations

import pytest

from test_cuda_attention import _GPUS  # noqa: F401  (skips this module without a GPU)
from test_drop_in import MASK_COMBINATIONS, _compare

# name: (B, T, S, N, K, H), as tests/test_drop_in.py's SHAPES at sizes where the GPU kernels tile.
SHAPES = {"self_gqa": (2, 256, 256, 8, 2, 128), "qlong_mha": (2, 384, 200, 4, 4, 64),
          "kvlong_mqa": (2, 128, 320, 8, 1, 128)}
B, T, S, N = 2, 256, 256, 8  # self_gqa's, for the bias shapes


@pytest.mark.parametrize("is_causal", (False, True), ids=("full", "causal"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_cudnn(shape, is_causal):
  _compare(shape, is_causal, None, None, dtype_name="bfloat16", return_residual=False, peer="cudnn")


@pytest.mark.parametrize("window,lengths", [((64, 0), None), (32, "both"), (None, "kv")], ids=("win64_0", "win32",
                                                                                               "kvlen"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_windows_and_lengths_match_xla(shape, window, lengths):
  _compare(shape, True, window, lengths, dtype_name="bfloat16", return_residual=True)


@pytest.mark.parametrize("bias_shape", ((B, N, T, S), (1, N, T, S), (B, 1, 1, S), (T, S)), ids=str)
def test_bias_matches_xla(bias_shape):
  got, _, _ = _compare(SHAPES["self_gqa"], *MASK_COMBINATIONS[1], dtype_name="bfloat16", bias_shape=bias_shape)
  assert got[5].shape == bias_shape


@pytest.mark.parametrize("mask_kind", ("random", "padding", "causal"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_mask_matches_xla(shape, mask_kind):
  _compare(shape, *MASK_COMBINATIONS[2], dtype_name="bfloat16", mask_kind=mask_kind, return_residual=True)
