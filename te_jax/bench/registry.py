"""The backend registry. Each backend declares what it supports (Capabilities) and answers *why not* for a case it
cannot run; whether it actually works here is proven separately by running it (availability.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Callable

from te_jax.bench.cases import MODES, Case, short_dtype
from te_jax.bench.flops import workload


@dataclasses.dataclass(frozen=True)
class Capabilities:
  platforms: dict[str, tuple[str, ...]]  # "cpu"/"gpu" -> dtypes, the first being the one availability is probed with
  max_head_dim: int = 256
  head_dim_multiple: int = 8
  causal: bool = True
  causal_cross: bool = True  # top-left causal with Sq != Skv
  bottom_right: bool = False  # a causal mask (and window) aligned at the end of the keys, with Sq != Skv
  window: bool = False
  window_needs_causal: bool = False  # only (left, 0) windows, i.e. with a causal mask or right == 0
  softcap: bool = False
  alibi: bool = False
  bias: bool = False  # an additive bias of either BIAS_SHAPES kind
  sinks: bool = False
  dropout: bool = False
  gqa: bool = True
  modes: tuple[str, ...] = MODES
  seq_multiple: int = 1  # Sq and Skv must be multiples of this
  equal_seq_for_bwd: bool = False

  def describe(self) -> str:
    plats = "; ".join(f"{p}: {'/'.join(short_dtype(d) for d in ds)}" for p, ds in self.platforms.items())
    feats = [f"D<={self.max_head_dim}"]
    feats += [name for name, ok in (("causal", self.causal), ("bottom-right", self.bottom_right),
                                    ("window", self.window), ("softcap", self.softcap),
                                    ("alibi", self.alibi), ("bias", self.bias), ("sinks", self.sinks),
                                    ("dropout", self.dropout), ("gqa", self.gqa)) if ok]
    return f"{plats} | {' '.join(feats)} | {','.join(self.modes)}"


class Prepared:
  """A backend set up for one case and mode: inputs on the device, functions compiled. Timing calls run_calls."""
  memory_bytes: int | None = None  # peak device memory of one call, where the platform reports it
  memory_source: str = ""

  def run_calls(self, n: int) -> float:
    """Seconds for n calls dispatched back to back (rotating input sets) with one synchronisation at the end."""
    raise NotImplementedError

  def outputs(self) -> dict:
    """float64 NumPy results of one call on input set 0, in te_jax's layout: out (fwd) or dq, dk, dv."""
    raise NotImplementedError

  def close(self) -> None:
    pass


class Backend:
  name: str = ""
  label: str = ""
  framework: str = "jax"  # "jax" or "torch": how inputs are placed and calls timed
  requires: tuple[str, ...] = ()  # top-level modules that must be importable
  caps: Capabilities = Capabilities(platforms={})
  url: str = ""
  # False for a row that times the case's data movement, not attention (a bandwidth ceiling, a ring's communication):
  # it is measured only when named, charged no FLOPs, and proven available by running, with no error check.
  computes_attention: bool = True
  # True for a row whose K/V (or q, k and v) the backend quantizes to FP8 e4m3: its errors against the float64
  # reference on the case's inputs include the quantization's, and are judged by accuracy.FP8_TOLERANCE.
  fp8: bool = False

  def not_installed(self) -> str | None:
    """A reason when a needed package is missing, without importing it."""
    for module in self.requires:
      if importlib.util.find_spec(module) is None:
        return f"not installed (no module {module!r})"
    return None

  def declared_platform_reason(self, platform: str) -> str | None:
    if platform not in self.caps.platforms:
      return f"runs on {'/'.join(self.caps.platforms) or 'no platform'} only, this is {platform}"
    return None

  def platform_reason(self, platform: str) -> str | None:
    """Why the backend cannot run on this platform here (may import the backend; subclasses add runtime checks)."""
    return self.declared_platform_reason(platform)

  def why_not(self, case: Case, mode: str, platform: str) -> str | None:
    """Why this backend cannot run the case (None if it declares support). Declared limits only."""
    c = self.caps
    reason = self.declared_platform_reason(platform)
    if reason:
      return reason
    if case.dtype not in c.platforms[platform]:
      return f"{short_dtype(case.dtype)} unsupported on {platform} (supports " \
             f"{', '.join(short_dtype(d) for d in c.platforms[platform])})"
    if mode not in c.modes:
      return f"no {mode} (supports {', '.join(c.modes)})"
    if case.head_dim > c.max_head_dim or case.head_dim % c.head_dim_multiple:
      return f"head dim {case.head_dim} unsupported (multiples of {c.head_dim_multiple} up to {c.max_head_dim})"
    if case.causal and not c.causal:
      return "no causal mask"
    if case.causal and case.seq_q != case.seq_kv and not case.bottom_right and not c.causal_cross:
      return "causal mask is bottom-right aligned; this case needs top-left with Sq != Skv"
    if case.window is not None:
      if case.bottom_right_differs and not c.bottom_right:
        return "no window aligned at the end of the keys (bottom-right)"
      if not c.window:
        return "no sliding window"
      if c.window_needs_causal and not (case.causal or case.window[1] == 0):
        return "window must be (left, 0) or come with a causal mask"
    if case.softcap and not c.softcap:
      return "no logit softcap"
    if case.alibi and not c.alibi:
      return "no ALiBi"
    if case.bias and not c.bias:
      return "no additive bias"
    if case.sinks and not c.sinks:
      return "no attention sinks"
    if case.dropout and not c.dropout:
      return "no dropout"
    if case.gqa and not c.gqa:
      return f"no GQA/MQA (needs kv heads == heads, got {case.kv_heads} vs {case.heads})"
    if c.seq_multiple > 1 and (case.seq_q % c.seq_multiple or case.seq_kv % c.seq_multiple):
      return f"Sq and Skv must be multiples of {c.seq_multiple}"
    if c.equal_seq_for_bwd and mode != "fwd" and case.seq_q != case.seq_kv:
      return "backward needs Sq == Skv"
    if self.not_installed():  # version-dependent limits need the package; availability reports it missing
      return None
    return self.extra_why_not(case, mode, platform)

  def extra_why_not(self, case: Case, mode: str, platform: str) -> str | None:
    return None

  def computed_case(self, case: Case) -> tuple[Case, str]:
    """The case this backend computes for `case` (which why_not accepted), and a note when that is another problem.
    Without a bottom-right causal mask, queries at the end of the keys run with no mask: for one query that is the
    same mask; for several it is what such a backend can do, and the note says so (the error column then checks the
    unmasked result)."""
    if not case.bottom_right_differs or self.caps.bottom_right:
      return case, ""
    unmasked = dataclasses.replace(case, causal=False, bottom_right=False)
    return unmasked, "" if case.seq_q == 1 else "runs without a mask (it has no bottom-right causal mask)"

  def prepare(self, inputs, mode: str, num_sets: int) -> Prepared:
    raise NotImplementedError

  def reference_bias(self, case: Case):
    """An additive bias [1, H, Sq, Skv] the reference adds where the backend computes more than the case's attention
    (a score_mod that adds a table), else None."""
    return None

  def error_case(self, case: Case) -> Case:
    """The case whose errors against the reference stand for `case`'s: its small version."""
    return case.small()

  def workload(self, case: Case, mode: str) -> dict:
    """What a result of this backend is charged: the case's FLOPs (none for a row that computes no attention) and the
    K/V bytes of a forward (flops.workload)."""
    charged = workload(case, mode)
    return charged if self.computes_attention else dict(charged, flops=None)


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  if backend.name in _REGISTRY:
    raise ValueError(f"backend {backend.name!r} is already registered")
  _REGISTRY[backend.name] = backend
  return backend


def unregister(name: str) -> None:
  _REGISTRY.pop(name, None)


def all_backends() -> list[Backend]:
  _load_builtin()
  return list(_REGISTRY.values())


def get(name: str) -> Backend:
  _load_builtin()
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(_REGISTRY)}") from None


_loaded = False


def _load_builtin() -> None:
  global _loaded
  if not _loaded:
    _loaded = True
    from te_jax.bench import backends_jax, backends_torch  # noqa: F401  (they register themselves)


def default_baseline(platform: str) -> str:
  return "jax-cudnn" if platform == "gpu" else "jax-xla"


BackendFactory = Callable[[], Backend]
