"""scripts/ncu_summary.py reads `ncu --csv --page details` as Nsight Compute 2025 prints it (the profiler's lines and
the program's output before the header, rules' rows without a value, rows shorter than the header) into a few lines
per kernel: its figures in order, and its largest stall ratios."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type",'
          '"Rule Description","Estimated Speedup Type","Estimated Speedup"')


def _script():
  spec = importlib.util.spec_from_file_location("ncu_summary", ROOT / "scripts" / "ncu_summary.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _row(kernel_id, kernel, section, metric, unit, value):
  return (f'"{kernel_id}","1017","python3.12","127.0.0.1","{kernel}","1","14","(384, 1, 1)","(2048, 1, 1)","0",'
          f'"9.0","{section}","{metric}","{unit}","{value}",')


def test_summary_of_two_kernels(tmp_path, capsys):
  report = tmp_path / "report.csv"
  lines = ["==PROF== Connected to process 1017", "profiled te causal s 2048 fwd+bwd", HEADER,
           _row(0, "te_jax_attention_backward_dkdv_dq", "GPU Speed Of Light Throughput", "Duration", "ns", "789,856"),
           _row(0, "te_jax_attention_backward_dkdv_dq", "Command line profiler metrics",
                "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "inst", "1.53"),
           _row(0, "te_jax_attention_backward_dkdv_dq", "Command line profiler metrics",
                "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio", "inst", "1.68"),
           _row(0, "te_jax_attention_backward_dkdv_dq", "Command line profiler metrics",
                "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio", "inst", "0"),
           '"0","1017","python3.12","127.0.0.1","te_jax_attention_backward_dkdv_dq","1","14","(384, 1, 1)",'
           '"(2048, 1, 1)","0","9.0","SpeedOfLight","","","","SOLBottleneck","OPT","Memory is more heavily used"',
           _row(0, "te_jax_attention_backward_dkdv_dq", "Memory Workload Analysis", "Local Memory Spilling Requests",
                "", "620,750"),
           _row(0, "te_jax_attention_backward_dkdv_dq", "Launch Statistics", "Registers Per Thread",
                "register/thread", "168"),
           _row(0, "te_jax_attention_backward_dkdv_dq", "Memory Workload Analysis", "L2 Hit Rate", "%", "83.69"),
           _row(1, "te_jax_attention_backward_dq_convert", "GPU Speed Of Light Throughput", "Duration", "ns", "64,928"),
           _row(1, "te_jax_attention_backward_dq_convert", "Instruction Statistics", "Executed Instructions", "inst",
                "32,243,712")]
  report.write_text("\n".join(lines) + "\n")
  module = _script()
  kernels = module.read_kernels(str(report))
  assert [name for name, _ in kernels] == ["te_jax_attention_backward_dkdv_dq", "te_jax_attention_backward_dq_convert"]
  assert module.main([str(report), "--skip", "dq_convert"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out == ["te_jax_attention_backward_dkdv_dq",
                 "  time 789.9 us; registers 168; spill requests 620,750; L2 hit 83.69%",
                 "  stalls per issue: long_scoreboard 1.68, barrier 1.53, membar 0.00"]


def test_a_file_without_the_details_header_is_an_error(tmp_path):
  report = tmp_path / "report.csv"
  report.write_text("==PROF== Disconnected\n")
  with pytest.raises(SystemExit, match="no `ncu --csv --page details` header"):
    _script().main([str(report)])
