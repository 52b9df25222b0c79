"""python -m te_jax.bench (console script: te-jax-bench). See --help, and te_jax/bench/__init__.py for the layout."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform as host_platform
import sys
import time

EXAMPLES = """examples:
  python -m te_jax.bench                              quick sweep on whatever is here (about a minute on a CPU)
  python -m te_jax.bench --list-backends              which backends run here, and why not
  python -m te_jax.bench --preset fa --mode fwd,fwd+bwd --csv fa.csv --plot fa.png --keep-going --isolate
  python -m te_jax.bench --preset llama --backends te_jax-ffi,jax-cudnn,torch-flash
  python -m te_jax.bench --seq 4096 --heads 32 --kv-heads 8 --head-dim 128 --causal --window 1023,0 --mode fwd
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
  p.add_argument("--backends", help="comma list of backend names or prefixes (te_jax, jax, torch, ...); default: all")
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


def select_backends(spec: str | None):
  from te_jax.bench import registry
  backends = registry.all_backends()
  if not spec:
    return backends
  chosen = []
  for token in (t.strip() for t in spec.split(",") if t.strip()):
    matches = [b for b in backends if b.name == token or b.name.startswith(token + "-")]
    if not matches:
      raise SystemExit(f"--backends: no backend named {token!r}; known: {', '.join(b.name for b in backends)}")
    chosen += [b for b in matches if b not in chosen]
  return chosen


def build_sweep(args, platform: str):
  from te_jax.bench.cases import parse_dtype, parse_mode
  from te_jax.bench.presets import PRESETS
  sweep = PRESETS[args.preset](platform)
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
  if args.dtype:
    sweep.dtypes = [parse_dtype(d) for d in args.dtype.split(",") if d.strip()]
  if args.mode:
    sweep.modes = [parse_mode(m) for m in args.mode.split(",") if m.strip()]
  return sweep


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


def main(argv=None) -> int:
  configure_environment()
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if args.from_json:
    return render_saved(args)
  t_start = time.time()
  deadline = t_start + args.budget if args.budget else None
  from te_jax.bench import files, table
  from te_jax.bench.availability import probe
  from te_jax.bench.progress import Progress
  from te_jax.bench.registry import default_baseline
  from te_jax.bench.results import apply_speedups
  from te_jax.bench.runner import Options, SweepStopped, run_sweep
  from te_jax.bench.timing import PLANS

  platform, device = detect_platform()
  backends = select_backends(args.backends)
  unit, factor = table.throughput_unit(platform)
  plan = PLANS.get(platform, PLANS["cpu"])
  if args.samples:
    plan = dataclasses.replace(plan, samples=args.samples, min_samples=min(plan.min_samples, args.samples))
  if args.sample_ms:
    plan = dataclasses.replace(plan, sample_s=args.sample_ms / 1e3)

  if args.list_backends:
    print(f"te_jax.bench backends on {device}:")
    if args.isolate:
      from te_jax.bench.isolate import run_isolated
      _, availability = run_isolated([], backends, platform, keep_going=True, deadline=None, check_errors=True,
                                     seed=args.seed, plan=None, probe_only=True)
    else:
      availability = {b.name: probe(b, platform) for b in backends}
    table.print_availability(availability, backends, platform, capabilities=True)
    return 0

  skipped_torch = []
  if not args.backends and platform == "cpu" and not args.isolate:
    # On the CPU, torch's OpenMP threads and XLA's/te_jax's worker threads in one process slow each other down, which
    # would misstate torch; it runs on the CPU only when asked for or isolated.
    skipped_torch = [b.name for b in backends if b.framework == "torch"]
    backends = [b for b in backends if b.framework != "torch"]
  sweep = build_sweep(args, platform)
  cases = sweep.cases(platform)
  # Shortest sequences first (stable otherwise): a time budget then cuts the longest sequences of every panel rather
  # than whole head dims or masks.
  items = sorted(((c, m) for c in cases for m in sweep.modes), key=lambda cm: (cm[0].seq_q, cm[0].seq_kv))
  if args.baseline and args.baseline not in [b.name for b in backends]:
    backends += select_backends(args.baseline)
  elif not args.baseline:
    from te_jax.bench.registry import get
    base = default_baseline(platform)
    if base not in [b.name for b in backends]:
      backends.append(get(base))
  order = [b.name for b in backends]
  if skipped_torch:
    print(f"note: {', '.join(skipped_torch)} left out on the CPU in one process (thread pools contend); add "
          f"--isolate or --backends to include them", flush=True)
  print(f"te_jax.bench: preset {args.preset}, {len(cases)} cases x {len(sweep.modes)} modes x {len(backends)} "
        f"backends on {device}", flush=True)

  results, availability = [], {}
  metadata = dict(device=device, platform=platform, preset=args.preset, command="python -m te_jax.bench " + " ".join(argv),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  versions=_versions(), timing=dataclasses.asdict(plan), modes=sweep.modes)

  def save():
    ordered = sorted(results, key=lambda r: (item_index.get(r.key, 0), order.index(r.backend)
                                             if r.backend in order else 99))
    if args.csv:
      files.write_csv(args.csv, ordered)
    if args.json:
      files.write_json(args.json, ordered, dict(metadata, baseline=baseline), availability)
    if args.markdown:
      files.write_markdown(args.markdown, ordered, order, baseline, unit, factor)
    return ordered

  item_index = {}
  for i, key in enumerate(items):
    item_index.setdefault(key, i)
  baseline = args.baseline or ""
  stopped = None
  with Progress(len(items) * len(backends), unit, factor, quiet=args.quiet) as progress:
    def on_result(r):
      results.append(r)
      progress.result(r)
      if args.csv or args.json or args.markdown:
        save()

    def on_availability(a):
      availability[a.name] = a
      if not a.available:
        progress.set_total(progress.total - len(items))
      progress.log(f"  {a.name:<16} {'available' if a.available else 'unavailable'}"
                   f"{': ' + a.reason if a.reason else ''}")

    if args.isolate:
      from te_jax.bench.isolate import run_isolated
      baseline = args.baseline or default_baseline(platform)
      # Most important first (a budget cuts the last): te_jax, the baseline, then the cheap torch kernels, then the
      # rest, with te_jax's second custom-call path (the same kernels) last.
      priority = {"te_jax-ffi": 0, baseline: 1, "te_jax-legacy": 9, "pallas": 8}
      run_order = sorted(backends, key=lambda b: priority.get(b.name, 2 if b.framework == "torch" else 5))
      progress.log("isolated: one process per backend; availability:")
      plan_dict = dataclasses.asdict(plan)
      run_isolated(items, run_order, platform, keep_going=args.keep_going, deadline=deadline,
                   check_errors=not args.no_check, seed=args.seed, plan=plan_dict, on_availability=on_availability,
                   on_start=progress.start, on_result=on_result)
      if not args.baseline:
        baseline = choose_baseline(None, platform, availability, backends)
      stopped = next((r for r in results if r.status == "failed"), None) if not args.keep_going else None
    else:
      progress.log("availability (a tiny case run and compared with the float64 reference):")
      need_backward = any(m != "fwd" for m in sweep.modes)
      for b in backends:
        on_availability(probe(b, platform, need_backward))
      baseline = choose_baseline(args.baseline, platform, availability, backends)
      live = [b for b in backends if availability[b.name].available]
      try:
        run_sweep(items, live, availability, Options(platform=platform, keep_going=args.keep_going, deadline=deadline,
                                                     check_errors=not args.no_check, seed=args.seed, plan=plan),
                  on_start=progress.start, on_result=on_result)
      except SweepStopped as e:
        stopped = e.result
  apply_speedups(results, baseline)
  ordered = save()
  table.print_table(ordered, platform, baseline, device, hide_unsupported=args.hide_unsupported)
  unavailable = [a for a in availability.values() if not a.available]
  if unavailable:
    print("unavailable: " + "; ".join(f"{a.name} ({a.reason})" for a in unavailable))
  if args.plot:
    from te_jax.bench.plot import plot
    try:
      plot(args.plot, ordered, platform, baseline, f"te_jax attention benchmark, {device}", order)
      print(f"plot: {args.plot}")
    except ImportError as e:
      print(f"--plot needs matplotlib (pip install 'te_jax[bench]'): {e}", file=sys.stderr)
      return 2
  for path in (args.csv, args.json, args.markdown):
    if path:
      print(f"wrote {path}")
  print(f"done in {time.time() - t_start:.0f} s")
  if stopped is not None:
    print(f"stopped: {stopped.backend} failed on {stopped.case.shape_label} {stopped.case.mask_label} {stopped.mode}: "
          f"{stopped.reason}\n(use --keep-going to record failures and continue)", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
