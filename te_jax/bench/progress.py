"""Progress: a rich progress bar on a terminal; elsewhere (a log, a CI job) one plain line per result, so a captured
run still shows where it is. Either way each result is also reported as it lands."""

from __future__ import annotations

import sys
import time

from te_jax.bench.cases import short_dtype
from te_jax.bench.results import Result


def result_line(r: Result, unit: str, factor: float) -> str:
  c = r.case
  what = f"{c.label + ' ' if c.label else ''}{c.shape_label} {c.mask_label} {short_dtype(c.dtype)} {r.mode:<7} " \
         f"{r.backend:<16}"
  if r.status == "ok":
    rate = f" {r.tflops * factor:8.1f} {unit}" if r.tflops is not None else ""  # a data-movement row has none
    err = f" rel err {r.rel_err:.1e}" if r.rel_err is not None else ""
    return f"{what} {r.median_ms:9.3f} ms{rate}{err}"
  return f"{what} {r.status}: {r.reason[:140]}"


class Progress:

  def __init__(self, total: int, unit: str, factor: float, quiet: bool = False, show_unsupported: bool = False):
    self.total, self.done, self.unit, self.factor = total, 0, unit, factor
    self.quiet, self.show_unsupported = quiet, show_unsupported
    self.t0 = time.time()
    self._bar = None
    self.console = None
    if sys.stdout.isatty() and not quiet:
      try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn, \
            TimeElapsedColumn
        self.console = Console()
        self._bar = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console, transient=True)
        self._task = self._bar.add_task("benchmark", total=total)
      except ImportError:
        self._bar = None

  def __enter__(self):
    if self._bar is not None:
      self._bar.__enter__()
    return self

  def __exit__(self, *exc):
    if self._bar is not None:
      self._bar.__exit__(*exc)

  def set_total(self, total: int) -> None:
    self.total = total
    if self._bar is not None:
      self._bar.update(self._task, total=total)

  def start(self, backend: str, case, mode: str) -> None:
    if self._bar is not None:
      self._bar.update(self._task, description=f"{backend} {case.shape_label} {case.mask_label} {mode}")

  def result(self, r: Result) -> None:
    self.done += 1
    if self._bar is not None:
      self._bar.update(self._task, completed=self.done)
    if self.quiet or (r.status == "unsupported" and not self.show_unsupported):
      return
    line = f"[{self.done}/{self.total} {time.time() - self.t0:5.0f}s] " + result_line(r, self.unit, self.factor)
    if self._bar is not None:
      from rich.markup import escape
      self._bar.console.print(escape(line), highlight=False, soft_wrap=True)
    else:
      print(line, flush=True)

  def log(self, text: str) -> None:
    if self._bar is not None:
      from rich.markup import escape
      self._bar.console.print(escape(text), highlight=False, soft_wrap=True)
    else:
      print(text, flush=True)
