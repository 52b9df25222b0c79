"""What each optional feature of issue 12 costs over plain attention on the GPU, with cuDNN beside where jax.nn has the
same feature: sinks, an additive [1, H, S, S] bias, a [B, 1, 1, S] one (key_bias: a key mask's shape), dropout
(jax.nn has no dropout: cuDNN's comes through JAX's own private cuDNN call, jax._src.cudnn.fused_attention_stablehlo).

  python scripts/feature_cost.py [--features sinks,bias,dropout] [--seq 4096] [--dim 128] [--heads 16] [--repeats 20]
                                 [--calls 10] [--json out.json] [--kernel-root DIR]

b * s = 16k tokens, causal, bf16, te_jax's engine. Each line: the feature's time against plain attention in the same
run (forward, and forward + backward), measured in alternation, each sample `calls` calls dispatched back to back. A
feature the installed te_jax cannot run on this device is reported as such, not skipped silently. Run from outside
the source folder's parent (the installed te_jax). --kernel-root DIR compiles te_jax's kernels from DIR/cpp (another
tree's, for a before / after figure in separate processes)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import te_jax


def seconds(runs: dict, repeats: int, calls: int) -> dict:
  """Seconds per call of each jitted (fn, args) in `runs`: the best of `repeats` samples, each `calls` calls dispatched
  back to back (so the GPU never waits on the host between them), the entries measured in alternation."""
  for fn, args in runs.values():
    jax.block_until_ready(fn(*args))
  times = {name: [] for name in runs}
  for _ in range(repeats):
    for name, (fn, args) in runs.items():
      start = time.perf_counter()
      for _ in range(calls):
        result = fn(*args)
      jax.block_until_ready(result)
      times[name].append((time.perf_counter() - start) / calls)
  return {name: min(t) for name, t in times.items()}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--features", default="sinks,bias,dropout")
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--dim", type=int, default=128)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--calls", type=int, default=10, help="calls per timed sample, dispatched back to back")
  ap.add_argument("--json", default="", help="also write the rows here (docs/bench/h200-features.json's format)")
  ap.add_argument("--kernel-root", default="", help="compile te_jax's kernels from this tree instead")
  args = ap.parse_args()
  if args.kernel_root:
    from te_jax import _cuda  # noqa: PLC0415 - only a CUDA build has it, and only --kernel-root needs it
    _cuda.ext.set_kernel_root(args.kernel_root)
  s, d, h = args.seq, args.dim, args.heads
  b = max(1, 16384 // s)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(3))
  options = {
      "sinks": dict(sink_logits=jnp.asarray(rng.standard_normal(h), jnp.float32)),
      "bias": dict(bias=jnp.asarray(rng.standard_normal((1, h, s, s)), jnp.bfloat16)),
      "key_bias": dict(bias=jnp.asarray(rng.standard_normal((b, 1, 1, s)), jnp.bfloat16)),
      "dropout": dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)),
  }

  def te(**kw):
    return lambda q, k, v: te_jax.fused_attn(q, k, v, mask_type="causal", engine="te", **kw)

  def cudnn(**kw):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn", **kw)

  def cudnn_private(rate):
    from jax._src.cudnn import fused_attention_stablehlo as sdpa  # noqa: PLC0415 - only where dropout is measured
    return lambda q, k, v: sdpa.dot_product_attention(q, k, v, scale=d**-0.5, mask_type=sdpa.MaskType.CAUSAL,
                                                      dropout_rate=rate)

  peers = {"bias": lambda: (cudnn(), cudnn(bias=options["bias"]["bias"])),
           "key_bias": lambda: (cudnn(), cudnn(bias=options["key_bias"]["bias"])),
           "dropout": lambda: (cudnn_private(0.0), cudnn_private(0.1))}

  def modes(attn):
    loss = lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32))
    return {"fwd": jax.jit(attn), "fwd+bwd": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}

  print(f"{jax.devices()[0].device_kind}, bf16, causal, b {b} x s {s}, h {h}, d {d}, best of {args.repeats} samples "
        f"of {args.calls} calls")
  print(f"{'feature':9s} {'mode':8s} {'plain ms':>9s} {'with ms':>9s} {'cost':>7s}   cuDNN plain / with (ms)")
  rows = []
  for feature in args.features.split(","):
    for mode in ("fwd", "fwd+bwd"):
      ours = {"plain": (modes(te())[mode], (q, k, v)), "with": (modes(te(**options[feature]))[mode], (q, k, v))}
      line = f"{feature:9s} {mode:8s} "
      row = dict(feature=feature, mode=mode)
      rows.append(row)
      try:
        t = seconds(ours, args.repeats, args.calls)
        line += f"{t['plain'] * 1e3:9.3f} {t['with'] * 1e3:9.3f} {t['with'] / t['plain'] - 1:+7.1%}"
        row.update(te_plain_ms=t["plain"] * 1e3, te_with_ms=t["with"] * 1e3)
      except Exception as e:  # noqa: BLE001 - say what this build cannot run, and go on
        line += f"te_jax not run: {str(e).splitlines()[0][:80]}"
      if feature in peers:
        try:
          plain, with_feature = peers[feature]()
          t = seconds({"plain": (modes(plain)[mode], (q, k, v)), "with": (modes(with_feature)[mode], (q, k, v))},
                      args.repeats, args.calls)
          line += f"   {t['plain'] * 1e3:.3f} / {t['with'] * 1e3:.3f} ({t['with'] / t['plain'] - 1:+.1%})"
          row.update(cudnn_plain_ms=t["plain"] * 1e3, cudnn_with_ms=t["with"] * 1e3)
        except Exception as e:  # noqa: BLE001
          line += f"   cuDNN not run: {str(e).splitlines()[0][:60]}"
      else:
        line += "   (cuDNN has no such option in JAX)"
      print(line)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, jax=jax.__version__,
                     command="python scripts/feature_cost.py " + " ".join(sys.argv[1:]),
                     shape=dict(b=b, s=s, h=h, d=d, causal=True, dtype="bfloat16"), repeats=args.repeats,
                     calls=args.calls, rows=rows),
                f, indent=1)


if __name__ == "__main__":
  main()
