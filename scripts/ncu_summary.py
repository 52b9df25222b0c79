"""A few lines per kernel from an Nsight Compute report printed with `ncu --csv --page details` (gpu_check.sh ncu):
time, instructions, registers, shared memory, grid, local-memory spill requests, cache hit rates, throughputs, and
the largest warp stall reasons where the report has ncu's per-issue stall ratios
(`--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"`).

    python scripts/ncu_summary.py REPORT.csv [--skip NAME_PART]...
"""

from __future__ import annotations

import argparse
import csv
import sys

# (label, ncu's metric name), in the order printed.
FIGURES = (("time", "Duration"), ("instructions", "Executed Instructions"), ("registers", "Registers Per Thread"),
           ("smem/block", "Dynamic Shared Memory Per Block"), ("grid", "Grid Size"), ("block", "Block Size"),
           ("spill requests", "Local Memory Spilling Requests"), ("L1 hit", "L1/TEX Hit Rate"),
           ("L2 hit", "L2 Hit Rate"), ("SM", "Compute (SM) Throughput"), ("DRAM", "DRAM Throughput"),
           ("cycles/issue", "Warp Cycles Per Issued Instruction"))
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def read_kernels(path: str) -> list[tuple[str, dict[str, tuple[str, str]]]]:
  """[(kernel name, {metric: (value, unit)})] in the report's order; lines before the header (the profiler's own, the
  program's output) and rows without a value (the rules' advice) are skipped."""
  with open(path, newline="", errors="replace") as f:
    rows = list(csv.reader(f))
  try:
    at = next(i for i, r in enumerate(rows) if "Metric Name" in r and "Kernel Name" in r)
  except StopIteration:
    raise SystemExit(f"{path}: no `ncu --csv --page details` header (ID, Kernel Name, ..., Metric Name)") from None
  header = rows[at]
  col = {name: header.index(name) for name in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}
  kernels: dict[str, tuple[str, dict]] = {}
  for r in rows[at + 1:]:
    if len(r) <= col["Metric Value"] or not r[col["Metric Name"]]:
      continue
    _, metrics = kernels.setdefault(r[col["ID"]], (r[col["Kernel Name"]], {}))
    metrics[r[col["Metric Name"]]] = (r[col["Metric Value"]], r[col["Metric Unit"]])
  return list(kernels.values())


def _number(text: str) -> float | None:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def _figure(value: str, unit: str) -> str:
  number = _number(value)
  if unit == "ns" and number is not None:
    return f"{number / 1000:.1f} us"
  if unit == "%":
    return f"{value}%"
  return value if unit in ("", "inst", "register/thread", "byte/block") else f"{value} {unit}"


def summary(name: str, metrics: dict[str, tuple[str, str]], stalls: int = 5) -> list[str]:
  lines = [name[:100], "  " + "; ".join(f"{label} {_figure(*metrics[key])}" for label, key in FIGURES
                                         if key in metrics)]
  ratios = sorted(((_number(v), k[len(STALL_PREFIX):-len(STALL_SUFFIX)]) for k, (v, _) in metrics.items()
                   if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX) and _number(v) is not None),
                  reverse=True)
  if ratios:
    lines.append("  stalls per issue: " + ", ".join(f"{reason} {value:.2f}" for value, reason in ratios[:stalls]))
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("report")
  parser.add_argument("--skip", action="append", default=[], help="leave out kernels whose name holds this")
  args = parser.parse_args(argv)
  for name, metrics in read_kernels(args.report):
    if not any(part in name for part in args.skip):
      print("\n".join(summary(name, metrics)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
