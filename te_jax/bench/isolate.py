"""--isolate: one child process per backend (python -m te_jax.bench.worker), so a crash, a hang or an out-of-memory in
one backend loses only that backend's in-flight measurement. A child that dies is restarted after the item it died
on. Backends run in the order given (most important first); under a time budget each may run until the deadline
less a reserve for every backend still to come, so the first ones finish and the last ones are cut if time runs out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

from te_jax.bench.availability import Availability
from te_jax.bench.cases import Case
from te_jax.bench.flops import attention_flops
from te_jax.bench.registry import Backend
from te_jax.bench.results import Result

KILL_GRACE_S = 45.0  # past its share of the budget a child may finish the item it is on for this long
RESERVE_S = 30.0  # budget kept back for each backend still to run (less when the budget is small)


def _describe_exit(code: int) -> str:
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit status {code}"


def _stderr_tail(path: str, lines: int = 3) -> str:
  try:
    with open(path, errors="replace") as f:
      text = [l.strip() for l in f.read().splitlines() if l.strip()]
  except OSError:
    return ""
  return " | ".join(text[-lines:])[-400:]


def _child_env() -> dict:
  """The child imports the same te_jax as this process (an in-tree checkout or an installed one)."""
  import te_jax
  root = os.path.dirname(os.path.dirname(os.path.abspath(te_jax.__file__)))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  return env


class _Child:

  def __init__(self, spec: dict, workdir: str, tag: str):
    self.spec_path = os.path.join(workdir, f"{tag}.spec.json")
    self.out_path = os.path.join(workdir, f"{tag}.out.jsonl")
    self.err_path = os.path.join(workdir, f"{tag}.err.txt")
    with open(self.spec_path, "w") as f:
      json.dump(spec, f)
    open(self.out_path, "w").close()
    self._err = open(self.err_path, "w")
    self.proc = subprocess.Popen([sys.executable, "-m", "te_jax.bench.worker", self.spec_path, self.out_path],
                                 stdout=self._err, stderr=subprocess.STDOUT, start_new_session=True, env=_child_env())
    self._offset = 0
    self._partial = ""

  def read(self) -> list[dict]:
    with open(self.out_path) as f:
      f.seek(self._offset)
      chunk = f.read()
      self._offset = f.tell()
    text = self._partial + chunk
    lines = text.split("\n")
    self._partial = lines.pop()
    return [json.loads(l) for l in lines if l.strip()]

  def kill(self) -> None:
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self.proc.wait()

  def close(self) -> None:
    self._err.close()


def run_isolated(items: list[tuple[Case, str]], backends: list[Backend], platform: str, *, keep_going: bool,
                 deadline: float | None, check_errors: bool, seed: int, plan: dict | None,
                 on_availability: Callable[[Availability], None] | None = None,
                 on_start: Callable | None = None, on_result: Callable[[Result], None] | None = None,
                 probe_only: bool = False) -> tuple[list[Result], dict[str, Availability]]:
  results: list[Result] = []
  availability: dict[str, Availability] = {}
  budget_s = None if deadline is None else max(0.0, deadline - time.time())
  # Missing packages and platforms a backend does not declare are known without starting a process.
  missing = {b.name: b.not_installed() or b.declared_platform_reason(platform) for b in backends}
  with tempfile.TemporaryDirectory(prefix="te_jax_bench_") as workdir:
    for b_index, backend in enumerate(backends):
      reason = missing[backend.name]
      if reason:
        availability[backend.name] = Availability(backend.name, False, reason)
        if on_availability:
          on_availability(availability[backend.name])
        continue
      pending = list(enumerate(items))
      share_deadline = None
      if deadline is not None:
        installed = sum(1 for b in backends if not missing[b.name])
        after = sum(1 for b in backends[b_index + 1:] if not missing[b.name])
        reserve = min(RESERVE_S, budget_s / (2 * max(1, installed)))
        share_deadline = deadline - reserve * after
      avail_dict, attempt = None, 0
      while True:
        spec = dict(backend=backend.name, platform=platform, keep_going=keep_going, deadline=share_deadline,
                    check_errors=check_errors, seed=seed, plan=plan, availability=avail_dict,
                    need_backward=probe_only or any(m != "fwd" for _, m in items),
                    items=[] if probe_only else [(i, [c.to_dict(), m]) for i, (c, m) in pending])
        child = _Child(spec, workdir, f"{backend.name}.{attempt}")
        attempt += 1
        in_flight, stop = None, False
        while True:
          finished = child.proc.poll() is not None
          for record in child.read():
            if record["type"] == "availability":
              record.pop("type")
              record["modes"] = tuple(record["modes"])
              availability[backend.name] = Availability(**record)
              avail_dict = record
              if on_availability:
                on_availability(availability[backend.name])
            elif record["type"] == "start":
              in_flight = record["index"]
              if on_start:
                case, mode = items[in_flight]
                on_start(backend.name, case, mode)
            elif record["type"] == "result":
              result = Result.from_dict(record["result"])
              results.append(result)
              pending = [(i, cm) for i, cm in pending if i != record["index"]]
              in_flight = None
              if on_result:
                on_result(result)
              if result.status == "failed" and not keep_going:
                stop = True
          if finished:
            break
          if share_deadline is not None and time.time() > share_deadline + KILL_GRACE_S:
            child.kill()
            break
          time.sleep(0.1)
        code = child.proc.wait()
        child.close()
        if backend.name not in availability:
          availability[backend.name] = Availability(
              backend.name, False, f"probe process died ({_describe_exit(code)}): {_stderr_tail(child.err_path)}")
          if on_availability:
            on_availability(availability[backend.name])
          break
        if stop or not pending or not availability[backend.name].available:
          break
        # The child died or was killed: the in-flight item (or, if none had started, the next one) gets the blame.
        over_budget = share_deadline is not None and time.time() > share_deadline + KILL_GRACE_S
        blame = in_flight if in_flight is not None else pending[0][0]
        case, mode = items[blame]
        if over_budget:
          for i, (c, m) in pending:
            r = Result(case=c, mode=m, backend=backend.name, status="skipped", flops=attention_flops(c, m),
                       reason="time budget (--budget) spent" + (
                           f"; killed while running ({_describe_exit(code)})" if i == blame else ""))
            results.append(r)
            if on_result:
              on_result(r)
          break
        r = Result(case=case, mode=mode, backend=backend.name, status="failed", flops=attention_flops(case, mode),
                   reason=f"process died ({_describe_exit(code)}): {_stderr_tail(child.err_path)}")
        results.append(r)
        if on_result:
          on_result(r)
        if not keep_going:
          break
        pending = [(i, cm) for i, cm in pending if i != blame]
        if not pending:
          break
      if stop:
        break
  return results, availability
