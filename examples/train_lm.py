"""Train a small decoder-only transformer language model (Flax NNX, optax) with te_jax's attention or JAX's.

    python examples/train_lm.py                            # tiny, on the CPU: about 10 s on two cores
    python examples/train_lm.py --attention jax            # the same run with jax.nn's attention (Flax's default)
    python examples/train_lm.py --size gpu                 # on a GPU, where attention dominates (s = 4096, d = 128)
    python examples/train_lm.py --size gpu --attention jax-cudnn   # against jax.nn's cuDNN attention

Needs `pip install "te_jax[examples]"` (flax, optax, rich, matplotlib). Every run prints a summary (first and last
loss, tokens/s after the first, compiling, step) and writes the loss curve as a PNG (--plot).

The corpus is generated here, deterministically (--seed), so nothing is downloaded: short character-level
documents of two kinds, "count 7 by 3: 7 10 13 16" (continue an arithmetic progression) and "copy kqzt: kqzt" (repeat
what came before, which only attention can do), each ending in a newline. Documents are packed: the stream of
documents is cut into rows of seq_len + 1 tokens with no padding, so a row starts and ends mid-document.
--packing documents (the default) gives each document of a row its segment id, so a token attends only to earlier
tokens of its own document (te_jax: te_jax.flax.PackedSequences, fused_attn's segment ids; jax: the same as a boolean
mask). --packing rows makes each row one causal sequence, attention crossing the document boundaries: the default
with --attention jax-cudnn, whose runs measure cuDNN's fused causal attention (compare with te_jax --packing rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_jax
import te_jax.flax


@dataclasses.dataclass(frozen=True)
class Size:
  layers: int
  d_model: int
  heads: int
  seq_len: int
  batch: int
  steps: int
  lr: float


# tiny: a CPU run in CI (tests/test_example_train_lm.py). gpu: head dim 128 at s = 4096, where attention is most of the
# step's FLOPs (4 s d per token per layer for attention against 12 d^2 for the projections and the MLP: 4 * 4096 vs
# 12 * 1024, 1.3x).
SIZES = {
    "tiny": Size(layers=2, d_model=64, heads=4, seq_len=64, batch=16, steps=600, lr=3e-3),
    "small": Size(layers=4, d_model=256, heads=4, seq_len=256, batch=16, steps=500, lr=1e-3),
    "gpu": Size(layers=8, d_model=1024, heads=8, seq_len=4096, batch=8, steps=300, lr=3e-4),
}


# ---------------------------------------------------------------------------------------------------------------- data
def make_corpus(num_chars: int, seed: int) -> str:
  """Documents of the two kinds (module docstring), each ending in a newline, joined until num_chars."""
  rng = np.random.default_rng(seed)
  letters = "abcdefghijklmnopqrstuvwxyz"
  docs, total = [], 0
  while total < num_chars:
    if rng.random() < 0.5:
      start, step, count = int(rng.integers(0, 50)), int(rng.integers(1, 10)), int(rng.integers(4, 10))
      doc = f"count {start} by {step}: " + " ".join(str(start + i * step) for i in range(count)) + "\n"
    else:
      word = "".join(rng.choice(list(letters), int(rng.integers(3, 9))))
      doc = f"copy {word}: {word}\n"
    docs.append(doc)
    total += len(doc)
  return "".join(docs)


class Tokenizer:
  """Characters to ids and back; the vocabulary is the corpus's characters."""

  def __init__(self, text: str):
    self.chars = sorted(set(text))
    self.ids = {c: i for i, c in enumerate(self.chars)}

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    return np.array([self.ids[c] for c in text], np.int32)


def packed_rows(tokens: np.ndarray, seq_len: int, newline: int) -> tuple[np.ndarray, np.ndarray]:
  """The token stream cut into rows: tokens [N, seq_len + 1] (inputs are row[:-1], targets row[1:]) and the inputs'
  segment ids [N, seq_len]: 1 for the row's first (partial) document, 2 for the next, ... (a newline ends its
  document)."""
  n = (len(tokens) - 1) // seq_len
  document = np.concatenate([[0], np.cumsum(tokens == newline)[:-1]])  # documents ended before each token
  rows = np.stack([tokens[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])
  ids = np.stack([document[i * seq_len: i * seq_len + seq_len] - document[i * seq_len] + 1 for i in range(n)])
  return rows, ids.astype(np.int32)


# --------------------------------------------------------------------------------------------------------------- model
def attention_function(name: str, fp8: bool = False):
  """The attention_fn given to nnx.MultiHeadAttention."""
  if name == "te_jax":
    return te_jax.flax.make_attention_fn(fp8=True) if fp8 else te_jax.flax.attention_fn
  if fp8:
    raise ValueError("--fp8 is te_jax's (fused_attn(fp8=True)); use it with --attention te_jax")
  if name == "jax":
    return nnx.dot_product_attention  # Flax's default: jax.nn.dot_product_attention, XLA's implementation
  if name == "jax-cudnn":
    def cudnn_attention(query, key, value, bias=None, mask=None, dropout_rate=0.0, deterministic=True,
                        is_causal=False, **unused):
      if dropout_rate and not deterministic:
        raise ValueError("jax-cudnn attention here has no dropout")
      return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal, implementation="cudnn")
    return cudnn_attention
  raise ValueError(f"unknown attention {name!r}")


def document_mask(attention: str, segment_ids):
  """What the attention takes as the mask of packed documents: te_jax its segment ids, jax.nn a boolean mask."""
  if attention == "te_jax":
    return te_jax.flax.PackedSequences(segment_ids)
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # [B, 1, L, L]


class Block(nnx.Module):
  def __init__(self, d_model: int, heads: int, attention_fn, dtype, rngs: nnx.Rngs):
    self.norm1 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d_model, use_bias=False, decode=False,
                                       attention_fn=attention_fn, dtype=dtype, rngs=rngs)
    self.norm2 = nnx.RMSNorm(d_model, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(d_model, 4 * d_model, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * d_model, d_model, dtype=dtype, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask, is_causal=True)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class DecoderLM(nnx.Module):
  def __init__(self, vocab: int, size: Size, attention_fn, dtype, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, size.d_model, dtype=dtype, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (size.seq_len, size.d_model)))
    self.blocks = nnx.List([Block(size.d_model, size.heads, attention_fn, dtype, rngs) for _ in range(size.layers)])
    self.norm = nnx.RMSNorm(size.d_model, dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(size.d_model, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, mask=None):
    x = self.embed(tokens) + self.pos[...][: tokens.shape[1]].astype(self.embed.dtype or jnp.float32)
    for block in self.blocks:
      x = block(x, mask)
    return self.out(self.norm(x)).astype(jnp.float32)


# ------------------------------------------------------------------------------------------------------------ training
def loss_fn(model, rows, mask):
  logits = model(rows[:, :-1], mask)
  return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, rows, mask):
  loss, grads = nnx.value_and_grad(loss_fn)(model, rows, mask)
  optimizer.update(model, grads)
  return loss


class Progress:
  """rich's progress bar when rich is installed and asked for, else a line every tenth of the run."""

  def __init__(self, total: int, enabled: bool):
    self.total, self.bar = total, None
    if enabled:
      try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
            TimeRemainingColumn
        self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn())
        self.task = self.bar.add_task("train", total=total, info="")
        self.bar.start()
      except ImportError:
        pass

  def update(self, step: int, loss: float, tokens_per_s: float | None):
    info = f"loss {loss:.3f}" + (f"  {tokens_per_s:,.0f} tok/s" if tokens_per_s else "")
    if self.bar is not None:
      self.bar.update(self.task, completed=step + 1, info=info)
    elif step == 0 or (step + 1) % max(1, self.total // 10) == 0 or step + 1 == self.total:
      print(f"step {step + 1}/{self.total}  {info}", flush=True)

  def close(self):
    if self.bar is not None:
      self.bar.stop()


def plot_losses(losses, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(np.arange(1, len(losses) + 1), losses, lw=1)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/token)")
  ax.set_title(title, fontsize=9)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--attention", choices=("te_jax", "jax", "jax-cudnn"), default="te_jax")
  p.add_argument("--size", choices=tuple(SIZES), default="tiny")
  for name in ("layers", "d_model", "heads", "seq_len", "batch", "steps"):
    p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"overrides the size's {name}")
  p.add_argument("--lr", type=float, help="overrides the size's peak learning rate")
  p.add_argument("--dtype", choices=("float32", "bfloat16"),
                 help="default: float32 on the CPU, bfloat16 elsewhere (te_jax's CUDA kernels take bf16/fp16)")
  p.add_argument("--packing", choices=("documents", "rows"),
                 help="documents: each token sees only its own document (segment ids); rows: each row is one causal "
                      "sequence. Default: documents; rows with --attention jax-cudnn (cuDNN's fused causal kernel)")
  p.add_argument("--fp8", action="store_true",
                 help="te_jax's FP8 attention: q, k, v quantized to e4m3 inside, current scaling per step, "
                      "straight-through gradients (te_jax serves it on the CPU only so far)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--plot", default="train_lm_loss.png", help="where the loss curve PNG goes ('' for none)")
  p.add_argument("--summary-json", help="also write the summary as JSON here")
  p.add_argument("--no-progress", action="store_true", help="a line per tenth of the run instead of a progress bar")
  args = p.parse_args(argv)

  size = dataclasses.replace(SIZES[args.size], **{k: getattr(args, k) for k in
                                                   ("layers", "d_model", "heads", "seq_len", "batch", "steps", "lr")
                                                   if getattr(args, k) is not None})
  backend = jax.default_backend()
  dtype = jnp.dtype(args.dtype or ("float32" if backend == "cpu" else "bfloat16"))
  packing = args.packing or ("rows" if args.attention == "jax-cudnn" else "documents")

  # Enough text for every step to see fresh rows once (then it cycles).
  text = make_corpus(size.steps * size.batch * size.seq_len + size.seq_len + 1, args.seed)
  tokenizer = Tokenizer(text)
  rows, segment_ids = packed_rows(tokenizer.encode(text), size.seq_len, tokenizer.ids["\n"])
  num_batches = len(rows) // size.batch
  batches = rows[: num_batches * size.batch].reshape(num_batches, size.batch, size.seq_len + 1)
  batch_ids = segment_ids[: num_batches * size.batch].reshape(num_batches, size.batch, size.seq_len)

  model = DecoderLM(tokenizer.vocab_size, size, attention_function(args.attention, args.fp8), dtype,
                    nnx.Rngs(args.seed))
  warmup = max(1, size.steps // 20)
  schedule = optax.warmup_cosine_decay_schedule(0.0, size.lr, warmup, size.steps, size.lr / 10)
  optimizer = nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.01), wrt=nnx.Param)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  print(f"train_lm: attention {args.attention}{' fp8' if args.fp8 else ''}, {backend} "
        f"({jax.devices()[0].device_kind}), {dtype.name}, "
        f"{size.layers} layers, d_model {size.d_model}, {size.heads} heads (head dim {size.d_model // size.heads}), "
        f"seq {size.seq_len}, batch {size.batch}, {size.steps} steps, {params:,} parameters, vocab "
        f"{tokenizer.vocab_size}, {len(rows)} packed rows, packing {packing}", flush=True)

  losses, progress = [], Progress(size.steps, enabled=not args.no_progress)
  start = time.perf_counter()
  first_step_s = None
  try:
    for step in range(size.steps):
      b = step % num_batches
      mask = document_mask(args.attention, jnp.asarray(batch_ids[b])) if packing == "documents" else None
      loss = float(train_step(model, optimizer, jnp.asarray(batches[b]), mask))  # float() waits for the step
      if step == 0:
        first_step_s = time.perf_counter() - start
        timed_from = time.perf_counter()
      losses.append(loss)
      elapsed = time.perf_counter() - timed_from
      tokens_per_s = step * size.batch * size.seq_len / elapsed if step else None
      progress.update(step, loss, tokens_per_s)
  finally:
    progress.close()
  total_s = time.perf_counter() - start
  timed_steps = size.steps - 1
  summary = dict(attention=args.attention, fp8=args.fp8, backend=backend, dtype=dtype.name, packing=packing,
                 size=dataclasses.asdict(size),
                 parameters=params, first_loss=losses[0], last_loss=float(np.mean(losses[-10:])),
                 tokens_per_s=(timed_steps * size.batch * size.seq_len / (total_s - first_step_s)
                               if timed_steps else math.nan),
                 first_step_s=first_step_s, total_s=total_s, losses=losses)
  print(f"summary: attention {args.attention}: loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
        f"(mean of the last 10 steps); {summary['tokens_per_s']:,.0f} tokens/s over steps 2-{size.steps} "
        f"(first step, with compiling: {first_step_s:.1f} s); total {total_s:.1f} s", flush=True)
  if args.plot:
    plot_losses(losses, args.plot, f"train_lm: {args.attention}, {backend} {dtype.name}, {size.layers}x{size.d_model}, "
                                   f"seq {size.seq_len}, packing {packing}, {summary['tokens_per_s']:,.0f} tokens/s")
    print(f"loss curve: {args.plot}")
  if args.summary_json:
    with open(args.summary_json, "w") as f:
      json.dump(summary, f, indent=1)
  return summary


if __name__ == "__main__":
  main(sys.argv[1:])
