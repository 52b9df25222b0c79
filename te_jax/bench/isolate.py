"""--isolate: one child process per backend (python -m te_jax.bench.worker), so a crash, a hang or an out-of-memory in
one backend loses only that backend's in-flight measurement. A child that dies is restarted after the item it died
on. Backends run in the order given (most important first); under a time budget each may run until the deadline
less a reserve for every backend still to come, so the first ones finish and the last ones are cut if time runs out.
A worker never outlives this process: any exception here (Ctrl-C included) kills it, and the worker itself dies with
this process when that is killed outright (worker.die_with_parent)."""

from __future__ import annotations

import itertools
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

  def __enter__(self) -> "_Child":
    return self

  def __exit__(self, *exc) -> None:
    # Also on KeyboardInterrupt or any error in this process: the worker is in its own session, out of reach of the
    # terminal's Ctrl-C, so nothing else would end it.
    self.kill()
    self._err.close()


class _Sink:
  """What the workers report, kept and passed on to the caller's callbacks as it arrives."""

  def __init__(self, items: list[tuple[Case, str]], on_availability, on_start, on_result):
    self.items, self.on_availability, self.on_start, self.on_result = items, on_availability, on_start, on_result
    self.results: list[Result] = []
    self.availability: dict[str, Availability] = {}
    self.records: dict[str, dict] = {}  # a worker's availability record, so a restarted worker need not probe again

  def found(self, availability: Availability, record: dict | None = None) -> None:
    self.availability[availability.name] = availability
    if record is not None:
      self.records[availability.name] = record
    if self.on_availability:
      self.on_availability(availability)

  def started(self, backend: str, index: int) -> None:
    if self.on_start:
      self.on_start(backend, *self.items[index])

  def add(self, result: Result) -> Result:
    self.results.append(result)
    if self.on_result:
      self.on_result(result)
    return result


def _follow(child: _Child, backend: str, sink: _Sink, pending: dict, keep_going: bool,
            kill_at: float | None) -> tuple[int | None, bool]:
  """Passes on the worker's records until it exits, or kills it past kill_at. Returns the index of the item it was
  on when it ended (None between items) and whether a failure stops the sweep."""
  in_flight, stop = None, False
  while True:
    finished = child.proc.poll() is not None
    for record in child.read():
      kind = record.pop("type")
      if kind == "availability":
        record["modes"] = tuple(record["modes"])
        sink.found(Availability(**record), record)
      elif kind == "start":
        in_flight = record["index"]
        sink.started(backend, in_flight)
      elif kind == "result":
        result = sink.add(Result.from_dict(record["result"]))
        pending.pop(record["index"], None)
        in_flight = None
        stop |= result.status == "failed" and not keep_going
    if finished:
      return in_flight, stop
    if kill_at is not None and time.time() > kill_at:
      child.kill()
      return in_flight, stop
    time.sleep(0.1)


def _run_backend(backend: Backend, spec: dict, items: list[tuple[Case, str]], workdir: str, sink: _Sink,
                 keep_going: bool, share_deadline: float | None) -> bool:
  """Measures `items` with one backend in worker processes, a new one after each crash. Returns True when a failure
  stops the whole sweep."""
  pending = dict(enumerate(items))
  kill_at = None if share_deadline is None else share_deadline + KILL_GRACE_S
  for attempt in itertools.count():
    spec = dict(spec, availability=sink.records.get(backend.name),
                items=[(i, [c.to_dict(), m]) for i, (c, m) in pending.items()])
    with _Child(spec, workdir, f"{backend.name}.{attempt}") as child:
      in_flight, stop = _follow(child, backend.name, sink, pending, keep_going, kill_at)
      code = child.proc.wait()
    if backend.name not in sink.availability:
      sink.found(Availability(backend.name, False,
                              f"probe process died ({_describe_exit(code)}): {_stderr_tail(child.err_path)}"))
      return False
    if stop or not pending or not sink.availability[backend.name].available:
      return stop
    # The worker died or was killed: the in-flight item (or, if none had started, the next one) gets the blame.
    blame = in_flight if in_flight is not None else next(iter(pending))
    if kill_at is not None and time.time() > kill_at:
      for i, (case, mode) in pending.items():
        sink.add(Result(case=case, mode=mode, backend=backend.name, status="skipped", **backend.workload(case, mode),
                        reason="time budget (--budget) spent" + (
                            f"; killed while running ({_describe_exit(code)})" if i == blame else "")))
      return False
    case, mode = pending.pop(blame)
    sink.add(Result(case=case, mode=mode, backend=backend.name, status="failed", **backend.workload(case, mode),
                    reason=f"process died ({_describe_exit(code)}): {_stderr_tail(child.err_path)}"))
    if not keep_going or not pending:
      return False


def run_isolated(items: list[tuple[Case, str]], backends: list[Backend], platform: str, *, keep_going: bool,
                 deadline: float | None, check_errors: bool, seed: int, plan: dict | None,
                 on_availability: Callable[[Availability], None] | None = None,
                 on_start: Callable | None = None, on_result: Callable[[Result], None] | None = None,
                 probe_only: bool = False) -> tuple[list[Result], dict[str, Availability]]:
  sink = _Sink(items, on_availability, on_start, on_result)
  # Missing packages and platforms a backend does not declare are known without starting a process.
  missing = {b.name: b.not_installed() or b.declared_platform_reason(platform) for b in backends}
  installed = [b.name for b in backends if not missing[b.name]]
  need_backward = probe_only or any(m != "fwd" for _, m in items)
  if deadline is not None:
    reserve = min(RESERVE_S, max(0.0, deadline - time.time()) / (2 * max(1, len(installed))))
  with tempfile.TemporaryDirectory(prefix="te_jax_bench_") as workdir:
    for backend in backends:
      if missing[backend.name]:
        sink.found(Availability(backend.name, False, missing[backend.name]))
        continue
      share_deadline = None
      if deadline is not None:  # each may run until the deadline less a reserve for every backend still to come
        share_deadline = deadline - reserve * (len(installed) - 1 - installed.index(backend.name))
      spec = dict(backend=backend.name, platform=platform, keep_going=keep_going, deadline=share_deadline,
                  check_errors=check_errors, seed=seed, plan=plan, need_backward=need_backward, parent_pid=os.getpid())
      if _run_backend(backend, spec, [] if probe_only else items, workdir, sink, keep_going, share_deadline):
        break
  return sink.results, sink.availability
