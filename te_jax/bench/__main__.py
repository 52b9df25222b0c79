"""python -m te_jax.bench (console script: te-jax-bench). See --help, and te_jax/bench/__init__.py for the layout."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import platform as host_platform
import signal
import sys
import threading
import time

EXAMPLES = """examples:
  python -m te_jax.bench                              quick sweep on whatever is here (about a minute on a CPU)
  python -m te_jax.bench --list-backends              which backends run here, and why not
  python -m te_jax.bench --preset fa --mode fwd,fwd+bwd --csv fa.csv --plot fa.png --keep-going --isolate
  python -m te_jax.bench --preset llama --backends te_jax-ffi,jax-cudnn,torch-flash
  python -m te_jax.bench --seq 4096 --heads 32 --kv-heads 8 --head-dim 128 --causal --window 1023,0 --mode fwd
  python -m te_jax.bench --preset decode --backends te_jax-te,te_jax-paged64,jax-cudnn,kv-read
      decoding against cuDNN, and the K/V read alone: the bandwidth ceiling
  python -m te_jax.bench --preset decode --backends te_jax-te,jax-cudnn --kernel-root DIR --json before.json
      the same with the kernels of the tree in DIR (git archive <commit> cpp | tar -x -C DIR): a before/after
  python -m te_jax.bench --backends te_jax-ffi,te_jax-cp,cp-ring-permutes --baseline te_jax-ffi --cp-devices 4 \\
      --batch 1 --seq 131072 --heads 32 --kv-heads 8 --head-dim 128 --causal --mode fwd
      context-parallel scaling on 4 GPUs, and the ring's permutes alone
  python -m te_jax.bench --preset packed --backends te_jax-te,te_jax-packed,jax-cudnn --baseline te_jax-te
      8 documents as one packed row (segment ids) against the batch of 8
  python -m te_jax.bench --preset features --backends te_jax-te,jax-cudnn
      plain attention, and with sinks, a bias or dropout: each feature's cost
  python -m te_jax.bench --preset cpu --backends te_jax-ffi,jax-xla
      te_jax's CPU forward against XLA's attention
"""


def configure_environment() -> None:
  """Before JAX touches a GPU: do not preallocate most of its memory, so torch backends (and --isolate's processes)
  can share it. An explicit setting wins."""
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.replace(" ", "").split(",") if x]


def _window(text: str) -> tuple[int, int]:
  parts = _ints(text)
  if len(parts) == 1:
    parts = [parts[0], 0]
  if len(parts) != 2:
    raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (or LEFT for LEFT,0), got {text!r}")
  return tuple(parts)


def parse_args(argv):
  from te_jax.bench.presets import PRESETS
  p = argparse.ArgumentParser(prog="python -m te_jax.bench", description="Benchmark te_jax's fused attention against "
                              "the other attention implementations available here, on the same inputs.",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
  p.add_argument("--list-backends", action="store_true", help="probe every backend, print available/unavailable "
                 "and why, then exit")
  p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="sweep to run (default: quick)")
  p.add_argument("--backends", help="comma list of backend names or prefixes (te_jax, jax, torch, ...); default: "
                 "every attention backend (the rows that time data movement alone, kv-read and cp-ring-permutes, run "
                 "when named)")
  p.add_argument("--baseline", help="backend speedups are relative to (default: jax-cudnn on a GPU, jax-xla on CPU)")
  p.add_argument("--mode", help="comma list of fwd, bwd, fwd+bwd (default: the preset's)")
  g = p.add_argument_group("shape flags (override the preset)")
  g.add_argument("--batch", type=int, help="batch size (default: the preset's, e.g. 16384 tokens / seq)")
  g.add_argument("--seq", type=_ints, help="comma list of query sequence lengths")
  g.add_argument("--seq-kv", type=_ints, help="comma list of key/value lengths (default: = seq)")
  g.add_argument("--heads", type=int, help="query heads (default: the preset's, e.g. 2048 / head dim)")
  g.add_argument("--kv-heads", type=int, help="key/value heads, for GQA/MQA (default: = heads)")
  g.add_argument("--head-dim", type=_ints, help="comma list of head dims")
  g.add_argument("--causal", nargs="?", const="yes", choices=["yes", "no", "both"], help="causal mask (top-left)")
  g.add_argument("--window", type=_window, help="sliding window LEFT,RIGHT (-1 = unbounded)")
  g.add_argument("--softcap", type=float, help="logit softcap (0 = off)")
  g.add_argument("--alibi", action="store_true", help="ALiBi slopes")
  g.add_argument("--dtype", help="comma list of float32, bfloat16, float16 (default: fp32 on CPU, bf16 on GPU)")
  o = p.add_argument_group("output")
  o.add_argument("--csv", help="write every result row to this CSV file")
  o.add_argument("--json", help="write metadata, availability and results to this JSON file")
  o.add_argument("--markdown", help="write a Markdown pivot table (rows: case and mode; columns: backends) here")
  o.add_argument("--plot", help="write a throughput-vs-sequence-length plot (PNG) here")
  o.add_argument("--from-json", metavar="FILE", help="measure nothing: re-render the table (and --csv/--plot) from a "
                 "previous run's --json file")
  o.add_argument("--hide-unsupported", action="store_true", help="leave unsupported rows out of the terminal table")
  o.add_argument("-q", "--quiet", action="store_true", help="no per-result progress lines")
  r = p.add_argument_group("running")
  r.add_argument("--isolate", action="store_true", help="run each backend in its own process (a crash or an OOM loses "
                 "only that measurement)")
  r.add_argument("--keep-going", action="store_true", help="record failures in the table instead of stopping")
  r.add_argument("--budget", type=float, help="seconds for the whole run; measurements past it are skipped (and "
                 "recorded as skipped)")
  r.add_argument("--no-check", action="store_true", help="skip the error check against the float64 reference")
  r.add_argument("--samples", type=int, help="timed samples per measurement (default 5)")
  r.add_argument("--sample-ms", type=float, help="target length of one timed sample in ms (default 20 on a GPU, "
                 "150 on the CPU)")
  r.add_argument("--seed", type=int, default=0)
  r.add_argument("--cp-devices", type=int, help="devices the context-parallel backends (te_jax-cp-ring, "
                 "te_jax-cp-all_gather) shard the sequence over: the first N (default: all)")
  r.add_argument("--kernel-root", metavar="DIR", help="compile te_jax's CUDA kernels from DIR/cpp, another tree's "
                 "sources (the host code stays this install's): a before/after of a kernel change, one run per tree")
  return p.parse_args(argv)


def detect_platform() -> tuple[str, str]:
  """("gpu" | "cpu" | other JAX platform, a description of the device)."""
  import jax
  backend = jax.default_backend()
  platform = "gpu" if backend in ("gpu", "cuda", "rocm") else backend
  device = jax.devices()[0]
  if platform == "cpu":
    name = host_platform.processor() or host_platform.machine()
    try:
      with open("/proc/cpuinfo") as f:
        name = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), name)
    except OSError:
      pass
    return platform, f"CPU {name} ({os.cpu_count()} cores)"
  return platform, f"{getattr(device, 'device_kind', platform)} (jax {jax.__version__})"


def select_backends(spec: str | None, everything: bool = False):
  """The backends `spec` names (names or prefixes); without one, every attention backend (every backend when
  `everything`: a row that times data movement runs only when named)."""
  from te_jax.bench import registry
  backends = registry.all_backends()
  if not spec:
    return backends if everything else [b for b in backends if b.computes_attention]
  chosen = []
  for token in (t.strip() for t in spec.split(",") if t.strip()):
    matches = [b for b in backends if b.name == token or b.name.startswith(token + "-")]
    if not matches:
      raise SystemExit(f"--backends: no backend named {token!r}; known: {', '.join(b.name for b in backends)}")
    chosen += [b for b in matches if b not in chosen]
  return chosen


# The flags that change a sweep's shapes or masks; an explicit case list (CaseList) takes none of them.
SHAPE_FLAGS = ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "causal", "window", "softcap", "alibi")


def build_sweep(args, platform: str):
  from te_jax.bench.cases import parse_dtype, parse_mode
  from te_jax.bench.presets import PRESETS, CaseList
  sweep = PRESETS[args.preset](platform)
  if isinstance(sweep, CaseList):
    refuse_shape_flags(args)
  else:
    override_shapes(sweep, args)
  if args.dtype:
    sweep.dtypes = [parse_dtype(d) for d in args.dtype.split(",") if d.strip()]
  if args.mode:
    sweep.modes = [parse_mode(m) for m in args.mode.split(",") if m.strip()]
  return sweep


def refuse_shape_flags(args) -> None:
  given = [f"--{name.replace('_', '-')}" for name in SHAPE_FLAGS if getattr(args, name) not in (None, False)]
  if given:
    raise SystemExit(f"--preset {args.preset} lists its cases one by one (batch, lengths and mask each): "
                     f"{', '.join(given)} cannot apply to it; only --dtype and --mode do (give shapes with the flags "
                     f"on a sweep preset, e.g. --preset quick)")


def override_shapes(sweep, args) -> None:
  """The shape flags given, over the sweep's fields."""
  if args.seq:
    sweep.seqs = args.seq
  if args.seq_kv:
    sweep.seqs_kv = args.seq_kv
  if args.batch is not None:
    sweep.batch, sweep.tokens = args.batch, None
  if args.heads is not None or args.kv_heads is not None or args.head_dim:
    if sweep.models and args.heads is not None:
      sweep.models = None
    if args.heads is not None:
      sweep.heads, sweep.hidden = args.heads, None
    if args.kv_heads is not None:
      if sweep.models:
        sweep.models = tuple(dataclasses.replace(m, kv_heads=args.kv_heads) for m in sweep.models)
      sweep.kv_heads = args.kv_heads
    if args.head_dim:
      if sweep.models:
        sweep.models = tuple(dataclasses.replace(m, head_dim=d) for m in sweep.models for d in args.head_dim)
      sweep.head_dims = args.head_dim
  if args.causal:
    sweep.causal = {"yes": [True], "no": [False], "both": [False, True]}[args.causal]
  if args.window:
    sweep.window = args.window
  if args.softcap is not None:
    sweep.softcap = args.softcap
  if args.alibi:
    sweep.alibi = True


def choose_baseline(requested: str | None, platform: str, availability: dict, backends) -> str:
  from te_jax.bench.registry import default_baseline
  if requested:
    return requested
  candidates = [default_baseline(platform), "jax-xla"] + [b.name for b in backends]
  for name in candidates:
    a = availability.get(name)
    if a is not None and a.available:
      return name
  return default_baseline(platform)


def _versions() -> dict:
  import importlib.metadata as md
  out = {"python": host_platform.python_version()}
  for pkg in ("jax", "jaxlib", "te_jax", "torch", "triton", "flash_attn", "flash_attn_jax"):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      pass
  return out


def render_saved(args) -> int:
  from te_jax.bench import files, table
  data, results = files.read_json_results(args.from_json)
  meta = data["metadata"]
  platform, device, baseline = meta["platform"], meta["device"], meta.get("baseline", "")
  table.print_table(results, platform, baseline, device, hide_unsupported=args.hide_unsupported)
  order = list(data.get("availability", {})) or sorted({r.backend for r in results})
  if args.csv:
    files.write_csv(args.csv, results)
  if args.markdown:
    unit, factor = table.throughput_unit(platform)
    files.write_markdown(args.markdown, results, order, baseline, unit, factor)
  if args.plot:
    from te_jax.bench.plot import plot
    plot(args.plot, results, platform, baseline, f"te_jax attention benchmark, {device}", order)
    print(f"plot: {args.plot}")
  return 0


class Interrupted(KeyboardInterrupt):
  """SIGTERM or SIGHUP while measuring, raised like Ctrl-C's KeyboardInterrupt so that both stop a sweep the same way:
  the workers killed, what was measured written out."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


@contextlib.contextmanager
def stop_on_termination():
  """SIGTERM and SIGHUP raise Interrupted inside the block (Python's default for them ends the process at once, with
  no chance to write files or kill --isolate's workers). Signals can only be handled on the main thread; elsewhere
  the block runs unchanged."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  def handler(signum, frame):
    raise Interrupted(signum)

  previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGHUP)}
  try:
    yield
  finally:
    for signum, old in previous.items():
      signal.signal(signum, old)


def timing_plan(args, platform: str):
  from te_jax.bench.timing import PLANS
  plan = PLANS.get(platform, PLANS["cpu"])
  if args.samples:
    plan = dataclasses.replace(plan, samples=args.samples, min_samples=min(plan.min_samples, args.samples))
  if args.sample_ms:
    plan = dataclasses.replace(plan, sample_s=args.sample_ms / 1e3)
  return plan


def list_backends(args, backends, platform: str, device: str) -> int:
  from te_jax.bench import table
  from te_jax.bench.availability import probe
  print(f"te_jax.bench backends on {device}:")
  if args.isolate:
    from te_jax.bench.isolate import run_isolated
    _, availability = run_isolated([], backends, platform, keep_going=True, deadline=None, check_errors=True,
                                   seed=args.seed, plan=None, probe_only=True)
  else:
    availability = {b.name: probe(b, platform) for b in backends}
  table.print_availability(availability, backends, platform, capabilities=True)
  return 0


def measured_backends(args, backends, platform: str):
  """The backends to measure, the baseline included, and the torch ones left out on the CPU (with their names)."""
  from te_jax.bench.registry import default_baseline, get
  skipped_torch = []
  if not args.backends and platform == "cpu" and not args.isolate:
    # On the CPU, torch's OpenMP threads and XLA's/te_jax's worker threads in one process slow each other down, which
    # would misstate torch; it runs on the CPU only when asked for or isolated.
    skipped_torch = [b.name for b in backends if b.framework == "torch"]
    backends = [b for b in backends if b.framework != "torch"]
  names = [b.name for b in backends]
  if args.baseline and args.baseline not in names:
    backends += select_backends(args.baseline)
  elif not args.baseline and default_baseline(platform) not in names:
    backends.append(get(default_baseline(platform)))
  return backends, skipped_torch


class Session:
  """One measuring run: its items and backends, what it has measured so far, and its output files (rewritten after
  every result, so that whatever stops the run leaves them)."""

  def __init__(self, args, argv, platform: str, device: str, backends, sweep, plan, deadline: float | None):
    from te_jax.bench import table
    self.args, self.platform, self.device, self.backends, self.plan = args, platform, device, backends, plan
    self.deadline = deadline  # time.time() after which the remaining measurements are skipped (--budget)
    self.order = [b.name for b in backends]
    self.modes = sweep.modes
    self.cases = sweep.cases(platform)
    # Shortest sequences first (stable otherwise): a time budget then cuts the longest sequences of every panel rather
    # than whole head dims or masks.
    self.items = sorted(((c, m) for c in self.cases for m in self.modes), key=lambda cm: (cm[0].seq_q, cm[0].seq_kv))
    self.item_index = {}
    for i, key in enumerate(self.items):
      self.item_index.setdefault(key, i)
    self.unit, self.factor = table.throughput_unit(platform)
    self.results, self.availability = [], {}
    self.baseline = args.baseline or ""
    self.metadata = dict(device=device, platform=platform, preset=args.preset,
                         command="python -m te_jax.bench " + " ".join(argv),
                         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                         versions=_versions(), timing=dataclasses.asdict(plan), modes=self.modes,
                         kernel_root=args.kernel_root and os.path.abspath(args.kernel_root))

  def ordered(self):
    return sorted(self.results, key=lambda r: (self.item_index.get(r.key, 0),
                                               self.order.index(r.backend) if r.backend in self.order else 99))

  def save(self):
    from te_jax.bench import files
    ordered, args = self.ordered(), self.args
    if args.csv:
      files.write_csv(args.csv, ordered)
    if args.json:
      files.write_json(args.json, ordered, dict(self.metadata, baseline=self.baseline), self.availability)
    if args.markdown:
      files.write_markdown(args.markdown, ordered, self.order, self.baseline, self.unit, self.factor)
    return ordered

  def measure(self, progress):
    """Runs the sweep; returns the failure that stopped it without --keep-going, or None."""
    def on_result(r):
      self.results.append(r)
      progress.result(r)
      self.save()

    def on_availability(a):
      self.availability[a.name] = a
      if not a.available:
        progress.set_total(progress.total - len(self.items))
      progress.log(f"  {a.name:<16} {'available' if a.available else 'unavailable'}"
                   f"{': ' + a.reason if a.reason else ''}")

    if self.args.isolate:
      return self._measure_isolated(progress, on_availability, on_result)
    return self._measure_here(progress, on_availability, on_result)

  def _measure_isolated(self, progress, on_availability, on_result):
    from te_jax.bench.isolate import run_isolated
    from te_jax.bench.registry import default_baseline
    args = self.args
    self.baseline = args.baseline or default_baseline(self.platform)
    # Most important first (a budget cuts the last): te_jax, the baseline, then the cheap torch kernels, then the
    # rest, with te_jax's second custom-call path (the same kernels) last.
    priority = {"te_jax-ffi": 0, self.baseline: 1, "te_jax-legacy": 9, "pallas": 8}
    run_order = sorted(self.backends, key=lambda b: priority.get(b.name, 2 if b.framework == "torch" else 5))
    progress.log("isolated: one process per backend; availability:")
    try:
      run_isolated(self.items, run_order, self.platform, keep_going=args.keep_going, deadline=self.deadline,
                   check_errors=not args.no_check, seed=args.seed, plan=dataclasses.asdict(self.plan),
                   on_availability=on_availability, on_start=progress.start, on_result=on_result)
    finally:
      if not args.baseline:
        self.baseline = choose_baseline(None, self.platform, self.availability, self.backends)
    return next((r for r in self.results if r.status == "failed"), None) if not args.keep_going else None

  def _measure_here(self, progress, on_availability, on_result):
    from te_jax.bench.availability import probe
    from te_jax.bench.runner import Options, SweepStopped, run_sweep
    args = self.args
    progress.log("availability (a tiny case run and compared with the float64 reference):")
    need_backward = any(m != "fwd" for m in self.modes)
    for b in self.backends:
      on_availability(probe(b, self.platform, need_backward))
    self.baseline = choose_baseline(args.baseline, self.platform, self.availability, self.backends)
    live = [b for b in self.backends if self.availability[b.name].available]
    options = Options(platform=self.platform, keep_going=args.keep_going, deadline=self.deadline,
                      check_errors=not args.no_check, seed=args.seed, plan=self.plan)
    try:
      run_sweep(self.items, live, self.availability, options, on_start=progress.start, on_result=on_result)
    except SweepStopped as e:
      return e.result
    return None

  def report(self) -> int:
    """The table, the plot and the files of what was measured; 2 when the plot cannot be drawn."""
    from te_jax.bench import table
    from te_jax.bench.results import apply_speedups
    apply_speedups(self.results, self.baseline)
    ordered = self.save()
    table.print_table(ordered, self.platform, self.baseline, self.device, hide_unsupported=self.args.hide_unsupported)
    unavailable = [a for a in self.availability.values() if not a.available]
    if unavailable:
      print("unavailable: " + "; ".join(f"{a.name} ({a.reason})" for a in unavailable))
    code = self._plot(ordered)
    for path in (self.args.csv, self.args.json, self.args.markdown):
      if path:
        print(f"wrote {path}")
    return code

  def _plot(self, ordered) -> int:
    if not self.args.plot:
      return 0
    from te_jax.bench.plot import plot
    try:
      plot(self.args.plot, ordered, self.platform, self.baseline, f"te_jax attention benchmark, {self.device}",
           self.order)
    except ImportError as e:
      print(f"--plot needs matplotlib (pip install 'te_jax[bench]'): {e}", file=sys.stderr)
      return 2
    print(f"plot: {self.args.plot}")
    return 0


def run(args, argv) -> int:
  from te_jax.bench.progress import Progress
  t_start = time.time()
  platform, device = detect_platform()
  backends = select_backends(args.backends, everything=args.list_backends)
  if args.list_backends:
    return list_backends(args, backends, platform, device)
  backends, skipped_torch = measured_backends(args, backends, platform)
  session = Session(args, argv, platform, device, backends, build_sweep(args, platform), timing_plan(args, platform),
                    deadline=t_start + args.budget if args.budget else None)
  if skipped_torch:
    print(f"note: {', '.join(skipped_torch)} left out on the CPU in one process (thread pools contend); add "
          f"--isolate or --backends to include them", flush=True)
  print(f"te_jax.bench: preset {args.preset}, {len(session.cases)} cases x {len(session.modes)} modes x "
        f"{len(backends)} backends on {device}"
        f"{', kernels from ' + session.metadata['kernel_root'] if args.kernel_root else ''}", flush=True)
  stopped, interrupted = None, None
  try:
    with stop_on_termination(), Progress(len(session.items) * len(backends), session.unit, session.factor,
                                         quiet=args.quiet) as progress:
      stopped = session.measure(progress)
  except KeyboardInterrupt as e:  # Ctrl-C, or Interrupted: report what was measured before it
    interrupted = e.signum if isinstance(e, Interrupted) else signal.SIGINT
  code = session.report()
  print(f"done in {time.time() - t_start:.0f} s")
  if interrupted is not None:
    print(f"interrupted by {signal.Signals(interrupted).name} after {len(session.results)} results; the table and "
          f"files above hold what was measured", file=sys.stderr)
    return 128 + interrupted
  if stopped is not None:
    print(f"stopped: {stopped.backend} failed on {stopped.case.shape_label} {stopped.case.mask_label} {stopped.mode}: "
          f"{stopped.reason}\n(use --keep-going to record failures and continue)", file=sys.stderr)
    return 1
  return code


def main(argv=None) -> int:
  configure_environment()
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.cp_devices is not None:
    if args.cp_devices < 2:
      raise SystemExit(f"--cp-devices must be 2 or more, got {args.cp_devices}")
    from te_jax.bench.backends_jax import ContextParallelBackend
    os.environ[ContextParallelBackend.DEVICES_ENV] = str(args.cp_devices)
  if args.kernel_root:
    from te_jax.bench import kernel_root
    kernel_root.choose(args.kernel_root)
    kernel_root.apply()
  if args.from_json:
    return render_saved(args)
  return run(args, argv)


if __name__ == "__main__":
  sys.exit(main())
