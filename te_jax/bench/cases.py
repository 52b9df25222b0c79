"""A benchmark case: one attention problem (shapes, mask, variant, dtype). Modes are kept apart from the case."""

from __future__ import annotations

import dataclasses

MODES = ("fwd", "bwd", "fwd+bwd")
DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "float32": "float32", "bf16": "bfloat16",
                  "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16"}
_MODE_ALIASES = {"fwd": "fwd", "forward": "fwd", "bwd": "bwd", "backward": "bwd", "fwd+bwd": "fwd+bwd",
                 "fwdbwd": "fwd+bwd", "train": "fwd+bwd", "fwd_bwd": "fwd+bwd"}


def parse_dtype(name: str) -> str:
  try:
    return _DTYPE_ALIASES[name.strip().lower()]
  except KeyError:
    raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)} (or fp32, bf16, fp16)") from None


def parse_mode(name: str) -> str:
  try:
    return _MODE_ALIASES[name.strip().lower()]
  except KeyError:
    raise ValueError(f"unknown mode {name!r}; use one of {', '.join(MODES)}") from None


# An additive bias by what it varies over, with its shape: every head's [Sq, Skv] logits, or one row per batch entry
# (a key mask's shape).
BIAS_SHAPES = {"heads": "1,H,Sq,Skv", "keys": "B,1,1,Skv"}


def short_dtype(dtype: str) -> str:
  return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]


@dataclasses.dataclass(frozen=True)
class Case:
  """q [batch, seq_q, heads, head_dim], k and v [batch, seq_kv, kv_heads, head_dim].

  causal is top-left aligned (query i sees keys j <= i), as in jax.nn.dot_product_attention and torch SDPA, unless
  bottom_right: then the queries are the last Sq tokens of the sequence (query i sees keys j <= Skv - Sq + i), as when
  decoding against a KV cache. window is (left, right) around that diagonal, -1 meaning unbounded on that side.
  bias, sinks and dropout are fused_attn's optional operands: an additive bias of a BIAS_SHAPES kind, a sink logit per
  head, attention dropout at that rate.
  """
  batch: int
  seq_q: int
  seq_kv: int
  heads: int
  kv_heads: int
  head_dim: int
  causal: bool = False
  bottom_right: bool = False  # the causal diagonal at the end of the keys; needs causal
  window: tuple[int, int] | None = None
  softcap: float = 0.0
  alibi: bool = False
  bias: str = ""  # "" (none) or a key of BIAS_SHAPES
  sinks: bool = False
  dropout: float = 0.0
  dtype: str = "float32"
  label: str = ""  # a model name or preset group; only for display and plot panels

  def __post_init__(self):
    for name in ("batch", "seq_q", "seq_kv", "heads", "kv_heads", "head_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.bottom_right and not self.causal:
      raise ValueError("bottom_right aligns the causal mask at the end of the keys; it needs causal=True")
    if self.heads % self.kv_heads:
      raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
    if self.window is not None:
      object.__setattr__(self, "window", tuple(int(w) for w in self.window))
      if self.window == (-1, -1):
        object.__setattr__(self, "window", None)
    if self.bias and self.bias not in BIAS_SHAPES:
      raise ValueError(f"bias must be '' or one of {', '.join(BIAS_SHAPES)}, got {self.bias!r}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be a rate in [0, 1), got {self.dropout}")
    if self.dtype not in DTYPES:
      object.__setattr__(self, "dtype", parse_dtype(self.dtype))

  @property
  def gqa(self) -> bool:
    return self.kv_heads != self.heads

  @property
  def bottom_right_differs(self) -> bool:
    """Whether the causal mask's alignment matters: bottom-right, and Sq != Skv (with Sq == Skv both are one mask)."""
    return self.bottom_right and self.seq_q != self.seq_kv

  @property
  def mask_type(self) -> str:
    """te_jax's name of the mask (te_jax.reference takes the same)."""
    if not self.causal:
      return "no_mask"
    return "causal_bottom_right" if self.bottom_right else "causal"

  @property
  def mask_label(self) -> str:
    parts = [self.mask_type]
    if self.window is not None:
      parts.append(f"window{self.window[0]},{self.window[1]}")
    if self.softcap:
      parts.append(f"softcap{self.softcap:g}")
    if self.alibi:
      parts.append("alibi")
    if self.bias:
      parts.append(f"bias[{BIAS_SHAPES[self.bias]}]")
    if self.sinks:
      parts.append("sinks")
    if self.dropout:
      parts.append(f"dropout{self.dropout:g}")
    return "+".join(parts)

  @property
  def shape_label(self) -> str:
    heads = f"{self.heads}" if not self.gqa else f"{self.heads}/{self.kv_heads}"
    seq = f"{self.seq_q}" if self.seq_q == self.seq_kv else f"{self.seq_q}x{self.seq_kv}"
    return f"b{self.batch} s{seq} h{heads} d{self.head_dim}"

  def te_jax_kwargs(self) -> dict:
    """fused_attn keyword arguments (the operands, alibi slopes to dropout key, come with the inputs)."""
    kwargs = dict(mask_type=self.mask_type, window_size=self.window or (-1, -1), softcap=float(self.softcap))
    if self.dropout:
      kwargs["dropout_rate"] = self.dropout
    return kwargs

  def small(self) -> "Case":
    """The same problem at a size the float64 reference handles quickly: the same mask, variant, head dim, dtype and
    head grouping, short sequences, one batch entry."""
    group = self.heads // self.kv_heads
    kv_heads = 1 if group > 1 else 2
    seq_q = self.seq_q if self.seq_q < 128 else 256
    seq_kv = 256 if self.seq_kv >= 128 else self.seq_kv
    window = self.window
    if window is not None:
      window = tuple(w if w < 0 else min(w, 64) for w in window)
    return dataclasses.replace(self, batch=1, seq_q=seq_q, seq_kv=seq_kv, heads=group * kv_heads, kv_heads=kv_heads,
                               window=window, label="")

  def to_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["window"] = list(self.window) if self.window else None
    return d

  @classmethod
  def from_dict(cls, d: dict) -> "Case":
    d = dict(d)
    if d.get("window") is not None:
      d["window"] = tuple(d["window"])
    return cls(**d)
