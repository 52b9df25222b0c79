"""The --isolate child: one backend, a list of (case, mode) items, results streamed as JSON lines to a file so that the
parent keeps everything written before a crash. Run as `python -m te_jax.bench.worker SPEC.json OUT.jsonl`."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_POLL_S = 1.0


def die_with_parent(parent_pid: int) -> None:
  """Ends this process when the bench process that started it ends, however it ends (SIGKILL included, where it has
  no chance to kill its workers). On Linux the kernel sends SIGKILL when the parent dies (prctl PR_SET_PDEATHSIG: the
  thread that started this process, which in the bench is its main thread); elsewhere a thread polls the parent id."""
  if sys.platform.startswith("linux"):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
      raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
  else:
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
  if os.getppid() != parent_pid:  # the parent died before the death signal was armed
    os._exit(1)


def _exit_when_orphaned(parent_pid: int) -> None:
  while os.getppid() == parent_pid:
    time.sleep(PARENT_POLL_S)
  os._exit(1)


def _emit(out, record: dict) -> None:
  out.write(json.dumps(record) + "\n")
  out.flush()
  os.fsync(out.fileno())


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  spec_path, out_path = argv
  with open(spec_path) as f:
    spec = json.load(f)
  die_with_parent(spec["parent_pid"])
  from te_jax.bench import kernel_root
  from te_jax.bench.__main__ import configure_environment
  configure_environment()
  kernel_root.apply()
  from te_jax.bench import registry
  from te_jax.bench.availability import Availability, probe
  from te_jax.bench.cases import Case
  from te_jax.bench.runner import Options, Runner
  from te_jax.bench.timing import TimingPlan

  backend = registry.get(spec["backend"])
  platform = spec["platform"]
  with open(out_path, "a") as out:
    if spec.get("availability") is None:
      availability = probe(backend, platform, need_backward=spec.get("need_backward", True))
      _emit(out, {"type": "availability", **availability.to_dict()})
    else:
      availability = Availability(**spec["availability"])
    if not availability.available:
      return 0
    plan = TimingPlan(**spec["plan"]) if spec.get("plan") else None
    runner = Runner(Options(platform=platform, keep_going=spec["keep_going"], deadline=spec.get("deadline"),
                            check_errors=spec["check_errors"], seed=spec["seed"], plan=plan))
    crash_on = os.environ.get("TE_JAX_BENCH_CRASH_ON", "")  # test hook: "BACKEND:SEQ_Q" dies like a segfault
    for index, (case_dict, mode) in spec["items"]:
      _emit(out, {"type": "start", "index": index})
      if crash_on == f"{backend.name}:{case_dict['seq_q']}":
        os.kill(os.getpid(), signal.SIGSEGV)
      result = runner.measure(backend, availability, Case.from_dict(case_dict), mode)
      _emit(out, {"type": "result", "index": index, "result": result.to_dict()})
      if result.status == "failed" and not spec["keep_going"]:
        return 0
  return 0


if __name__ == "__main__":
  sys.exit(main())
