"""The terminal table (rich if installed, plain text otherwise): one section per (case, mode), one row per backend."""

from __future__ import annotations

import itertools

from te_jax.bench.availability import Availability
from te_jax.bench.cases import short_dtype
from te_jax.bench.results import Result


def throughput_unit(platform: str) -> tuple[str, float]:
  """The unit and the factor from TFLOP/s: GFLOP/s on the CPU, TFLOP/s elsewhere."""
  return ("GFLOP/s", 1e3) if platform == "cpu" else ("TFLOP/s", 1.0)


def _fmt(x, spec: str, empty: str = "") -> str:
  return empty if x is None else format(x, spec)


def rows(results: list[Result], platform: str, baseline: str, hide_unsupported: bool = False) -> list[list]:
  """[(group title, [(cells, style)])] with the fastest backend of each group marked."""
  unit, factor = throughput_unit(platform)
  groups = []
  for (case, mode), group in itertools.groupby(results, key=lambda r: r.key):
    group = list(group)
    ok = [r for r in group if r.status == "ok"]
    best = min(ok, key=lambda r: r.median_ms) if ok else None
    title = f"{case.label + ' ' if case.label else ''}{case.shape_label} {case.mask_label} {short_dtype(case.dtype)}"
    lines = []
    for r in group:
      if hide_unsupported and r.status == "unsupported":
        continue
      name = r.backend + (" (base)" if r.backend == baseline else "")
      if r.status == "ok":
        time = f"{r.median_ms:.3f} ±{100 * (r.spread or 0):.0f}%"
        cells = [name, time, _fmt(r.tflops and r.tflops * factor, ".1f"), _fmt(r.speedup, ".2f") + ("x" if r.speedup
                 else ""), _fmt(r.max_err, ".1e"), _fmt(r.rel_err, ".1e"), _fmt(r.memory_mib, ".0f" if (r.memory_mib or 0) >= 10 else ".2f"), r.reason]
        style = "bold green" if r is best and len(ok) > 1 else ("yellow" if r.err_ok is False else "")
      else:
        cells = [name, r.status, "", "", "", "", "", r.reason]
        style = {"failed": "red", "skipped": "yellow"}.get(r.status, "dim")
      lines.append((cells, style))
    groups.append(((title, mode), lines))
  return groups


HEADERS = ["case", "mode", "backend", "median ms", "{unit}", "speedup", "max err", "rel err", "mem MiB", "note"]


def print_table(results: list[Result], platform: str, baseline: str, device: str, console=None,
                hide_unsupported: bool = False) -> None:
  unit, _ = throughput_unit(platform)
  headers = [h.format(unit=unit) for h in HEADERS]
  groups = rows(results, platform, baseline, hide_unsupported)
  try:
    from rich.console import Console
    from rich.table import Table
  except ImportError:
    _print_plain(groups, headers, device)
    return
  if console is None:
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
      console = Console(width=170)
  table = Table(title=f"te_jax attention benchmark on {device} (speedup over {baseline}; errors vs float64 reference "
                      f"at a small size; mem = peak of one call)", title_justify="left", show_lines=False)
  for h in headers:
    table.add_column(h, justify="left" if h in ("case", "mode", "backend", "note") else "right",
                     overflow="fold", no_wrap=h != "note", max_width=60 if h == "note" else None)
  for (title, mode), lines in groups:
    for i, (cells, style) in enumerate(lines):
      table.add_row(title if i == 0 else "", mode if i == 0 else "", *cells, style=style or None,
                    end_section=i == len(lines) - 1)
  console.print(table)


def _print_plain(groups, headers, device) -> None:
  print(f"te_jax attention benchmark on {device}")
  widths = [22, 16, 10, 8, 8, 8, 8, 0]
  print("  ".join(h.rjust(w) if w else h for h, w in zip(headers[2:], widths)))
  for (title, mode), lines in groups:
    print(f"{title} {mode}")
    for cells, _ in lines:
      print("  ".join(str(c).rjust(w) if w else str(c) for c, w in zip(cells, widths)))


def print_availability(availability: dict[str, Availability], backends, platform: str, console=None,
                       capabilities: bool = False) -> None:
  """xformers.info-style: one line per backend, available or unavailable with the reason."""
  lines = []
  for backend in backends:
    a = availability.get(backend.name)
    if a is None:
      continue
    state = "available" if a.available else "unavailable"
    note = a.reason
    if a.available and a.modes and set(a.modes) != set(backend.caps.modes):
      note = (note + "; " if note else "") + f"modes: {','.join(a.modes)}"
    lines.append((backend.name, state, note, backend.caps.describe(), backend.url))
  width = max((len(l[0]) for l in lines), default=10)
  try:
    from rich.console import Console
    from rich.markup import escape
    console = console or Console()
    for name, state, note, caps, url in lines:
      color = "green" if state == "available" else "red"
      console.print(f"{name:<{width}}  [{color}]{state:<11}[/{color}]  {escape(note)}", highlight=False,
                    soft_wrap=True)
      if capabilities:
        console.print(f"{'':<{width}}  [dim]{escape(url)} | {escape(caps)}[/dim]", highlight=False, soft_wrap=True)
  except ImportError:
    for name, state, note, caps, url in lines:
      print(f"{name:<{width}}  {state:<11}  {note}")
      if capabilities:
        print(f"{'':<{width}}  {url} | {caps}")
