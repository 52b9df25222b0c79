"""Ahead-of-time compilation of te_jax's CUDA kernels: `python -m te_jax.aot [--set NAME] [--arch sm_90a] [--jobs N]`.

Compiles a named set of configurations in parallel into the disk cache ($TE_JAX_CACHE_DIR), for production images
(later processes find every kernel in milliseconds) and for CI (NVRTC runs without a GPU, so this proves that every
shipped configuration compiles). Exit status 1 if any configuration fails, with NVRTC's log; 2 if nothing could be
compiled (no CUDA backend in this install, NVRTC not found) or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import sys
import time

DTYPES = {"bfloat16": 1, "float16": 2}
BIAS_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}  # an additive bias's dtype (core codes)
VARIANTS = [(False, False), (True, False), (False, True), (True, True)]
COMMON_HEAD_DIMS = [(64, 64), (128, 128), (256, 256)]
SETS = ("common", "all-head-dims", "ci", "bench", "tests")


class CompilerUnavailable(Exception):
  """No kernel can be compiled here: the CUDA extension or NVRTC is missing. The message says what was searched."""


def config_set(name: str, arch: str) -> list[dict]:
  """Named sets: 'common' (bf16/fp16, D = Dv in 64/128/256, every variant, every direction), 'all-head-dims' (bf16,
  every D = Dv multiple of 8 up to 256, plain variant), 'ci' (a small cross-section incl. D != Dv), 'bench', 'tests'.
  Module kinds: forward, decode (the forward of few query positions), backward and the deterministic backward; and
  with tokens (segment ids or positions), dropout or an additive bias (of a dtype), forward and both backwards."""
  def make(direction, dtype, d, dv, softcap=False, alibi=False, tokens=False, dropout=False, bias=None,
           bias_fits_tma=False):
    kind, _, det = direction.partition("-")
    return dict(direction="forward" if kind == "decode" else kind, decode=kind == "decode", dtype=DTYPES[dtype],
                head_dim=d, head_dim_v=dv, softcap=softcap, alibi=alibi, deterministic=det == "deterministic",
                tokens=tokens, dropout=dropout, bias_dtype=None if bias is None else BIAS_DTYPES[bias],
                bias_fits_tma=bias_fits_tma, arch=arch)

  # The backward's two module kinds: atomic dq (the default) and fused_attn(deterministic=True).
  both = ("forward", "decode", "backward", "backward-deterministic")
  # Packed sequences (segment ids, positions), dropout and a bias run kernels built with them; never the decode kernels.
  packed = ("forward", "backward", "backward-deterministic")
  if name == "common":
    return [make(dr, dt, d, dv, sc, al) for dr, dt, (d, dv), (sc, al) in
            itertools.product(both, DTYPES, COMMON_HEAD_DIMS, VARIANTS)] + \
           [make(dr, dt, d, dv, sc, al, tokens=True) for dr, dt, (d, dv), (sc, al) in
            itertools.product(packed, DTYPES, COMMON_HEAD_DIMS, VARIANTS)] + \
           [make(dr, dt, d, dv, dropout=True) for dr, dt, (d, dv) in itertools.product(packed, DTYPES, COMMON_HEAD_DIMS)]
  if name == "all-head-dims":
    return [make(dr, "bfloat16", d, d) for dr in both for d in range(8, 257, 8)]
  if name == "ci":
    return [make(dr, dt, d, dv, sc, al) for dr in both for dt, d, dv, sc, al in
            (("bfloat16", 128, 128, False, False), ("float16", 64, 64, True, True), ("bfloat16", 40, 72, True, False),
             ("bfloat16", 256, 256, False, True), ("float16", 8, 8, False, False))] + \
           [make(dr, dt, d, dv, sc, al, tokens=True) for dr in packed for dt, d, dv, sc, al in
            (("bfloat16", 128, 128, False, False), ("float16", 64, 64, True, True))] + \
           [make(dr, "bfloat16", 128, 128, dropout=True) for dr in packed] + \
           [make(dr, dt, d, dv, sc, al, bias=bias, bias_fits_tma=fits)
            for dr in packed for fits in (False, True) for dt, d, dv, sc, al, bias in
            (("bfloat16", 128, 128, False, False, "bfloat16"), ("float16", 64, 64, True, True, "float32"))]
  if name == "bench":
    return [make(dr, "bfloat16", d, d) for dr in both for d in (64, 128, 256)]
  if name == "tests":
    from te_jax import _cuda_test_configs
    return [dict(c, arch=arch) for c in _cuda_test_configs.CONFIGS]
  raise ValueError(f"unknown configuration set {name!r}; known: {', '.join(SETS)}")


def load_compiler():
  """The CUDA extension, with NVRTC loaded. Raises CompilerUnavailable once, before any configuration is tried, so a
  missing NVRTC is one message rather than one per configuration."""
  try:
    from te_jax import _cuda  # sets the kernel root and the NVRTC search paths
  except ImportError as e:
    raise CompilerUnavailable(f"te_jax was installed without its CUDA backend (the _te_jax_cuda extension is built "
                              f"when CUDA headers are found at install time): {e}") from None
  try:
    _cuda.ext.nvrtc_version()
  except RuntimeError as e:
    raise CompilerUnavailable(str(e)) from None
  return _cuda.ext


def compile_all(configs: list[dict], jobs: int, log=print) -> list[tuple[dict, str]]:
  """Compiles configurations in parallel threads (NVRTC releases the GIL); returns the failures."""
  ext = load_compiler()
  failures = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    futures = {pool.submit(ext.compile, c): c for c in configs}
    for future in concurrent.futures.as_completed(futures):
      config = futures[future]
      try:
        report = future.result()
        log(f"{report['origin']:>8}  {report['seconds']:7.2f} s  {report['name']}")
      except Exception as e:  # noqa: BLE001 - report every failure, then exit non-zero
        failures.append((config, str(e)))
        log(f"  FAILED  {ext.kernel_name(config)}: {e}")
  return failures


def _set_names(text: str) -> list[str]:
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in SETS]
  if unknown or not names:
    raise argparse.ArgumentTypeError(f"unknown configuration set {', '.join(unknown) or repr(text)}; known: "
                                     f"{', '.join(SETS)} (comma-separated for several)")
  return names


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
  return value


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="python -m te_jax.aot", description=__doc__.split("\n\n")[1],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--set", type=_set_names, default="common",
                      help=f"configuration sets, comma-separated: {', '.join(SETS)}")
  parser.add_argument("--arch", default="sm_90a", help="NVRTC --gpu-architecture (sm_80, sm_86, sm_89, sm_90a, ...)")
  parser.add_argument("--jobs", type=_positive_int, default=os.cpu_count() or 1,
                      help="parallel compiles (by default one per CPU)")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  # The length guard that other engines (cuDNN) run around their calls: one small module per arch, in every set.
  configs = [dict(kind="length_guard", arch=args.arch)]
  configs += [c for name in args.set for c in config_set(name, args.arch)]
  try:
    ext = load_compiler()
  except CompilerUnavailable as e:
    print(f"python -m te_jax.aot: nothing compiled: {e}", file=sys.stderr)
    return 2
  start = time.perf_counter()
  failures = compile_all(configs, args.jobs)
  print(f"{len(configs) - len(failures)}/{len(configs)} configurations ready in {time.perf_counter() - start:.1f} s "
        f"({ext.nvrtc_version()}, cache {ext.cache_dir()})")
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
