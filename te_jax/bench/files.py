"""--csv and --json output. CSV: one row per (case, mode, backend). JSON: the run's metadata, backend availability
and the same rows. Both are rewritten after every result, so an interrupted run leaves what it measured."""

from __future__ import annotations

import csv
import dataclasses
import json
import os

from te_jax.bench.results import Result


def _fields() -> list[str]:
  from te_jax.bench.cases import Case
  case = [f.name for f in dataclasses.fields(Case)]
  rest = [f.name for f in dataclasses.fields(Result) if f.name != "case"]
  return case + ["mask"] + rest


def _atomic_write(path: str, write) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    with open(tmp, "w", newline="") as f:
      write(f)
    os.replace(tmp, path)
  except BaseException:  # Ctrl-C mid-write included: the previous version of the file stays, with no stray temporary
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def write_csv(path: str, results: list[Result]) -> None:
  def write(f):
    writer = csv.DictWriter(f, fieldnames=_fields())
    writer.writeheader()
    for r in results:
      writer.writerow({k: ("" if v is None else v) for k, v in r.to_dict().items()})
  _atomic_write(path, write)


def markdown(results: list[Result], backends: list[str], baseline: str, unit: str, factor: float) -> str:
  """A pivot for docs: one row per (case, mode), one column per backend, cells "throughput (speedup)"; failures and
  unsupported cases are marked, with the reasons listed below the table."""
  from te_jax.bench.cases import short_dtype
  columns = [b for b in backends if any(r.backend == b for r in results)]
  rows: dict[tuple, dict[str, Result]] = {}
  for r in results:
    rows.setdefault(r.key, {})[r.backend] = r
  notes: dict[str, int] = {}
  lines = ["| case | mode | " + " | ".join(f"{b}{' (baseline)' if b == baseline else ''}" for b in columns) + " |",
           "|---|---|" + "---:|" * len(columns)]
  for (case, mode), by in rows.items():
    cells = []
    for b in columns:
      r = by.get(b)
      if r is None:
        cells.append("")
      elif r.status == "ok":
        best = max((x.tflops or 0) for x in by.values() if x.status == "ok")
        # A row that computes no attention has no FLOP rate: its time stands in the cell.
        rate = f"{r.median_ms:.3f} ms" if r.tflops is None else f"{r.tflops * factor:.1f}"
        text = rate + (f" ({r.speedup:.2f}x)" if r.speedup else "")
        if r.err_ok is False:
          text += " !"
        cells.append(f"**{text}**" if r.tflops == best else text)
      else:
        note = f"{r.status}: {r.reason}"
        index = notes.setdefault(note, len(notes) + 1)
        cells.append(f"{'n/a' if r.status == 'unsupported' else r.status} [{index}]")
    label = f"{case.label + ' ' if case.label else ''}{case.shape_label} {case.mask_label} {short_dtype(case.dtype)}"
    lines.append(f"| {label} | {mode} | " + " | ".join(cells) + " |")
  out = [f"{unit} (speedup over {baseline}); bold: fastest; !: outside the error tolerance.", ""] + lines
  if notes:
    out += ["", "Notes:", ""] + [f"{i}. {note.replace('|', '/')}" for note, i in notes.items()]
  return "\n".join(out) + "\n"


def write_markdown(path: str, results: list[Result], backends: list[str], baseline: str, unit: str,
                   factor: float) -> None:
  text = markdown(results, backends, baseline, unit, factor)
  _atomic_write(path, lambda f: f.write(text))


def read_csv(path: str) -> list[dict]:
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def write_json(path: str, results: list[Result], metadata: dict, availability: dict) -> None:
  def write(f):
    json.dump(dict(metadata=metadata, availability={k: v.to_dict() for k, v in availability.items()},
                   results=[r.to_dict() for r in results]), f, indent=1, default=str)
  _atomic_write(path, write)


def read_json_results(path: str) -> tuple[dict, list[Result]]:
  with open(path) as f:
    data = json.load(f)
  return data, [Result.from_dict(d) for d in data["results"]]
