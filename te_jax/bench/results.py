"""Result rows: one per (case, mode, backend), whatever happened (ok, failed, unsupported, skipped), plus speedups."""

from __future__ import annotations

import dataclasses

from te_jax.bench.cases import Case

STATUSES = ("ok", "failed", "unsupported", "skipped")
# The most queries a sequence a forward counts as a decode step (one token, or a speculative draft of up to 16).
DECODE_QUERIES = 16


@dataclasses.dataclass
class Result:
  case: Case
  mode: str
  backend: str
  status: str
  reason: str = ""
  median_ms: float | None = None
  p25_ms: float | None = None
  p75_ms: float | None = None
  min_ms: float | None = None
  max_ms: float | None = None
  samples: int | None = None
  calls_per_sample: int | None = None
  flops: float | None = None  # None for a row that computes no attention (Backend.computes_attention)
  tflops: float | None = None
  kv_bytes: float | None = None  # the K/V a forward reads (flops.kv_bytes); None for the backward modes
  tbps: float | None = None  # kv_bytes / median time, TB/s
  # A decode step's (a forward of at most DECODE_QUERIES queries a sequence) tokens a second: batch * Sq / median time.
  tokens_per_s: float | None = None
  speedup: float | None = None  # baseline median / this median, same case and mode
  max_err: float | None = None
  rel_err: float | None = None
  err_ok: bool | None = None
  memory_mib: float | None = None
  memory_source: str = ""
  setup_s: float | None = None

  @property
  def key(self) -> tuple:
    return (self.case, self.mode)

  @property
  def spread(self) -> float | None:
    if self.median_ms and self.p25_ms is not None and self.p75_ms is not None:
      return (self.p75_ms - self.p25_ms) / 2 / self.median_ms
    return None

  def to_dict(self) -> dict:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "case"}
    case = self.case.to_dict()
    case["window"] = "" if case["window"] is None else f"{case['window'][0]},{case['window'][1]}"
    return {**case, "mask": self.case.mask_label, **d}

  @classmethod
  def from_dict(cls, d: dict) -> "Result":
    d = dict(d)
    case_fields = {f.name for f in dataclasses.fields(Case)}
    case = {k: d.pop(k) for k in list(d) if k in case_fields}
    window = case.get("window")
    if isinstance(window, str):
      case["window"] = tuple(int(x) for x in window.split(",")) if window else None
    d.pop("mask", None)
    return cls(case=Case.from_dict(case), **d)


def apply_speedups(results: list[Result], baseline: str) -> None:
  base = {r.key: r.median_ms for r in results if r.backend == baseline and r.status == "ok"}
  for r in results:
    b = base.get(r.key)
    r.speedup = (b / r.median_ms) if (b and r.status == "ok" and r.median_ms) else None
