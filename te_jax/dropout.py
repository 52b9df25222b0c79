"""The keep-mask of attention dropout, from a counter-based generator: Philox4x32-10 (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) keyed by the JAX PRNG key's two 32-bit words, with a counter made of the
element's global indices (b, h, i, j). Any tiling, kernel, backend or shard computes any element's bit alone, so the
same key gives the same mask everywhere; a shard passes its offsets into the global [B, H, Sq, Skv] (context
parallelism: its query and key blocks' first positions).

Element (b, h, i, j) uses 16-bit number 4 (i // 8 % 2) + 2 (j // 8 % 2) + j % 2 of
Philox(counter = (4 (j // 16) + j // 2 % 4, 8 (i // 16) + i % 8, h, b), key) (number k: the low half of word k // 2 for
even k, the high half for odd k): one call serves rows i, i + 8 of a 16-row block and keys 2t, 2t + 1, 8 + 2t, 9 + 2t of
a 16-key block, the elements one GPU lane holds of a matrix-multiply accumulator (cpp/core/philox.h). An element is kept
when its number is at least round(rate * 2^16), so the rate takes effect rounded to a multiple of 2^-16 (below 2^-17
no element is dropped)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_M0, _M1 = np.uint32(0xD2511F53), np.uint32(0xCD9E8D57)  # Philox4x32's multipliers
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)  # its key increments (the golden ratio, sqrt(3) - 1)


def _mul_hi_lo(a, m):
  """(high, low) 32-bit halves of the 64-bit product of uint32 arrays a and a uint32 constant m, in 16-bit limbs (no
  64-bit integers, which JAX enables only in x64 mode)."""
  a0, a1 = a & 0xFFFF, a >> 16
  m0, m1 = m & 0xFFFF, m >> 16
  low = a0 * m0
  mid = a1 * m0 + (low >> 16)
  cross = (mid & 0xFFFF) + a0 * m1
  high = a1 * m1 + (mid >> 16) + (cross >> 16)
  return high, a * m


def philox4x32_10(counter, key):
  """Philox4x32-10: counter a tuple of four uint32 arrays (broadcastable), key a tuple of two uint32 scalars. Returns
  the four output words."""
  c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  for _ in range(10):
    hi0, lo0 = _mul_hi_lo(c0, _M0)
    hi1, lo1 = _mul_hi_lo(c2, _M1)
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    k0, k1 = k0 + _W0, k1 + _W1
  return c0, c1, c2, c3


def key_words(key):
  """The two uint32 words of a JAX PRNG key: a typed key (jax.random.key) whose data is two words, or a raw
  uint32[2] key (jax.random.PRNGKey)."""
  if not hasattr(key, "dtype"):
    raise TypeError(f"dropout_rng must be a JAX PRNG key, got {type(key).__name__}")
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  if key.dtype != jnp.uint32 or tuple(key.shape) != (2,):
    raise ValueError("dropout_rng must be a typed PRNG key of two 32-bit words (jax.random.key with the default "
                     f"threefry implementation) or a raw uint32[2] key; got data of dtype {key.dtype}, shape "
                     f"{tuple(key.shape)}")
  return key[0], key[1]


def drop_threshold(rate: float) -> np.uint32:
  """The 16-bit number below which an element is dropped (cpp/core/philox.h's kDropoutThresholdLimit is 2^16)."""
  return np.uint32(min(round(float(rate) * 2.0**16), 2**16 - 1))


def check_rate(rate) -> float:
  if isinstance(rate, bool) or not isinstance(rate, (int, float, np.floating, np.integer)):
    raise TypeError(f"dropout_rate must be a Python float, got {type(rate).__name__}")
  if not 0.0 <= float(rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
  return float(rate)


def dropout_keep_mask(key, shape, rate, offsets=(0, 0, 0, 0)):
  """bool [B, H, Sq, Skv]: which probabilities attention dropout keeps (for tests and debugging; it materializes the
  whole mask). key: a JAX PRNG key (typed, or raw uint32[2]); shape: (B, H, Sq, Skv); rate in [0, 1); offsets: the
  (b, h, i, j) of element [0, 0, 0, 0] in the global mask."""
  k0, k1 = key_words(key)
  rate = check_rate(rate)
  for name, values in (("shape", shape), ("offsets", offsets)):
    if (not isinstance(values, (tuple, list)) or len(values) != 4 or
        not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and 0 <= n < 2**32 for n in values)):
      raise ValueError(f"{name} must be four ints in [0, 2**32) for (B, H, Sq, Skv), got {values!r}")
  b, h, i, j = (jnp.arange(n, dtype=jnp.uint32) + jnp.uint32(o) for n, o in zip(shape, offsets))
  i, j = i[:, None], j[None, :]
  words = philox4x32_10((((j >> 4) << 2) + (j >> 1 & 3), ((i >> 4) << 3) + (i & 7), h[None, :, None, None],
                         b[:, None, None, None]), (k0, k1))
  number = (i >> 3 & 1) * 4 + (j >> 3 & 1) * 2 + (j & 1)
  word = jnp.select([number >> 1 == w for w in range(3)], list(words[:3]), words[3])
  half = jnp.where((number & 1) == 1, word >> 16, word & 0xFFFF)
  return half >= drop_threshold(rate)
