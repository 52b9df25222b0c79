"""Plots a scripts/cuda_bench.py JSON: each te_jax engine's speed as a ratio to cuDNN (jax.nn.dot_product_attention,
implementation="cudnn") per shape, forward and forward+backward side by side.
Usage: python scripts/engine_plot.py docs/bench/h200-engines.json docs/bench/h200-engines.png"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
  data = json.load(open(src))
  rows = data["rows"]
  engines = [e for e in data["args"]["engines"].split(",")]
  modes = data["args"]["modes"].split(",")
  labels = [f"d{r['d']} s{r['s'] // 1024 or r['s']}{'k' if r['s'] >= 1024 else ''}{' c' if r['causal'] else ''}"
            for r in rows]
  fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 4.5), sharey=True, squeeze=False)
  axes = axes[0]
  for ax, mode in zip(axes, modes):
    for engine, marker in zip(engines, "osx^"):
      ratio = [r[f"{engine}_{mode}"] / r[f"jax-cudnn_{mode}"] for r in rows]
      ax.plot(range(len(rows)), ratio, marker=marker, linestyle="-", label=f"te_jax engine={engine}")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.axhline(0.98, color="gray", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(rows)), labels, rotation=70, fontsize=7)
    ax.set_title(f"{mode}: speed / cuDNN's (bf16, b·s = 16k, hidden 2048)")
    ax.set_ylim(0.0, 1.3)
    ax.grid(axis="y", alpha=0.3)
  axes[0].set_ylabel("× cuDNN (same run)")
  axes[0].legend(loc="lower right")
  fig.suptitle(f"{data['device']}, jax {data['jax']}, {data['date']}: scripts/cuda_bench.py", fontsize=10)
  fig.tight_layout()
  fig.savefig(dst, dpi=110)


if __name__ == "__main__":
  main(*sys.argv[1:3])
