"""te_jax.flax: Flax's MultiHeadAttention (NNX and Linen) with te_jax's attention function trains like the default
attention (same seed, 50 steps, losses equal to tolerance), causal, packed, with a padding mask; Flax's dot_product_attention contract (batch dims,
dtype, GQA); what it refuses, with a message."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import te_jax
import te_jax.flax

VOCAB, EMBED, HEADS, SEQ, BATCH, STEPS = 37, 32, 4, 24, 4, 50
# Both attentions run in float32; their per-step difference (~1e-7 relative) grows a little over 50 Adam steps, and
# where the loss levels out (near 0.07, 2% of where it starts) Adam's steps amplify it: 4e-5 relative at step 49 of
# the packed run with jax 0.10.2, 1.7e-4 with 0.12.0. So the losses are compared at the scale of the first one.
LOSS_RTOL = 1e-4


def _tokens(seed=0):
  return jax.random.randint(jax.random.key(seed), (BATCH, SEQ + 1), 0, VOCAB)


def _next_token_loss(logits, tokens, valid=None):
  """Mean over the valid tokens (all without valid): padded query rows differ (te_jax 0, Flax the mean of value)."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
  weights = jnp.ones_like(losses) if valid is None else valid.astype(losses.dtype)
  return (losses * weights).sum() / weights.sum()


class NnxModel(nnx.Module):
  def __init__(self, attention_fn, rngs, num_kv_heads=None, dropout_rate=0.0):
    self.embed = nnx.Embed(VOCAB, EMBED, rngs=rngs)
    kw = {} if attention_fn is None else dict(attention_fn=attention_fn)
    self.attn = nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMBED, num_kv_heads=num_kv_heads, decode=False,
                                       dropout_rate=dropout_rate, rngs=rngs, **kw)
    self.head = nnx.Linear(EMBED, VOCAB, rngs=rngs)

  def __call__(self, tokens, **call_kw):
    x = self.embed(tokens)
    return self.head(x + self.attn(x, **call_kw))


def _train_nnx(attention_fn, num_kv_heads=None, **call_kw):
  model = NnxModel(attention_fn, nnx.Rngs(0), num_kv_heads=num_kv_heads)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = _tokens()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: _next_token_loss(m(tokens[:, :-1], **call_kw), tokens))(model)
    optimizer.update(model, grads)
    return loss

  return np.array([float(step(model, optimizer)) for _ in range(STEPS)])


class LinenModel(nn.Module):
  attention_fn: object = None

  @nn.compact
  def __call__(self, tokens, mask=None):
    x = nn.Embed(VOCAB, EMBED)(tokens)
    kw = {} if self.attention_fn is None else dict(attention_fn=self.attention_fn)
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, **kw)(x, mask=mask)
    return nn.Dense(VOCAB)(x)


def _train_linen(attention_fn, pass_causal_mask, padding_mask=None):
  """padding_mask: also pass the module nn.make_attention_mask of these valid tokens [batch, SEQ]."""
  model = LinenModel(attention_fn)
  tokens = _tokens()
  inputs = tokens[:, :-1]
  mask = nn.make_causal_mask(inputs) if pass_causal_mask else None
  if padding_mask is not None:
    mask = nn.combine_masks(mask, nn.make_attention_mask(padding_mask, padding_mask))
  params = model.init(jax.random.key(0), inputs, mask)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(lambda p: _next_token_loss(model.apply(p, inputs, mask), tokens,
                                                                padding_mask))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(STEPS):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return np.array(losses)


def _assert_trains_the_same(got, want):
  assert want[-1] < 0.7 * want[0], f"the reference did not learn: {want[0]} -> {want[-1]}"
  np.testing.assert_allclose(got, want, rtol=LOSS_RTOL, atol=LOSS_RTOL * want[0])


@pytest.mark.parametrize("num_kv_heads", (None, 2), ids=("mha", "gqa"))
def test_nnx_causal_trains_like_default(num_kv_heads):
  want = _train_nnx(None, num_kv_heads, is_causal=True)
  got = _train_nnx(te_jax.flax.attention_fn, num_kv_heads, is_causal=True)
  _assert_trains_the_same(got, want)


def _segment_ids():
  """Documents of lengths 5..11 packed back to back in each row, ids from 1 (no padding)."""
  rng = np.random.default_rng(1)
  rows = []
  for _ in range(BATCH):
    lengths = []
    while sum(lengths) < SEQ:
      lengths.append(int(rng.integers(5, 12)))
    rows.append(np.repeat(np.arange(1, len(lengths) + 1), lengths)[:SEQ])
  return jnp.asarray(np.stack(rows), jnp.int32)


def test_nnx_packed_documents_train_like_a_segment_mask():
  """te_jax's segment ids (PackedSequences in the mask slot) against Flax's default attention with the boolean mask
  of the same documents, both causal."""
  ids = _segment_ids()
  want = _train_nnx(None, 2, is_causal=True, mask=nn.make_attention_mask(ids, ids, jnp.equal))
  got = _train_nnx(te_jax.flax.attention_fn, 2, is_causal=True, mask=te_jax.flax.PackedSequences(ids))
  _assert_trains_the_same(got, want)
  causal_only = _train_nnx(te_jax.flax.attention_fn, 2, is_causal=True)
  assert np.abs(causal_only - got).max() > 1e-3, "the segment ids changed nothing"


# Valid tokens of each row of a padded batch.
VALID = jnp.asarray(np.arange(SEQ)[None, :] < np.array([SEQ, SEQ - 5, 9, 17])[:, None])


@pytest.mark.parametrize("te_jax_mask", ("segment_ids", "flax_mask"))
def test_nnx_padding_trains_like_a_padding_mask(te_jax_mask):
  """A padding mask as Flax's own boolean mask (a bias in te_jax) or as segment ids 1 (token) and 0 (padding). Padded
  query rows differ (te_jax 0, Flax the mean of value), so the loss counts real tokens only, and then training is the
  same."""
  tokens = _tokens()
  flax_mask = nn.make_attention_mask(VALID, VALID)

  def train(attention_fn, mask):
    model = NnxModel(attention_fn, nnx.Rngs(0), num_kv_heads=2)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
      loss_fn = lambda m: _next_token_loss(m(tokens[:, :-1], mask=mask, is_causal=True), tokens, VALID)
      loss, grads = nnx.value_and_grad(loss_fn)(model)
      optimizer.update(model, grads)
      return loss

    return np.array([float(step(model, optimizer)) for _ in range(STEPS)])

  want = train(None, flax_mask)
  got = train(te_jax.flax.attention_fn,
              flax_mask if te_jax_mask == "flax_mask" else te_jax.flax.PackedSequences(VALID.astype(jnp.int32)))
  _assert_trains_the_same(got, want)


def test_linen_causal_and_padding_mask_trains_like_default():
  """Linen's causal and padding masks combined into one mask, which te_jax applies as a bias."""
  want = _train_linen(None, pass_causal_mask=True, padding_mask=VALID)
  got = _train_linen(te_jax.flax.attention_fn, pass_causal_mask=True, padding_mask=VALID)
  _assert_trains_the_same(got, want)


def test_bias_and_mask_with_batch_dims_match_flax():
  """Flax's contract for bias and mask: broadcastable to [batch..., H, Lq, Lkv] (a lower-rank bias, a mask over the
  batch dims and keys), a float 0/1 mask; forward and the bias gradient, with is_causal and GQA."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((2, 3, 7, 4, 8)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((2, 3, 9, 2, 8)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((4, 7, 9)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 3, 1, 1, 9)) < 0.7).at[..., 0].set(True).astype(jnp.float32)

  def loss(fn, bias):
    return (fn(q, kv, kv, bias=bias, mask=mask, is_causal=True) ** 2).sum()

  got, dgot = jax.value_and_grad(lambda b: loss(te_jax.flax.attention_fn, b))(bias)
  want, dwant = jax.value_and_grad(lambda b: loss(nnx.dot_product_attention, b))(bias)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  assert dgot.shape == bias.shape
  np.testing.assert_allclose(np.asarray(dgot), np.asarray(dwant), rtol=1e-4, atol=1e-5)


def test_linen_packed_documents_forward():
  ids = _segment_ids()
  x = jax.random.normal(jax.random.key(3), (BATCH, SEQ, EMBED))
  ref = nn.MultiHeadDotProductAttention(num_heads=HEADS)
  te = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=te_jax.flax.make_attention_fn(mask_type="causal"))
  params = ref.init(jax.random.key(0), x)
  want = ref.apply(params, x, mask=nn.combine_masks(nn.make_attention_mask(ids, ids, jnp.equal),
                                                    nn.make_causal_mask(ids)))
  got = te.apply(params, x, mask=te_jax.flax.PackedSequences(ids))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_packed_sequences_with_batch_dims():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((2, 3, 10, 2, 8)), jnp.float32)
  ids = jnp.asarray(np.repeat([[1] * 4 + [2] * 6], 6, axis=0).reshape(2, 3, 10), jnp.int32)
  got = te_jax.flax.attention_fn(q, q, q, mask=te_jax.flax.PackedSequences(ids), is_causal=True)
  want = nnx.dot_product_attention(q, q, q, mask=nn.make_attention_mask(ids, ids, jnp.equal), is_causal=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="PackedSequences.q_segment_ids must be"):
    te_jax.flax.attention_fn(q, q, q, mask=te_jax.flax.PackedSequences(ids[0]))


def test_nnx_causal_from_make_attention_fn():
  want = _train_nnx(None, is_causal=True)
  got = _train_nnx(te_jax.flax.make_attention_fn(mask_type="causal"))  # no is_causal at the call
  _assert_trains_the_same(got, want)


@pytest.mark.parametrize("te_jax_fn", ("mask_type", "ignore_mask"))
def test_linen_causal_trains_like_default(te_jax_fn):
  want = _train_linen(None, pass_causal_mask=True)
  if te_jax_fn == "mask_type":  # causal from the attention function, the module gets no mask
    got = _train_linen(te_jax.flax.make_attention_fn(mask_type="causal"), pass_causal_mask=False)
  else:  # the module keeps its nn.make_causal_mask, which te_jax is told to drop
    got = _train_linen(te_jax.flax.make_attention_fn(mask_type="causal", ignore_mask=True), pass_causal_mask=True)
  _assert_trains_the_same(got, want)


def test_nnx_dropout_deterministic_is_the_default_attention():
  """dropout_rate > 0 run deterministic (evaluation) applies no dropout in Flax; te_jax serves that."""
  x = jax.random.normal(jax.random.key(1), (2, 9, EMBED))
  kw = dict(num_heads=HEADS, in_features=EMBED, decode=False, dropout_rate=0.3)
  ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
  te = nnx.MultiHeadAttention(**kw, attention_fn=te_jax.flax.attention_fn, rngs=nnx.Rngs(0))
  np.testing.assert_allclose(te(x, is_causal=True, deterministic=True), ref(x, is_causal=True, deterministic=True),
                             rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="set the module's broadcast_dropout=False"):
    te(x, is_causal=True, deterministic=False)


def test_dropout_is_fused_attn_dropout_with_the_flax_key():
  """Flax's dropout_rng and dropout_rate become fused_attn's: the same keep-mask (te_jax.dropout_keep_mask), so the
  result equals the float64 reference with that mask; an NNX module applies it while training, with gradients."""
  rng = np.random.default_rng(3)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 11, HEADS, 8)), jnp.float32) for _ in range(3))
  key = jax.random.key(9)
  got = te_jax.flax.attention_fn(q, k, v, dropout_rate=0.25, dropout_rng=key, broadcast_dropout=False)
  keep = np.asarray(te_jax.dropout_keep_mask(key, (2, HEADS, 11, 11), 0.25))
  s = np.einsum("bihd,bjhd->bhij", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(8)
  p = np.exp(s - s.max(-1, keepdims=True))
  p = p / p.sum(-1, keepdims=True) * keep / 0.75
  np.testing.assert_allclose(np.asarray(got), np.einsum("bhij,bjhd->bihd", p, np.asarray(v, np.float64)),
                             rtol=1e-5, atol=1e-6)
  mha = nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMBED, decode=False, dropout_rate=0.1,
                               broadcast_dropout=False, attention_fn=te_jax.flax.attention_fn, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 9, EMBED))
  train, evaluation = mha(x, deterministic=False), mha(x, deterministic=True)
  assert np.isfinite(np.asarray(train)).all() and not np.allclose(np.asarray(train), np.asarray(evaluation))
  grads = nnx.grad(lambda m: jnp.sum(m(x, deterministic=False) ** 2))(mha)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("batch_dims", ((), (3,), (2, 3)), ids=("none", "one", "two"))
@pytest.mark.parametrize("dtype", (None, jnp.bfloat16), ids=("promoted", "bf16"))
def test_contract_of_flax_dot_product_attention(batch_dims, dtype):
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal(batch_dims + (7, 4, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal(batch_dims + (9, 2, 16)), jnp.bfloat16)  # promoted with q to float32
  v = jnp.asarray(rng.standard_normal(batch_dims + (9, 2, 16)), jnp.float32)
  want = nnx.dot_product_attention(q, k, v, dtype=dtype)
  got = te_jax.flax.attention_fn(q, k, v, dtype=dtype)
  assert got.shape == want.shape and got.dtype == want.dtype
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


def test_refused_with_a_message():
  x = jax.random.normal(jax.random.key(1), (2, 9, EMBED))
  q = k = v = x.reshape(2, 9, HEADS, EMBED // HEADS)
  fn = te_jax.flax.attention_fn
  with pytest.raises(ValueError, match=r"broadcastable to \[batch..., heads, q_length, kv_length\]"):
    fn(q, k, v, bias=jnp.zeros((1, 2, HEADS, 9, 9)))
  with pytest.raises(ValueError, match="broadcast_dropout=True"):
    fn(q, k, v, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match="needs a dropout_rng"):
    fn(q, k, v, dropout_rate=0.1, deterministic=False, broadcast_dropout=False)
  with pytest.raises(ValueError, match="sow_weights"):
    nnx.MultiHeadAttention(num_heads=HEADS, in_features=EMBED, decode=False, attention_fn=fn,
                           rngs=nnx.Rngs(0))(x, sow_weights=True)
  with pytest.raises(ValueError, match="needs q_seqlens"):
    te_jax.flax.make_attention_fn(mask_type="padding")
  with pytest.raises(TypeError, match="unknown te_jax option"):
    te_jax.flax.make_attention_fn(dropout=0.1)


def test_make_attention_fn_passes_te_jax_options():
  x = jax.random.normal(jax.random.key(2), (2, 10, 2, 16))
  fn = te_jax.flax.make_attention_fn(mask_type="causal", window_size=(3, 0), softcap=5.0, scale=0.2)
  want = te_jax.fused_attn(x, x, x, mask_type="causal", window_size=(3, 0), softcap=5.0, scale=0.2)
  np.testing.assert_array_equal(np.asarray(fn(x, x, x)), np.asarray(want))


def test_te_jax_flax_is_reachable_from_te_jax():
  """`import te_jax` does not load te_jax.flax; `te_jax.flax` does, on first use."""
  code = ("import sys, te_jax; assert 'te_jax.flax' not in sys.modules; "
          "assert callable(te_jax.flax.attention_fn); assert 'te_jax.flax' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)
