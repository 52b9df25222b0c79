"""Greedy generation from a small random-weight decoder (Flax NNX) with a paged KV cache in the model's dtype or FP8.

    python examples/generate.py                      # tiny, on the CPU: both caches, a few seconds
    python examples/generate.py --size gpu --cache model

Each layer keeps its keys and values in a page pool (te_jax.paged_attention's layout): the prompt's are written by
te_jax.append_kv_pages after a causal te_jax.fused_attn over the prompt (prefill), then each new token's are appended
and its query attends over the pages (decode). The FP8 cache is e4m3 with a descale per page and kv head, each page
requantized as it fills; the cache is never dequantized outside the attention call. Printed per cache: tokens/s of the
decode steps (after the first, which compiles), and for the FP8 cache, against the model-dtype cache, how many greedy
tokens agree and the largest logit difference of the first step that reads the cache. --check also recomputes every
step's logits without a cache (causal attention over the whole sequence) and reports the largest difference from the
cached step's. FP8 attention runs on te_jax's CPU backend only so far (a GPU refuses it rather than run at another
precision): on a GPU use --cache model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import te_jax


@dataclasses.dataclass(frozen=True)
class Size:
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  vocab: int
  batch: int
  prompt: int
  new_tokens: int
  page_size: int


SIZES = {
    "tiny": Size(layers=2, d_model=64, heads=4, kv_heads=2, vocab=97, batch=2, prompt=21, new_tokens=12, page_size=8),
    "gpu": Size(layers=8, d_model=2048, heads=16, kv_heads=4, vocab=32000, batch=16, prompt=2048, new_tokens=128,
                page_size=64),
}


@dataclasses.dataclass
class PagedCache:
  """One layer's page pools and their descales (None for a bfloat16/float32 pool)."""
  k: jax.Array
  v: jax.Array
  k_descale: jax.Array | None
  v_descale: jax.Array | None

  def write(self, k, v, table, positions):
    k_pages, k_descale = te_jax.append_kv_pages(self.k, self.k_descale, k, table, positions)
    v_pages, v_descale = te_jax.append_kv_pages(self.v, self.v_descale, v, table, positions)
    return PagedCache(k_pages, v_pages, k_descale, v_descale)

  def attend(self, q, table, lengths):
    return te_jax.paged_attention(q, self.k, self.v, table, lengths, k_descale=self.k_descale,
                                  v_descale=self.v_descale)


jax.tree_util.register_dataclass(PagedCache, data_fields=["k", "v", "k_descale", "v_descale"], meta_fields=[])


def empty_cache(size: Size, num_pages: int, cache: str, dtype) -> list[PagedCache]:
  shape = (num_pages, size.page_size, size.kv_heads, size.d_model // size.heads)
  if cache == "fp8":
    pages, descale = jnp.zeros(shape, jnp.float8_e4m3fn), jnp.ones((num_pages, size.kv_heads), jnp.float32)
    return [PagedCache(pages, pages, descale, descale) for _ in range(size.layers)]
  return [PagedCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, None) for _ in range(size.layers)]


class Layer(nnx.Module):
  def __init__(self, size: Size, dtype, rngs: nnx.Rngs):
    d, hd = size.d_model, size.d_model // size.heads
    self.heads, self.kv_heads, self.head_dim = size.heads, size.kv_heads, hd
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
    self.norm1, self.norm2 = nnx.RMSNorm(d, dtype=dtype, rngs=rngs), nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
    self.q, self.kv, self.o = linear(d, size.heads * hd), linear(d, 2 * size.kv_heads * hd), linear(size.heads * hd, d)
    self.up, self.down = linear(d, 4 * d), linear(4 * d, d)

  def __call__(self, x, cache: PagedCache | None, table, positions):
    """x [B, T, d]: the tokens at positions .. positions + T - 1. cache None: no cache, causal attention over x (the
    check's recomputation). Else the new keys and values are written into it and the queries attend over its pages
    (T > 1 is the prefill: its own keys, by a causal fused_attn, at positions 0)."""
    b, t, _ = x.shape
    h = self.norm1(x)
    q = self.q(h).reshape(b, t, self.heads, self.head_dim)
    k, v = jnp.split(self.kv(h).reshape(b, t, 2 * self.kv_heads, self.head_dim), 2, axis=2)
    if cache is not None:
      cache = cache.write(k, v, table, positions)
    if cache is None or t > 1:
      a = te_jax.fused_attn(q, k, v, mask_type="causal")
    else:
      a = cache.attend(q.astype(x.dtype), table, positions + t).astype(x.dtype)
    x = x + self.o(a.reshape(b, t, -1))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), cache


class Decoder(nnx.Module):
  def __init__(self, size: Size, max_len: int, dtype, rngs: nnx.Rngs):
    self.embed = nnx.Embed(size.vocab, size.d_model, dtype=dtype, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, size.d_model)))
    self.layers = nnx.List([Layer(size, dtype, rngs) for _ in range(size.layers)])
    self.norm = nnx.RMSNorm(size.d_model, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(size.d_model, size.vocab, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, caches, table, positions):
    """Logits [B, T, vocab] of tokens [B, T] at positions[b] + t, and the caches with their keys and values."""
    where = positions[:, None] + jnp.arange(tokens.shape[1])[None, :]
    x = self.embed(tokens) + self.pos[...][where].astype(self.embed.dtype or jnp.float32)
    new = []
    for layer, cache in zip(self.layers, caches or [None] * len(self.layers)):
      x, cache = layer(x, cache, table, positions)
      new.append(cache)
    return self.out(self.norm(x)).astype(jnp.float32), (new if caches else None)


def generate(model, size: Size, prompt, cache: str, dtype, check: bool) -> dict:
  """Greedy decoding of size.new_tokens after the prompt; returns the tokens, each step's logits, timing and, with
  check, the largest difference between a cached step's logits and a recomputation without the cache."""
  graph, state = nnx.split(model)
  pages_per_seq = -(-(size.prompt + size.new_tokens) // size.page_size)
  # Each sequence's pages, scattered over the pool as an allocator would leave them.
  table = jnp.asarray(np.random.default_rng(0).permutation(size.batch * pages_per_seq).reshape(size.batch, -1),
                      jnp.int32)

  @jax.jit
  def step(state, tokens, caches, positions):
    logits, caches = nnx.merge(graph, state)(tokens, caches, table, positions)
    return logits[:, -1], caches

  @jax.jit
  def recompute(state, tokens):
    return nnx.merge(graph, state)(tokens, None, table, jnp.zeros((size.batch,), jnp.int32))[0][:, -1]

  caches = empty_cache(size, size.batch * pages_per_seq, cache, dtype)
  positions = jnp.zeros((size.batch,), jnp.int32)
  logits, caches = step(state, prompt, caches, positions)
  tokens, all_logits, times, check_diff = prompt, [], [], 0.0
  positions = positions + size.prompt
  for i in range(size.new_tokens):
    all_logits.append(np.asarray(logits))
    if check:
      check_diff = max(check_diff, float(jnp.abs(recompute(state, tokens) - logits).max()))
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
    tokens = jnp.concatenate([tokens, nxt], axis=1)
    if i == size.new_tokens - 1:
      break
    t0 = time.perf_counter()
    logits, caches = step(state, nxt, caches, positions)
    logits.block_until_ready()
    times.append(time.perf_counter() - t0)
    positions = positions + 1
  steady = times[1:] or times
  return dict(tokens=np.asarray(tokens[:, size.prompt:]), logits=np.stack(all_logits),
              tokens_per_s=size.batch * len(steady) / max(sum(steady), 1e-9), check_max_logit_diff=check_diff)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
  parser.add_argument("--cache", choices=("both", "model", "fp8"), default="both",
                      help="the KV cache: in the model's dtype, FP8 (e4m3, a descale per page and kv head), or both")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                      help="the model's dtype (default: float32 on a CPU, bfloat16 on a GPU)")
  parser.add_argument("--check", action="store_true", help="recompute each step without the cache and compare")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--summary-json", help="write the summary here")
  args = parser.parse_args(argv)
  size = SIZES[args.size]
  dtype = jnp.dtype(args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16"))
  model = Decoder(size, size.prompt + size.new_tokens, dtype, nnx.Rngs(args.seed))
  prompt = jax.random.randint(jax.random.key(args.seed + 1), (size.batch, size.prompt), 0, size.vocab, jnp.int32)
  caches = ("model", "fp8") if args.cache == "both" else (args.cache,)
  print(f"generate: {args.size}, {size.layers} layers, d {size.d_model}, heads {size.heads}/{size.kv_heads}, batch "
        f"{size.batch}, prompt {size.prompt} + {size.new_tokens} tokens, pages of {size.page_size}, {dtype.name}, "
        f"{jax.default_backend()}")
  runs, summary = {}, dict(size=args.size, backend=jax.default_backend(), dtype=dtype.name, caches={})
  for cache in caches:
    runs[cache] = run = generate(model, size, prompt, cache, dtype, args.check)
    entry = dict(tokens_per_s=run["tokens_per_s"], tokens=run["tokens"].tolist())
    line = f"{dtype.name if cache == 'model' else cache:>8} cache: {run['tokens_per_s']:9.1f} tokens/s"
    if args.check:
      entry["check_max_logit_diff"] = run["check_max_logit_diff"]
      line += f", cached vs recomputed logits: max |diff| {run['check_max_logit_diff']:.2e}"
    if cache == "fp8" and "model" in runs:
      ref = runs["model"]
      agree = float(np.mean(run["tokens"] == ref["tokens"]))
      # The first decode step: both caches hold the same prompt and first token, and it is the first to read them.
      diff = float(np.abs(run["logits"][1] - ref["logits"][1]).max())
      entry.update(tokens_agree=agree, cache_step_max_logit_diff=diff,
                   cache_step_logit_scale=float(np.abs(ref["logits"][1]).max()))
      line += f"; against the {dtype.name} cache: {agree:.0%} of the greedy tokens agree, the first decode step's " \
              f"logits max |diff| {diff:.3g} (of {entry['cache_step_logit_scale']:.3g})"
    summary["caches"][cache] = entry
    print(line)
  if args.summary_json:
    with open(args.summary_json, "w") as f:
      json.dump(summary, f, indent=1)
  return summary


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
