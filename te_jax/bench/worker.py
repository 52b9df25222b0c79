"""The --isolate child: one backend, a list of (case, mode) items, results streamed as JSON lines to a file so that the
parent keeps everything written before a crash. Run as `python -m te_jax.bench.worker SPEC.json OUT.jsonl`."""

from __future__ import annotations

import json
import os
import signal
import sys


def _emit(out, record: dict) -> None:
  out.write(json.dumps(record) + "\n")
  out.flush()
  os.fsync(out.fileno())


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  spec_path, out_path = argv
  with open(spec_path) as f:
    spec = json.load(f)
  from te_jax.bench.__main__ import configure_environment
  configure_environment()
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
