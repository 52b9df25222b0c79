"""The summary plot of docs/BENCHMARKS.md: te_jax's speed as a ratio to cuDNN for each capability, from the committed
data of the measurements the summary table cites (docs/bench/*.json); each group names its card and date.

  python scripts/summary_plot.py docs/bench docs/bench/summary.png"""

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
  """(label, cuDNN / te) of the decode preset's b 8 / b 64 shapes, the geometric mean over the rounds' files."""
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
  shapes = [(d, s, True) for d in (64, 128, 256) for s in (1024, 4096, 16384)]
  groups = [
      ("forward (H200, 2026-12-04)", _cuda_bench(at("h200-fwd-bwd.json"), "fwd", "fwd", shapes)),
      ("forward + backward (H200, 2026-12-04)", _cuda_bench(at("h200-fwd-bwd.json"), "fwd+bwd", "f+b", shapes)),
      ("decode, two rounds (H200, 2026-12-05)",
       _decode([at(f"h200-decode-round{r}.json") for r in (1, 2)])),
      ("decode, today's kernels, two rounds (H100, 2026-12-05)",
       [(f"H100 {label}", ratio) for label, ratio in _decode([at(f"h100-decode-round{r}.json") for r in (1, 2)])]),
      ("with a bias / dropout (H200, 2026-12-04)",
       _features(at("h200-bias.json"), "bias") + _features(at("h200-dropout.json"), "dropout")),
  ]
  colors = ("C0", "C1", "C2", "C4", "C3")
  labels, ratios, bar_colors = [], [], []
  for (_, items), color in zip(groups, colors):
    for label, ratio in items:
      labels.append(label)
      ratios.append(ratio)
      bar_colors.append(color)
  fig, ax = plt.subplots(figsize=(12, 4.8))
  ax.bar(range(len(ratios)), ratios, color=bar_colors)
  ax.axhline(1.0, color="gray", linewidth=0.8)
  ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
  ax.set_ylabel("te_jax / cuDNN speed (higher is better)")
  ax.legend(handles=[Patch(color=color, label=name) for (name, _), color in zip(groups, colors)],
            fontsize=8, loc="upper left")
  ax.set_title("te_jax against cuDNN (jax.nn.dot_product_attention), bf16: NVIDIA H200, and an H100 for today's "
               "decode kernels", fontsize=10)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  fig.savefig(dst, dpi=110)


if __name__ == "__main__":
  main(*sys.argv[1:3])
