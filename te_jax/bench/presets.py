"""Presets: sweeps of cases, or explicit lists where the shapes form no grid. Command-line flags override a sweep's
fields (and --batch/--heads switch off the token/hidden-size rules that derive batch and heads from the sequence length
and head dim); an explicit list takes only --dtype and --mode."""

from __future__ import annotations

import dataclasses

from te_jax.bench.cases import Case


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  heads: int
  kv_heads: int
  head_dim: int
  window: tuple[int, int] | None = None
  softcap: float = 0.0


# Attention shapes of common models (per layer, bf16). Windows count the key itself: a 4096-token window is (4095, 0).
LLAMA_MODELS = (
    Model("Llama-3.2-1B", 32, 8, 64),
    Model("Llama-3.1-8B", 32, 8, 128),
    Model("Llama-3.1-70B", 64, 8, 128),
    Model("Qwen2.5-7B", 28, 4, 128),
    Model("Mistral-7B-v0.1 (SWA)", 32, 8, 128, window=(4095, 0)),
    Model("Gemma-2-9B (global)", 16, 8, 256, softcap=50.0),
)


@dataclasses.dataclass
class Sweep:
  seqs: list[int]
  head_dims: list[int] = dataclasses.field(default_factory=lambda: [128])
  causal: list[bool] = dataclasses.field(default_factory=lambda: [False])
  modes: list[str] = dataclasses.field(default_factory=lambda: ["fwd", "fwd+bwd"])
  seqs_kv: list[int] | None = None  # None: Skv = Sq
  batch: int | None = None
  tokens: int | None = None  # batch = tokens // seq when batch is None
  heads: int | None = None
  hidden: int | None = None  # heads = hidden // head_dim when heads is None
  kv_heads: int | None = None  # None: = heads
  models: tuple[Model, ...] | None = None  # instead of heads/kv_heads/head_dims
  window: tuple[int, int] | None = None
  softcap: float = 0.0
  alibi: bool = False
  dtypes: list[str] | None = None  # None: the platform's default

  def cases(self, platform: str) -> list[Case]:
    dtypes = self.dtypes or [default_dtype(platform)]
    shapes = []
    if self.models:
      shapes = [(m.name, m.heads, m.kv_heads, m.head_dim, m.window, m.softcap) for m in self.models]
    else:
      for d in self.head_dims:
        heads = self.heads if self.heads is not None else max(1, (self.hidden or 2048) // d)
        kv = self.kv_heads if self.kv_heads is not None else heads
        shapes.append(("", heads, kv, d, self.window, self.softcap))
    cases = []
    for dtype in dtypes:
      for label, heads, kv_heads, d, window, softcap in shapes:
        for causal in self.causal:
          for seq in self.seqs:
            for seq_kv in (self.seqs_kv or [seq]):
              batch = self.batch if self.batch is not None else max(1, (self.tokens or 16384) // seq)
              cases.append(Case(batch=batch, seq_q=seq, seq_kv=seq_kv, heads=heads, kv_heads=kv_heads, head_dim=d,
                                causal=causal, window=self.window or window, softcap=self.softcap or softcap,
                                alibi=self.alibi, dtype=dtype, label=label))
    return cases


@dataclasses.dataclass
class CaseList:
  """Explicit cases, for presets whose shapes form no grid; their dtype is the list's (the platform's default when
  None)."""
  shapes: list[Case]
  modes: list[str]
  dtypes: list[str] | None = None

  def cases(self, platform: str) -> list[Case]:
    return [dataclasses.replace(c, dtype=dtype) for dtype in (self.dtypes or [default_dtype(platform)])
            for c in self.shapes]


def default_dtype(platform: str) -> str:
  return "bfloat16" if platform == "gpu" else "float32"


def quick(platform: str) -> Sweep:
  """The no-argument run: about a minute on a 2-core CPU, a few seconds of measurement per backend on a GPU."""
  if platform == "gpu":
    return Sweep(seqs=[1024, 2048, 4096], head_dims=[128], causal=[False, True], tokens=16384, hidden=2048)
  return Sweep(seqs=[512, 1024, 2048], head_dims=[64], batch=1, heads=8)


def fa(platform: str) -> Sweep:
  """FlashAttention's benchmark grid: 16k tokens per batch (B = 16384 / S), hidden 2048 (H = 2048 / D)."""
  return Sweep(seqs=[512, 1024, 2048, 4096, 8192, 16384], head_dims=[64, 128, 256], causal=[False, True],
               tokens=16384, hidden=2048)


def llama(platform: str) -> Sweep:
  """GQA (and SWA / softcap) shapes of common models, causal, 16k tokens per batch."""
  return Sweep(seqs=[1024, 2048, 4096, 8192], causal=[True], tokens=16384, models=LLAMA_MODELS)


def _decode_case(label: str, batch: int, seq_q: int, seq_kv: int) -> Case:
  return Case(batch=batch, seq_q=seq_q, seq_kv=seq_kv, heads=32, kv_heads=8, head_dim=128, causal=True,
              bottom_right=True, label=label)


def decode(platform: str) -> CaseList:
  """Decoding against a KV cache (Llama-3.1-8B heads: 32 / 8 kv, D = 128), forward only, the queries at the end of the
  keys (bottom-right causal): one token at batch 8 for KV lengths 1k..128k, batch 64 at 4k, and 16 queries (speculative
  decoding) at batch 8 and 8k. Memory-bound: read it by its K/V bandwidth. On the CPU the same kinds of case at batch 1
  (2 for the large batch) and KV up to 16k, so that it runs in a few minutes."""
  if platform == "cpu":
    sweep_batch, seqs_kv, large_batch, queries_kv = 1, [1024, 4096, 16384], 2, 4096
  else:
    sweep_batch, seqs_kv, large_batch, queries_kv = 8, [1024, 4096, 8192, 16384, 32768, 65536, 131072], 64, 8192
  shapes = [_decode_case("decode", sweep_batch, 1, s) for s in seqs_kv]
  shapes += [_decode_case("large batch", large_batch, 1, 4096), _decode_case("16 queries", sweep_batch, 16, queries_kv)]
  return CaseList(shapes, modes=["fwd"])


def cpu(platform: str) -> Sweep:
  """te_jax's CPU forward against XLA's attention at one long sequence: b 1, s 2k and 4k, h 8, d 64, causal or not
  (float32 on the CPU)."""
  return Sweep(seqs=[2048, 4096], head_dims=[64], causal=[False, True], batch=1, heads=8, modes=["fwd"])


def packed(platform: str) -> Sweep:
  """Packed documents: 2, 8 and 32 documents of 8k, 2k and 512 tokens, causal and not, as a batch (te_jax-te,
  jax-cudnn) and as one row of 16k tokens told apart by segment ids (te_jax-packed; te_jax-unsorted-packed with the ids
  falling); h 16, d 128. On the CPU 8 causal documents of 2k, h 4, d 64. --batch sets the number of documents, --seq
  their length."""
  if platform == "cpu":
    return Sweep(seqs=[2048], head_dims=[64], causal=[True], batch=8, heads=4)
  return Sweep(seqs=[512, 2048, 8192], head_dims=[128], causal=[True, False], tokens=16384, heads=16)


def features(platform: str) -> CaseList:
  """What each optional operand of fused_attn costs over plain attention: one causal problem plain, with sinks, with a
  bias [1, H, S, S], with a bias [B, 1, 1, S] (a key mask's shape) and with dropout 0.1, forward and forward +
  backward. b 4 x s 4k (16k tokens), h 16, d 128 on a GPU; b 1 x 2k, h 4, d 64 on the CPU."""
  batch, seq, heads, head_dim = (1, 2048, 4, 64) if platform == "cpu" else (4, 4096, 16, 128)
  plain = Case(batch=batch, seq_q=seq, seq_kv=seq, heads=heads, kv_heads=heads, head_dim=head_dim, causal=True)
  variants = [dict(), dict(sinks=True), dict(bias="heads"), dict(bias="keys"), dict(dropout=0.1)]
  return CaseList([dataclasses.replace(plain, **v) for v in variants], modes=["fwd", "fwd+bwd"])


PRESETS = {"quick": quick, "fa": fa, "llama": llama, "decode": decode, "cpu": cpu, "packed": packed,
           "features": features}
