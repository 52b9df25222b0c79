"""The summary plot of docs/BENCHMARKS.md: te_jax's speed as a ratio to cuDNN on the H200 for each capability, from
the committed data of the runs that measured it (docs/bench/*.json).

  python scripts/summary_plot.py docs/bench docs/bench/h200-summary.png"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402


def _cuda_bench(path: str, mode: str, label: str, shapes) -> list[tuple[str, float]]:
  """(label, te / cuDNN) of scripts/cuda_bench.py rows: shapes are (d, s, causal) in the order wanted."""
  rows = json.load(open(path))["rows"]
  out = []
  for d, s, causal in shapes:
    r = next(r for r in rows if (r["d"], r["s"], r["causal"], r["hkv"]) == (d, s, causal, r["h"]))
    length = f"{s // 1024}k" if s >= 1024 else str(s)
    out.append((f"{label} d{d} s{length}{' causal' if causal else ''}", r[f"te_{mode}"] / r[f"jax-cudnn_{mode}"]))
  return out


def _decode(paths: list[str]) -> list[tuple[str, float]]:
  """(label, cuDNN / te) of the decode preset's issue shapes, the geometric mean over the runs' rounds."""
  rounds = [[r for r in json.load(open(p))["results"] if r["status"] == "ok"] for p in paths]
  out = []
  for batch, seq_q, seq_kv in ((8, 1, 8192), (8, 1, 32768), (64, 1, 4096), (8, 16, 8192)):
    product = 1.0
    for results in rounds:
      ms = {r["backend"]: r["median_ms"] for r in results
            if (r["batch"], r["seq_q"], r["seq_kv"]) == (batch, seq_q, seq_kv)}
      product *= ms["jax-cudnn"] / ms["te_jax-te"]
    out.append((f"decode b{batch} q{seq_q} kv{seq_kv // 1024}k", product ** (1.0 / len(rounds))))
  return out


def _features(path: str, feature: str) -> list[tuple[str, float]]:
  return [(f"{r['feature']} {r['mode']}", r["cudnn_with_ms"] / r["te_with_ms"])
          for r in json.load(open(path))["rows"] if r["feature"] == feature and "cudnn_with_ms" in r]


def main(bench_dir: str, dst: str) -> None:
  at = lambda name: os.path.join(bench_dir, name)  # noqa: E731
  groups = [
      ("forward (run 61c)",
       _cuda_bench(at("h200-run61c.json"), "fwd", "fwd",
                   [(d, s, True) for d in (64, 128, 256) for s in (1024, 4096, 16384)])),
      ("forward + backward (run 61c)",
       _cuda_bench(at("h200-run61c.json"), "fwd+bwd", "f+b",
                   [(d, s, True) for d in (64, 128, 256) for s in (1024, 4096, 16384)])),
      ("decode (run 68, two rounds)", _decode([at(f"h200-decode-run68-{r}.json") for r in (1, 2)])),
      ("with a bias (run 46) / dropout (run 62c)",
       _features(at("h200-bias-sm90.json"), "bias") + _features(at("h200-dropout-run62c.json"), "dropout")),
  ]
  labels, ratios, colors = [], [], []
  for (_, items), color in zip(groups, ("C0", "C1", "C2", "C3")):
    for label, ratio in items:
      labels.append(label)
      ratios.append(ratio)
      colors.append(color)
  fig, ax = plt.subplots(figsize=(11, 4.8))
  ax.bar(range(len(ratios)), ratios, color=colors)
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
  ax.set_ylabel("te_jax / cuDNN speed (higher is better)")
  ax.legend(handles=[Patch(color=color, label=name) for (name, _), color in zip(groups, ("C0", "C1", "C2", "C3"))],
            fontsize=8, loc="upper left")
  ax.set_title("te_jax against cuDNN (jax.nn.dot_product_attention), NVIDIA H200, bf16, runs of 2026-12-03 to 05",
               fontsize=10)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(dst, dpi=110)


if __name__ == "__main__":
  main(*sys.argv[1:3])
