"""A short real run of `python -m te_jax.bench` on the CPU: the table, the CSV/JSON/PNG files (written and parseable),
--list-backends, --isolate surviving a backend process that dies, and an interrupted run: its files written, its
--isolate worker gone."""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from te_jax.bench import files
from te_jax.bench.__main__ import main

TINY = ["--seq", "64,128", "--batch", "1", "--heads", "2", "--head-dim", "32", "--samples", "2", "--sample-ms", "2"]


def test_short_real_run_writes_table_csv_json_and_plot(tmp_path, capsys):
  csv_path, json_path, png_path, md_path = (tmp_path / f"r.{ext}" for ext in ("csv", "json", "png", "md"))
  rc = main(TINY + ["--backends", "te_jax-ffi,jax-xla,jax-cudnn", "--mode", "fwd,fwd+bwd", "--causal",
                    "--csv", str(csv_path), "--json", str(json_path), "--plot", str(png_path), "--markdown", str(md_path),
                    "--keep-going"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "te_jax-ffi" in out and "jax-xla (base)" in out and "GFLOP/s" in out
  assert "jax-cudnn" in out and "runs on gpu only" in out  # unavailable, with the reason

  rows = files.read_csv(str(csv_path))
  # 2 seqs x 2 modes x 2 available backends (cuDNN is unavailable on the CPU, so not measured).
  assert len(rows) == 8
  assert {r["backend"] for r in rows} == {"te_jax-ffi", "jax-xla"}
  assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
  for r in rows:
    assert float(r["median_ms"]) > 0 and float(r["tflops"]) > 0 and float(r["rel_err"]) < 1e-4
    assert r["err_ok"] == "True" and float(r["memory_mib"]) > 0
    assert r["causal"] == "True" and r["mask"] == "causal"
    flops = 4 * 1 * 2 * int(r["seq_q"]) ** 2 * 32 * 0.5 * \
        {"fwd": 1.0, "fwd+bwd": 3.5}[r["mode"]]
    assert float(r["flops"]) == flops
    if r["backend"] == "jax-xla":
      assert float(r["speedup"]) == 1.0
    else:
      assert float(r["speedup"]) > 0

  data = json.loads(json_path.read_text())
  assert data["metadata"]["baseline"] == "jax-xla" and data["metadata"]["platform"] == "cpu"
  assert data["availability"]["te_jax-ffi"]["available"] is True
  assert data["availability"]["jax-cudnn"]["available"] is False
  assert len(data["results"]) == 8

  png = png_path.read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image
  height, width = matplotlib.image.imread(str(png_path)).shape[:2]
  assert width > 600 and height > 400

  md = md_path.read_text().splitlines()
  header = next(l for l in md if l.startswith("| case"))
  assert header.split("|")[3:5] == [" te_jax-ffi ", " jax-xla (baseline) "]
  body = [l for l in md if l.startswith("| b1 ")]
  assert len(body) == 4 and all("(1.00x)" in l.split("|")[4] for l in body)

  # The saved JSON re-renders without measuring anything.
  assert main(["--from-json", str(json_path), "--csv", str(tmp_path / "again.csv")]) == 0
  assert files.read_csv(str(tmp_path / "again.csv")) == rows


def test_list_backends(capsys):
  assert main(["--list-backends", "--backends", "te_jax-ffi,pallas,torch,flash-attn-jax"]) == 0
  out = capsys.readouterr().out
  lines = {l.split()[0]: l for l in out.splitlines() if l and not l.startswith(" ") and ":" not in l.split()[0]}
  assert "available" in lines["te_jax-ffi"].split()
  assert "unavailable" in lines["pallas"] and "gpu only" in lines["pallas"]
  assert "unavailable" in lines["flash-attn-jax"] and "not installed" in lines["flash-attn-jax"]
  assert "unavailable" in lines["torch-cudnn"]  # GPU-only, or torch not installed


def test_unknown_backend_is_explained():
  with pytest.raises(SystemExit, match="no backend named"):
    main(TINY + ["--backends", "no-such-backend"])


def test_isolate_survives_a_crashing_backend(tmp_path):
  import te_jax
  root = os.path.dirname(os.path.dirname(os.path.abspath(te_jax.__file__)))  # the te_jax this test imported
  env = dict(os.environ, TE_JAX_BENCH_CRASH_ON="te_jax-ffi:64",
             PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  csv_path = tmp_path / "iso.csv"
  cmd = [sys.executable, "-m", "te_jax.bench", "--seq", "64,128", "--batch", "1", "--heads", "2", "--head-dim",
         "32", "--samples", "2", "--sample-ms", "2", "--mode", "fwd", "--backends", "te_jax-ffi,jax-xla", "--isolate",
         "--keep-going", "--no-check", "--csv", str(csv_path)]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = {(r["backend"], int(r["seq_q"])): r for r in files.read_csv(str(csv_path))}
  assert len(rows) == 4
  crashed = rows[("te_jax-ffi", 64)]
  assert crashed["status"] == "failed" and "process died" in crashed["reason"] and "SIGSEGV" in crashed["reason"]
  assert rows[("te_jax-ffi", 128)]["status"] == "ok"  # the worker was restarted after the crash
  assert all(rows[("jax-xla", s)]["status"] == "ok" for s in (64, 128))
  assert float(rows[("jax-xla", 128)]["speedup"]) == 1.0


def test_interrupted_sweep_writes_what_it_measured(tmp_path, monkeypatch, capsys):
  """Ctrl-C in the middle of a sweep: the table, CSV, JSON and plot of the results so far, and exit status 130."""
  from te_jax.bench.runner import Runner
  measure, calls = Runner.measure, []

  def interrupt_third(self, *args):
    calls.append(args)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return measure(self, *args)

  monkeypatch.setattr(Runner, "measure", interrupt_third)
  paths = {ext: tmp_path / f"r.{ext}" for ext in ("csv", "json", "png")}
  rc = main(TINY + ["--backends", "te_jax-ffi,jax-xla", "--mode", "fwd", "--csv", str(paths["csv"]), "--json",
                    str(paths["json"]), "--plot", str(paths["png"])])
  captured = capsys.readouterr()
  assert rc == 130
  assert "interrupted by SIGINT after 2 results" in captured.err
  rows = files.read_csv(str(paths["csv"]))
  assert [(r["backend"], r["seq_q"], r["status"]) for r in rows] == [("te_jax-ffi", "64", "ok"), ("jax-xla", "64", "ok")]
  assert float(rows[1]["speedup"]) == 1.0  # the speedups were applied before the files were written
  assert len(json.loads(paths["json"].read_text())["results"]) == 2
  assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "te_jax-ffi" in captured.out and "jax-xla (base)" in captured.out  # the table of what was measured
  assert not list(tmp_path.glob("*.tmp*"))


def _worker_of(parent: int) -> int | None:
  """The pid of the --isolate worker that `parent` started, if it has one."""
  for stat in glob.glob("/proc/[0-9]*/stat"):
    try:
      with open(stat) as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(stat.replace("stat", "cmdline"), "rb") as f:
        cmdline = f.read()
    except (OSError, IndexError, ValueError):
      continue
    if ppid == parent and b"te_jax.bench.worker" in cmdline:
      return int(stat.split("/")[2])
  return None


def _running(pid: int) -> bool:
  """Alive and not a zombie (a killed process whose new parent has not reaped it yet has ended all the same)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


@contextlib.contextmanager
def _sigint_not_ignored():
  """A child inherits an ignored SIGINT, and Python then raises no KeyboardInterrupt in it: while the block starts
  one, SIGINT is handled here (a handled signal reverts to the default in a new program)."""
  previous = signal.getsignal(signal.SIGINT)
  if previous == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    yield
  finally:
    if previous == signal.SIG_IGN:
      signal.signal(signal.SIGINT, previous)


def _wait_for(condition, timeout_s: float, what: str):
  deadline = time.time() + timeout_s
  while time.time() < deadline:
    value = condition()
    if value:
      return value
    time.sleep(0.1)
  raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_isolated_worker_dies_with_an_interrupted_parent(signum, tmp_path):
  """A signal to the bench process mid-measurement ends its worker too: SIGINT and SIGTERM through the parent (which
  then writes what it measured), SIGKILL through the worker's parent-death signal."""
  import te_jax
  root = os.path.dirname(os.path.dirname(os.path.abspath(te_jax.__file__)))
  env = dict(os.environ,
             PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  paths = {ext: tmp_path / f"r.{ext}" for ext in ("csv", "json", "png")}
  # The second item (s = 65536) takes most of a minute on a CPU: the worker is busy with it when the signal comes.
  cmd = [sys.executable, "-m", "te_jax.bench", "--isolate", "--backends", "te_jax-ffi", "--baseline", "te_jax-ffi",
         "--seq", "64,65536", "--batch", "1", "--heads", "2", "--head-dim", "32", "--mode", "fwd", "--samples", "2",
         "--sample-ms", "2", "--no-check", "--csv", str(paths["csv"]), "--json", str(paths["json"]), "--plot",
         str(paths["png"])]
  with open(tmp_path / "out.txt", "w") as out, _sigint_not_ignored():
    parent = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
  worker = None
  try:
    _wait_for(lambda: paths["csv"].exists() and files.read_csv(str(paths["csv"])), 120, "the first result")
    worker = _wait_for(lambda: _worker_of(parent.pid), 10, "the worker process")
    parent.send_signal(signum)
    code = parent.wait(timeout=60)
    _wait_for(lambda: not _running(worker), 10, f"worker {worker} to end after {signum.name} to its parent")
  finally:
    for pid in (parent.pid, worker):
      if pid and _running(pid):
        os.kill(pid, signal.SIGKILL)
  output = (tmp_path / "out.txt").read_text()
  if signum == signal.SIGKILL:
    assert code == -signal.SIGKILL
    return
  assert code == 128 + signum, output[-3000:]
  assert f"interrupted by {signum.name} after 1 results" in output
  rows = files.read_csv(str(paths["csv"]))
  assert [(r["seq_q"], r["status"]) for r in rows] == [("64", "ok")]
  assert len(json.loads(paths["json"].read_text())["results"]) == 1
  assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tiny_decode_run_reports_bandwidth_and_passes_accuracy(tmp_path, monkeypatch, capsys):
  """The decode preset's path (an explicit case list, queries at the end of the keys, the paged backends) at a size
  the CPU runs in seconds."""
  from te_jax.bench.cases import Case
  from te_jax.bench.presets import PRESETS, CaseList
  decode = lambda label, seq_q, seq_kv: Case(batch=2, seq_q=seq_q, seq_kv=seq_kv, heads=4, kv_heads=2, head_dim=32,
                                             causal=True, bottom_right=True, label=label)
  tiny = CaseList([decode("decode", 1, 256), decode("decode", 1, 272), decode("16 queries", 16, 256)], modes=["fwd"])
  monkeypatch.setitem(PRESETS, "decode", lambda platform: tiny)
  csv_path, png_path = tmp_path / "d.csv", tmp_path / "d.png"
  rc = main(["--preset", "decode", "--backends", "te_jax-ffi,te_jax-paged16,te_jax-paged64,jax-xla", "--samples", "2",
             "--sample-ms", "2", "--csv", str(csv_path), "--plot", str(png_path)])
  out = capsys.readouterr().out
  assert rc == 0
  assert "GB/s" in out and "te_jax-paged16" in out  # the bandwidth column; the notes are checked in the CSV
  rows = {(r["backend"], int(r["seq_q"]), int(r["seq_kv"])): r for r in files.read_csv(str(csv_path))}
  assert len(rows) == 12
  assert rows[("te_jax-paged64", 1, 272)]["status"] == "unsupported"
  assert "not a multiple of the page size (64)" in rows[("te_jax-paged64", 1, 272)]["reason"]
  measured = [r for r in rows.values() if r["status"] != "unsupported"]
  assert len(measured) == 11 and all(r["status"] == "ok" and r["err_ok"] == "True" for r in measured)
  for r in measured:
    assert float(r["kv_bytes"]) == 2 * int(r["seq_kv"]) * 2 * 64 * 4
    assert float(r["tbps"]) == pytest.approx(float(r["kv_bytes"]) / float(r["median_ms"]) / 1e9)
  assert rows[("jax-xla", 16, 256)]["reason"] == "runs without a mask (it has no bottom-right causal mask)"
  assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_context_parallel_backends_scale_over_virtual_devices(tmp_path):
  """te_jax-cp-ring and te_jax-cp-all_gather on 4 of 8 virtual CPU devices (a subprocess: the device count is fixed at
  JAX's start): each shards the sequence, load-balanced, and its outputs and gradients, put back in natural order,
  match the float64 reference; its speedup over te_jax-ffi on one device is the scaling efficiency times 4; the
  ring's permutes alone (cp-ring-permutes) are timed beside it, forward; a case the layout cannot cut says why."""
  json_path = tmp_path / "cp.json"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", "te_jax.bench", "--backends", "te_jax-ffi,te_jax-cp,cp-ring-permutes",
                           "--baseline", "te_jax-ffi", "--cp-devices", "4", "--batch", "1", "--seq", "128,100",
                           "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--causal", "--mode", "fwd,fwd+bwd",
                           "--samples", "2", "--sample-ms", "2", "--keep-going", "--json", str(json_path)],
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  rows = json.load(open(json_path))["results"]
  one = {r["mode"]: r for r in rows if r["backend"] == "te_jax-ffi" and r["seq_q"] == 128}
  assert all(r["status"] == "ok" and r["median_ms"] > 0 for r in one.values()), one
  for backend in ("te_jax-cp-ring", "te_jax-cp-all_gather"):
    ran = [r for r in rows if r["backend"] == backend and r["seq_q"] == 128]
    assert {r["mode"] for r in ran} == {"fwd", "fwd+bwd"}
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-5 for r in ran), ran
    assert all(math.isclose(r["speedup"], one[r["mode"]]["median_ms"] / r["median_ms"], rel_tol=1e-9) for r in ran)
    cut = [r for r in rows if r["backend"] == backend and r["seq_q"] == 100]
    assert cut and all("multiple of 2 x 4 devices" in r["reason"] for r in cut), cut
  permutes = {(r["seq_q"], r["mode"]): r for r in rows if r["backend"] == "cp-ring-permutes"}
  alone = permutes[(128, "fwd")]
  assert alone["status"] == "ok" and math.isfinite(alone["median_ms"]) and alone["median_ms"] > 0, alone
  assert alone["flops"] is None and alone["rel_err"] is None  # communication: no FLOPs, no reference
  assert permutes[(128, "fwd+bwd")]["status"] == "unsupported"
  assert "multiple of 2 x 4 devices" in permutes[(100, "fwd")]["reason"]


_DIGEST = """
import sys
from te_jax.bench import kernel_root
if len(sys.argv) > 1:
  kernel_root.choose(sys.argv[1])
  kernel_root.apply()
from te_jax._cuda import ext
print("digest", ext.kernel_sources_digest())
"""


def _kernel_digest(*root) -> str:
  """The digest of the kernel sources te_jax's compiler reads (the disk cache's key), in a fresh process."""
  proc = subprocess.run([sys.executable, "-c", _DIGEST, *root], capture_output=True, text=True, timeout=120)
  return proc.stdout.split("digest ")[-1].strip() if proc.returncode == 0 else proc.stdout + proc.stderr


def test_kernel_root_compiles_another_trees_kernels(tmp_path, monkeypatch):
  """--kernel-root DIR: te_jax's kernel compiler reads DIR/cpp (its digest, which keys the disk cache, follows a
  changed header), the run says so and records it, an --isolate worker takes it too; a folder without a kernel tree
  is refused by name. Runs that take a tree run in other processes: the tree stays out of this one."""
  import shutil
  from te_jax.bench import kernel_root
  monkeypatch.delenv(kernel_root.ENV, raising=False)  # restored when the test ends, whatever the flag sets
  with pytest.raises(SystemExit, match="no cpp/cuda/kernels under it"):
    main(TINY + ["--kernel-root", str(tmp_path)])
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  same, changed = tmp_path / "same", tmp_path / "changed"
  for tree in (same, changed):
    shutil.copytree(os.path.join(repo, "cpp"), tree / "cpp")
  with open(changed / "cpp" / "core" / "mask_type.h", "a") as f:
    f.write("// a change\n")
  default = _kernel_digest()
  if "built without its CUDA backend" in _kernel_digest(str(same)):  # a CPU-only build refuses the flag by name
    with pytest.raises(SystemExit, match="te_jax was built without its CUDA backend"):
      main(TINY + ["--kernel-root", str(same)])
    return
  assert len(default) == 64 and _kernel_digest(str(same)) == default
  assert _kernel_digest(str(changed)) not in (default, "")

  import te_jax
  root = os.path.dirname(os.path.dirname(os.path.abspath(te_jax.__file__)))  # the te_jax this test imported
  env = dict(os.environ,
             PYTHONPATH=os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  json_path = tmp_path / "iso.json"
  proc = subprocess.run([sys.executable, "-m", "te_jax.bench", *TINY, "--backends", "jax-xla", "--mode", "fwd",
                         "--isolate", "--kernel-root", str(changed), "--json", str(json_path)], env=env,
                        capture_output=True, text=True, timeout=300, cwd=tmp_path)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert f"kernels from {changed}" in proc.stdout
  data = json.loads(json_path.read_text())
  assert data["metadata"]["kernel_root"] == str(changed)
  assert [r["status"] for r in data["results"]] == ["ok", "ok"]
