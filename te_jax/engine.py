"""Which engine runs a call: te_jax's own kernels ("te") or cuDNN's fused SDPA graphs ("cudnn"), or "auto", which
picks per configuration the faster one that serves it. The request travels in AttentionConfig (static, so part of
jit's cache key); the lowering resolves it for the platform (te_jax/_backends.py: Backend.choose_engine) and names the
resolved engine in the custom call (the FFI attribute `engine`, the legacy descriptor's engine byte), so both paths run
exactly the same engine and no handler ever chooses or falls back."""

from __future__ import annotations

import dataclasses
import os

ENGINES = ("auto", "te", "cudnn")
ENGINE_CODES = {"te": 0, "cudnn": 1}  # cpp/core/engine.h: never renumber
ENV_VAR = "TE_JAX_ENGINE"


def requested_engine(engine) -> str:
  """The engine a fused_attn call asks for: its `engine` argument, else $TE_JAX_ENGINE, else "auto"."""
  if engine is None:
    engine = os.environ.get(ENV_VAR, "auto")
    if engine not in ENGINES:
      raise ValueError(f"{ENV_VAR} must be one of {', '.join(ENGINES)}, got {engine!r}")
    return engine
  if not isinstance(engine, str) or engine not in ENGINES:
    raise ValueError(f"engine must be one of {', '.join(repr(e) for e in ENGINES)}, got {engine!r}")
  return engine


@dataclasses.dataclass(frozen=True)
class Choice:
  engine: str  # "te" | "cudnn"
  why: str  # how it was chosen, for the compile log line


def params_for_engine(params: dict, engine: str) -> dict:
  """The core params a call runs with on `engine`: only te_jax's kernels merge attention sinks into their rows; after
  cuDNN's kernel the lowering merges them (te_jax/_primitives.py), outside the custom call (and its measurement)."""
  return dict(params, engine=ENGINE_CODES[engine], has_sinks=bool(params.get("has_sinks")) and engine == "te")


class EngineUnavailableError(ValueError):
  """An explicitly requested engine cannot serve a call (the message says why); never replaced silently."""
