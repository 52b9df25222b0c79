"""The terminal table (rich if installed, plain text otherwise): one section per (case, mode), one row per backend."""

from __future__ import annotations

import itertools

from te_jax.bench.availability import Availability
from te_jax.bench.cases import short_dtype
from te_jax.bench.results import Result


def throughput_unit(platform: str) -> tuple[str, float]:
  """The unit and the factor from TFLOP/s: GFLOP/s on the CPU, TFLOP/s elsewhere."""
  return ("GFLOP/s", 1e3) if platform == "cpu" else ("TFLOP/s", 1.0)


def bandwidth_unit(platform: str) -> tuple[str, float]:
  """The unit and the factor from TB/s: GB/s on the CPU, TB/s elsewhere."""
  return ("GB/s", 1e3) if platform == "cpu" else ("TB/s", 1.0)


def _fmt(x, spec: str, empty: str = "") -> str:
  return empty if x is None else format(x, spec)


# Each section's columns after the case and the mode; the optional ones are left out when no row has a value (errors
# with --no-check, memory where the backend cannot report it, bandwidth without a forward), so the table never shows a
# column it does not fill.
COLUMNS = ["backend", "median ms", "{unit}", "{bandwidth}", "tok/s", "speedup", "max err", "rel err", "mem MiB", "note"]
OPTIONAL = {"{bandwidth}", "tok/s", "max err", "rel err", "mem MiB", "note"}
PLAIN_WIDTHS = {"backend": 22, "median ms": 16, "{unit}": 10, "{bandwidth}": 9, "tok/s": 9, "speedup": 8,
                "max err": 8, "rel err": 8, "mem MiB": 8, "note": 0}


def _cells(r: Result, baseline: str, factor: float, bandwidth_factor: float) -> list[str]:
  name = r.backend + (" (base)" if r.backend == baseline else "")
  if r.status != "ok":
    return [name, r.status, "", "", "", "", "", "", "", r.reason]
  memory = _fmt(r.memory_mib, ".0f" if (r.memory_mib or 0) >= 10 else ".2f")
  return [name, f"{r.median_ms:.3f} ±{100 * (r.spread or 0):.0f}%", _fmt(r.tflops and r.tflops * factor, ".1f"),
          _fmt(r.tbps and r.tbps * bandwidth_factor, ".2f"), _fmt(r.tokens_per_s, ".4g"),
          _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
          _fmt(r.max_err, ".1e"), _fmt(r.rel_err, ".1e"), memory, r.reason]


def _style(r: Result, best: Result | None, contenders: int) -> str:
  if r.status == "ok":
    return "bold green" if r is best and contenders > 1 else ("yellow" if r.err_ok is False else "")
  return {"failed": "red", "skipped": "yellow"}.get(r.status, "dim")


def rows(results: list[Result], platform: str, baseline: str, hide_unsupported: bool = False) -> list[list]:
  """[((case title, mode), [(cells, style)])], cells in COLUMNS order, with the fastest backend of each group marked."""
  _, factor = throughput_unit(platform)
  _, bandwidth_factor = bandwidth_unit(platform)
  groups = []
  for (case, mode), group in itertools.groupby(results, key=lambda r: r.key):
    group = [r for r in group if not (hide_unsupported and r.status == "unsupported")]
    ok = [r for r in group if r.status == "ok" and r.flops is not None]  # a data-movement row is no contender
    best = min(ok, key=lambda r: r.median_ms) if ok else None
    title = f"{case.label + ' ' if case.label else ''}{case.shape_label} {case.mask_label} {short_dtype(case.dtype)}"
    lines = [(_cells(r, baseline, factor, bandwidth_factor), _style(r, best, len(ok))) for r in group]
    groups.append(((title, mode), lines))
  return groups


def shown_columns(groups) -> list[int]:
  """Indices into COLUMNS of the columns to print: every required one, and each optional one some row fills."""
  filled = lambda i: any(cells[i] for _, lines in groups for cells, _ in lines)
  return [i for i, name in enumerate(COLUMNS) if name not in OPTIONAL or filled(i)]


def _title(device: str, baseline: str, columns: list[str]) -> str:
  notes = [f"speedup over {baseline}"]
  if "max err" in columns:
    notes.append("errors vs float64 reference at a small size")
  if "{bandwidth}" in columns:
    notes.append("bandwidth = K/V bytes read / time")
  if "tok/s" in columns:
    notes.append("tok/s = a decode step's batch x queries / time")
  if "mem MiB" in columns:
    notes.append("mem = peak of one call")
  return f"te_jax attention benchmark on {device} ({'; '.join(notes)})"


def print_table(results: list[Result], platform: str, baseline: str, device: str, console=None,
                hide_unsupported: bool = False) -> None:
  unit, _ = throughput_unit(platform)
  groups = rows(results, platform, baseline, hide_unsupported)
  keep = shown_columns(groups)
  columns = [COLUMNS[i] for i in keep]
  groups = [(key, [([cells[i] for i in keep], style) for cells, style in lines]) for key, lines in groups]
  headers = ["case", "mode"] + [c.format(unit=unit, bandwidth=bandwidth_unit(platform)[0]) for c in columns]
  try:
    from rich.console import Console
    from rich.table import Table
  except ImportError:
    _print_plain(groups, headers[2:], [PLAIN_WIDTHS[c] for c in columns], _title(device, baseline, columns))
    return
  if console is None:
    console = Console()
    if not console.is_terminal:  # a log or a pipe: do not squeeze the table into 80 columns
      console = Console(width=170)
  table = Table(title=_title(device, baseline, columns), title_justify="left", show_lines=False)
  for h in headers:
    table.add_column(h, justify="left" if h in ("case", "mode", "backend", "note") else "right",
                     overflow="fold", no_wrap=h != "note", max_width=60 if h == "note" else None)
  for (title, mode), lines in groups:
    for i, (cells, style) in enumerate(lines):
      table.add_row(title if i == 0 else "", mode if i == 0 else "", *cells, style=style or None,
                    end_section=i == len(lines) - 1)
  console.print(table)


def _print_plain(groups, headers, widths, title) -> None:
  print(title)
  print("  ".join(h.rjust(w) if w else h for h, w in zip(headers, widths)))
  for (case, mode), lines in groups:
    print(f"{case} {mode}")
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
