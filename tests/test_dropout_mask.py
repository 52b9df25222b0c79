"""te_jax.dropout_keep_mask: Philox4x32-10 against Random123's known-answer vectors, the kept fraction, independence of
the tiling (a block computed with its offsets equals that block of the whole mask), and its argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax
from te_jax.dropout import philox4x32_10

# Random123 tests/kat_vectors, the three "philox4x32 10" lines: counter, key, result.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_matches_the_known_answers(counter, key, expected):
  words = jax.jit(philox4x32_10)(tuple(np.uint32(c) for c in counter), tuple(np.uint32(k) for k in key))
  assert tuple(int(w) for w in words) == expected


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_kept_fraction_is_one_minus_rate(rate):
  mask = jax.jit(te_jax.dropout_keep_mask, static_argnums=(1, 2))(jax.random.key(3), (4, 4, 625, 1000), rate)
  assert mask.dtype == jnp.bool_ and mask.shape == (4, 4, 625, 1000)  # 10^7 draws
  assert abs(float(jnp.mean(mask)) - (1.0 - rate)) < 1e-3


def test_element_takes_its_number_of_the_call_of_its_row_pair_and_key_quad():
  """The definition, element by element: call (4 (j // 16) + j // 2 % 4, 8 (i // 16) + i % 8, h, b) draws the numbers of
  rows i, i + 8 of a 16-row block and keys 2t, 2t + 1, 8 + 2t, 9 + 2t of a 16-key block; element (i, j) takes number
  4 (i // 8 % 2) + 2 (j // 8 % 2) + j % 2, the low (even) or high (odd) half of word number // 2; kept when at least
  round(rate * 2^16)."""
  key = jax.random.PRNGKey(11)
  rate = 0.3
  mask = np.asarray(te_jax.dropout_keep_mask(key, (2, 3, 21, 37), rate, offsets=(1, 0, 7, 5)))
  k0, k1 = (np.uint32(x) for x in np.asarray(key))
  threshold = round(rate * 2**16)
  for b, h, i, j in [(0, 0, 0, 0), (1, 2, 4, 20), (0, 1, 3, 2), (1, 0, 2, 11), (0, 2, 1, 3), (1, 1, 20, 36),
                     (0, 2, 9, 30), (1, 0, 17, 14)]:
    gi, gj = i + 7, j + 5
    words = philox4x32_10((np.uint32(4 * (gj // 16) + gj // 2 % 4), np.uint32(8 * (gi // 16) + gi % 8), np.uint32(h),
                           np.uint32(b + 1)), (k0, k1))
    k = 4 * (gi // 8 % 2) + 2 * (gj // 8 % 2) + gj % 2
    number = (int(words[k // 2]) >> (16 * (k % 2))) & 0xFFFF
    assert mask[b, h, i, j] == (number >= threshold), (b, h, i, j)


def test_a_block_with_its_offsets_is_that_block_of_the_whole_mask():
  key = jax.random.key(7)
  whole = np.asarray(te_jax.dropout_keep_mask(key, (3, 4, 40, 50), 0.3))
  block = np.asarray(te_jax.dropout_keep_mask(key, (2, 2, 17, 23), 0.3, offsets=(1, 2, 13, 21)))
  np.testing.assert_array_equal(block, whole[1:3, 2:4, 13:30, 21:44])
  other = np.asarray(te_jax.dropout_keep_mask(jax.random.key(8), (3, 4, 40, 50), 0.3))
  assert (other != whole).mean() > 0.3  # another key, another mask


def test_typed_and_raw_keys_give_the_same_mask_and_rate_zero_keeps_all():
  raw = jax.random.PRNGKey(5)
  typed = jax.random.wrap_key_data(raw)
  a = te_jax.dropout_keep_mask(raw, (1, 2, 9, 31), 0.2)
  b = te_jax.dropout_keep_mask(typed, (1, 2, 9, 31), 0.2)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert bool(te_jax.dropout_keep_mask(raw, (1, 2, 9, 31), 0.0).all())


@pytest.mark.parametrize("key, shape, rate, error, match", [
    (None, (1, 1, 2, 2), 1.0, ValueError, r"dropout_rate must be in \[0, 1\)"),
    (None, (1, 1, 2, 2), -0.1, ValueError, r"dropout_rate must be in \[0, 1\)"),
    (None, (1, 1, 2, 2), "0.1", TypeError, "dropout_rate must be a Python float"),
    (None, (2, 2), 0.1, ValueError, r"shape must be four ints in \[0, 2\*\*32\) for \(B, H, Sq, Skv\)"),
    (None, (1, 1, -2, 2), 0.1, ValueError, r"shape must be four ints .*got \(1, 1, -2, 2\)"),
    (None, (1, 1, 2.0, 2), 0.1, ValueError, "shape must be four ints"),
    (np.zeros(2, np.int32), (1, 1, 2, 2), 0.1, ValueError, "dropout_rng must be a typed PRNG key"),
    ([0, 1], (1, 1, 2, 2), 0.1, TypeError, "dropout_rng must be a JAX PRNG key"),
])
def test_bad_arguments_raise(key, shape, rate, error, match):
  key = jax.random.key(0) if key is None else key
  with pytest.raises(error, match=match):
    te_jax.dropout_keep_mask(key, shape, rate)


@pytest.mark.parametrize("offsets", [(-1, 0, 0, 0), (0, 0, 0), (0, 0, 2**32, 0), [0, 0, 0, 0.5]])
def test_bad_offsets_raise(offsets):
  with pytest.raises(ValueError, match=r"offsets must be four ints in \[0, 2\*\*32\)"):
    te_jax.dropout_keep_mask(jax.random.key(0), (1, 1, 2, 2), 0.1, offsets)
